// Paged attention for a flat batch of query rows (prefill chunks and decode rows alike) over a
// head-major KV cache [kv_heads, slots, head_dim] of fp32, bf16 or int8 (+ per-slot scales).
//
// Batch invariance is the design constraint: a row's result must not depend on which other rows
// share its step or its work item. So keys are consumed in fixed tiles of at most 16 positions,
// aligned to their block (a tile never depends on where the work item's key range starts), tiles
// in position order, and every row runs the same fp32 operations on a tile: 16 scores at once,
// masked to the row's own keys, one online-softmax update, then V accumulated key by key. Rows of
// a work item only share the tile's loads (K converted and transposed once, V converted once).
// Work items are (sequence, kv head, run of query rows); one row's keys never span threads.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "simd16.h"

// gcc 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_ps) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace py = pybind11;

namespace tmk {
namespace {

constexpr int TILE = 16;  // key positions per tile; the score vector's width
enum CacheType { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_I8 = 2 };

using namespace simd16;  // V16: 16 fp32 lanes per ISA (csrc/simd16.h)

// ---- Loading one tile of K (transposed: kt[d * 16 + key]) or V (vt[key * D + d]) as fp32.
// Only keys first..last are read; K's other lanes are zero (they are masked out of every row).
struct CacheView {
    const void* data;
    const float* scale;  // int8 only: [kv_heads, slots]
    int64_t num_slots;
    int D;
    int64_t row_bytes;  // D * element size
};

template <int TYPE>
inline float load_one(const CacheView& c, int64_t row, int d) {  // row = head * num_slots + slot
    if constexpr (TYPE == CACHE_F32) return static_cast<const float*>(c.data)[row * c.D + d];
    else if constexpr (TYPE == CACHE_BF16) return bf16_to_f32(static_cast<const uint16_t*>(c.data)[row * c.D + d]);
    else return float(static_cast<const int8_t*>(c.data)[row * c.D + d]) * c.scale[row];
}

#if defined(TM_AVX512)
template <int TYPE>
inline __m512 load_row16(const CacheView& c, int64_t row, int d) {
    if constexpr (TYPE == CACHE_F32) return _mm512_loadu_ps(static_cast<const float*>(c.data) + row * c.D + d);
    else if constexpr (TYPE == CACHE_BF16) return load_bf16x16(static_cast<const uint16_t*>(c.data) + row * c.D + d);
    else {
        __m128i b = _mm_loadu_si128((const __m128i*)(static_cast<const int8_t*>(c.data) + row * c.D + d));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(c.scale[row]));
    }
}

// 16x16 in registers: r[key] (lanes = 16 dims) -> r[dim] (lanes = 16 keys).
inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    // r[4i+k], 128-bit lane L, holds keys 4i..4i+3 of dim 4L+k.
    for (int k = 0; k < 4; ++k) {
        __m512 u0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), u1 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        __m512 u2 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD), u3 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
        t[k] = _mm512_shuffle_f32x4(u0, u1, 0x88);
        t[8 + k] = _mm512_shuffle_f32x4(u0, u1, 0xDD);
        t[4 + k] = _mm512_shuffle_f32x4(u2, u3, 0x88);
        t[12 + k] = _mm512_shuffle_f32x4(u2, u3, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

template <int TYPE>
void load_k_tile(const CacheView& c, int64_t row0, int first, int last, float* kt) {
    for (int d = 0; d < c.D; d += 16) {
        __m512 r[16];
        for (int j = 0; j < 16; ++j) r[j] = j >= first && j <= last ? load_row16<TYPE>(c, row0 + j, d) : _mm512_setzero_ps();
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (d + i) * TILE, r[i]);
    }
}

template <int TYPE>
void load_v_tile(const CacheView& c, int64_t row0, int first, int last, float* vt) {
    for (int j = first; j <= last; ++j)
        for (int d = 0; d < c.D; d += 16) _mm512_storeu_ps(vt + j * c.D + d, load_row16<TYPE>(c, row0 + j, d));
}
#elif defined(TM_AVX2)
template <int TYPE>
inline __m256 load_row8(const CacheView& c, int64_t row, int d) {
    if constexpr (TYPE == CACHE_F32) return _mm256_loadu_ps(static_cast<const float*>(c.data) + row * c.D + d);
    else if constexpr (TYPE == CACHE_BF16) return load_bf16x8(static_cast<const uint16_t*>(c.data) + row * c.D + d);
    else {
        __m128i b = _mm_loadl_epi64((const __m128i*)(static_cast<const int8_t*>(c.data) + row * c.D + d));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(c.scale[row]));
    }
}

inline void transpose8(__m256 r[8]) {
    __m256 t[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        r[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {
        t[k] = _mm256_permute2f128_ps(r[k], r[4 + k], 0x20);
        t[4 + k] = _mm256_permute2f128_ps(r[k], r[4 + k], 0x31);
    }
    for (int i = 0; i < 8; ++i) r[i] = t[i];
}

template <int TYPE>
void load_k_tile(const CacheView& c, int64_t row0, int first, int last, float* kt) {
    for (int half = 0; half < 2; ++half)
        for (int d = 0; d < c.D; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; ++i) {
                int j = half * 8 + i;
                r[i] = j >= first && j <= last ? load_row8<TYPE>(c, row0 + j, d) : _mm256_setzero_ps();
            }
            transpose8(r);
            for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (d + i) * TILE + half * 8, r[i]);
        }
}

template <int TYPE>
void load_v_tile(const CacheView& c, int64_t row0, int first, int last, float* vt) {
    for (int j = first; j <= last; ++j)
        for (int d = 0; d < c.D; d += 8) _mm256_storeu_ps(vt + j * c.D + d, load_row8<TYPE>(c, row0 + j, d));
}
#else
template <int TYPE>
void load_k_tile(const CacheView& c, int64_t row0, int first, int last, float* kt) {
    for (int j = 0; j < TILE; ++j)
        for (int d = 0; d < c.D; ++d) kt[d * TILE + j] = j >= first && j <= last ? load_one<TYPE>(c, row0 + j, d) : 0.0f;
}

template <int TYPE>
void load_v_tile(const CacheView& c, int64_t row0, int first, int last, float* vt) {
    for (int j = first; j <= last; ++j)
        for (int d = 0; d < c.D; ++d) vt[j * c.D + d] = load_one<TYPE>(c, row0 + j, d);
}
#endif

// ---- A group of query vectors (heads of one row) against one tile. The vectors are interleaved
// only to share K/V loads and overlap their dependency chains: each one's arithmetic is exactly
// what it would be alone, so how heads are grouped never changes a bit.

// Vectors per group and output dims per pass of the V accumulation, sized to the register file.
#if defined(TM_AVX512)
constexpr int MAX_GROUP = 4, V_BLOCK = 64;
#elif defined(TM_AVX2)
constexpr int MAX_GROUP = 2, V_BLOCK = 32;
#else
constexpr int MAX_GROUP = 4, V_BLOCK = 64;
#endif

// Running softmax state of one (row, head): max, per-lane sums, and the unnormalised output.
struct RowState {
    float max;
    float* lane_sums;  // 16
    float* acc;        // D
};

// Scores q . k_j of 16 keys: four partial sums over d (d mod 4), added pairwise at the end.
template <int N>
inline void tile_scores(const float* const* q, const float* kt, int D, V16* s) {
    V16 a[N][4];
    for (int n = 0; n < N; ++n) a[n][0] = a[n][1] = a[n][2] = a[n][3] = vzero();
    for (int d = 0; d < D; d += 4) {
        const V16 k0 = vload(kt + d * TILE), k1 = vload(kt + (d + 1) * TILE);
        const V16 k2 = vload(kt + (d + 2) * TILE), k3 = vload(kt + (d + 3) * TILE);
        for (int n = 0; n < N; ++n) {
            a[n][0] = vfma(vset1(q[n][d]), k0, a[n][0]);
            a[n][1] = vfma(vset1(q[n][d + 1]), k1, a[n][1]);
            a[n][2] = vfma(vset1(q[n][d + 2]), k2, a[n][2]);
            a[n][3] = vfma(vset1(q[n][d + 3]), k3, a[n][3]);
        }
    }
    for (int n = 0; n < N; ++n) s[n] = vadd(vadd(a[n][0], a[n][1]), vadd(a[n][2], a[n][3]));
}

// acc[d] = acc[d] * alpha (if rescaling) + sum over j = first..last, in order, of p[j] * v[j][d].
template <int N, int B>
inline void accumulate_block(RowState* st, const float (*p)[TILE], const bool* rescale, const V16* alpha, int first,
                             int last, const float* vt, int D, int d) {
    constexpr int C = B / 16;
    V16 acc[N][C];
    for (int n = 0; n < N; ++n)
        for (int c = 0; c < C; ++c) {
            acc[n][c] = vload(st[n].acc + d + 16 * c);
            if (rescale[n]) acc[n][c] = vmul(acc[n][c], alpha[n]);
        }
    for (int j = first; j <= last; ++j) {
        V16 v[C];
        for (int c = 0; c < C; ++c) v[c] = vload(vt + j * D + d + 16 * c);
        for (int n = 0; n < N; ++n) {
            const V16 pj = vset1(p[n][j]);
            for (int c = 0; c < C; ++c) acc[n][c] = vfma(pj, v[c], acc[n][c]);
        }
    }
    for (int n = 0; n < N; ++n)
        for (int c = 0; c < C; ++c) vstore(st[n].acc + d + 16 * c, acc[n][c]);
}

template <int N>
inline void attend_group(const float* const* q, RowState* st, const float* kt, const float* vt, int first, int last,
                         int D) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    V16 s[N], alpha[N];
    for (int n = 0; n < N; ++n) alpha[n] = vset1(1.0f);
    bool rescale[N];
    alignas(64) float p[N][TILE];
    tile_scores<N>(q, kt, D, s);
    for (int n = 0; n < N; ++n) {
        s[n] = vselect(first, last, s[n], vset1(neg_inf));
        const float tile_max = vmax_all(s[n]);
        V16 sums = vload(st[n].lane_sums);
        rescale[n] = false;
        if (tile_max > st[n].max) {
            if (st[n].max != neg_inf) {  // what earlier tiles accumulated was relative to a smaller max
                alpha[n] = vexp(vset1(st[n].max - tile_max));
                sums = vmul(sums, alpha[n]);
                rescale[n] = true;
            }
            st[n].max = tile_max;
        }
        const V16 pn = vselect(first, last, vexp(vadd(s[n], vset1(-st[n].max))), vzero());
        vstore(st[n].lane_sums, vadd(sums, pn));
        vstore(p[n], pn);
    }
    int d = 0;
    for (; d + V_BLOCK <= D; d += V_BLOCK) accumulate_block<N, V_BLOCK>(st, p, rescale, alpha, first, last, vt, D, d);
    for (; d < D; d += 16) accumulate_block<N, 16>(st, p, rescale, alpha, first, last, vt, D, d);
}

// The G heads of one row, in groups of at most MAX_GROUP.
inline void attend_row(const float* const* q, RowState* st, int G, const float* kt, const float* vt, int first,
                       int last, int D) {
    for (int g = 0; g < G; g += MAX_GROUP) {
        switch (std::min(MAX_GROUP, G - g)) {
            case 1: attend_group<1>(q + g, st + g, kt, vt, first, last, D); break;
            case 2: attend_group<2>(q + g, st + g, kt, vt, first, last, D); break;
            case 3: if constexpr (MAX_GROUP >= 3) attend_group<3>(q + g, st + g, kt, vt, first, last, D); break;
            default: if constexpr (MAX_GROUP >= 4) attend_group<4>(q + g, st + g, kt, vt, first, last, D); break;
        }
    }
}

// ---- The batch.
struct Problem {
    const float* q; int64_t q_row_stride, q_head_stride;
    float* out;  // [T, H, D] contiguous
    int H, Hkv, G, D;
    CacheView k, v;
    const int32_t* cu_rows; const int32_t* start_pos; const int32_t* tables; int64_t table_width;
    int block_size, window;
    float scale;
};

struct WorkItem {
    int seq, kv_head, first_row, num_rows;  // rows relative to the sequence's chunk
    int first_head, num_heads;              // of the kv head's query heads (all of them unless split)
    int64_t cost;
};

struct Scratch {
    std::vector<float> kt, vt, q, acc, lane_sums;
};

// Tiles ahead to prefetch. Into L2, not L1: the line-fill buffers of L1 are few, and filling them
// with prefetches stalled the loads of the tile being computed (measured: L2 at 4 tiles ahead ran
// 1.4x faster per tile than L1 at 2; both ~2x faster than no prefetch on scattered blocks).
constexpr int PREFETCH_TILES = 4;

template <int TYPE>
void run_item(const Problem& P, const WorkItem& it, Scratch& sc) {
    // G: this item's query heads, from the kv head's first_head-th on.
    const int D = P.D, G = it.num_heads, bs = P.block_size, n = it.num_rows * G;
    const int64_t head0 = int64_t(it.kv_head) * P.G + it.first_head;
    const int64_t row0 = P.cu_rows[it.seq] + it.first_row;
    const int64_t pos0 = int64_t(P.start_pos[it.seq]) + it.first_row, pos_last = pos0 + it.num_rows - 1;
    auto first_key = [&](int64_t pos) { return P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : int64_t(0); };
    const int64_t lo = first_key(pos0);

    sc.q.resize(size_t(n) * D);
    sc.acc.assign(size_t(n) * D, 0.0f);
    sc.lane_sums.assign(size_t(n) * TILE, 0.0f);

    for (int r = 0; r < it.num_rows; ++r)
        for (int g = 0; g < G; ++g) {
            const float* src = P.q + (row0 + r) * P.q_row_stride + (head0 + g) * P.q_head_stride;
            float* dst = sc.q.data() + size_t(r * G + g) * D;
            for (int d = 0; d < D; ++d) dst[d] = src[d] * P.scale;
        }

    std::vector<const float*> qp(n);
    std::vector<RowState> st(n);
    for (int i = 0; i < n; ++i) {
        qp[i] = sc.q.data() + size_t(i) * D;
        st[i] = RowState{-std::numeric_limits<float>::infinity(), sc.lane_sums.data() + size_t(i) * TILE,
                         sc.acc.data() + size_t(i) * D};
    }

    const int32_t* table = P.tables + it.seq * P.table_width;
    const int64_t head_row = int64_t(it.kv_head) * P.k.num_slots;
    // Tiles numbered in position order: tile t is block t / per_block at offset (t % per_block) * 16.
    const int per_block = (bs + TILE - 1) / TILE;
    const int64_t t_first = lo / bs * per_block, t_end = (pos_last / bs + 1) * per_block;
    auto tile_start = [&](int64_t t) { return t / per_block * bs + (t % per_block) * TILE; };
    auto tile_row = [&](int64_t t) { return head_row + int64_t(table[t / per_block]) * bs + (t % per_block) * TILE; };
    for (int64_t t = t_first; t < t_end; ++t) {
        const int64_t ts = tile_start(t), te = std::min<int64_t>(ts + TILE, (t / per_block + 1) * bs) - 1;  // inclusive
        if (te < lo) continue;
        if (ts > pos_last) break;
        // Blocks are scattered, so the hardware prefetcher cannot guess the next one: ask for the
        // tile PREFETCH_TILES ahead while this one computes.
        const int64_t ahead = t + PREFETCH_TILES;
        if (ahead < t_end && tile_start(ahead) <= pos_last) {
            // Written out here: gcc drops calls to a helper whose only effect is prefetching.
            const int64_t bytes = std::min<int64_t>(TILE, pos_last + 1 - tile_start(ahead)) * P.k.row_bytes;
            const char* k = static_cast<const char*>(P.k.data) + tile_row(ahead) * P.k.row_bytes;
            const char* v = static_cast<const char*>(P.v.data) + tile_row(ahead) * P.k.row_bytes;
            for (int64_t off = 0; off < bytes; off += 64) {
                __builtin_prefetch(k + off, 0, 2);
                __builtin_prefetch(v + off, 0, 2);
            }
            if constexpr (TYPE == CACHE_I8) {
                __builtin_prefetch(P.k.scale + tile_row(ahead), 0, 2);
                __builtin_prefetch(P.v.scale + tile_row(ahead), 0, 2);
            }
        }
        const int first = int(std::max(ts, lo) - ts), last = int(std::min(te, pos_last) - ts);
        const int64_t row = tile_row(t);
        load_k_tile<TYPE>(P.k, row, first, last, sc.kt.data());
        load_v_tile<TYPE>(P.v, row, first, last, sc.vt.data());
        for (int r = 0; r < it.num_rows; ++r) {
            const int64_t pos = pos0 + r, a = std::max(ts, first_key(pos)), e = std::min(te, pos);
            if (a > e) continue;
            attend_row(qp.data() + r * G, st.data() + r * G, G, sc.kt.data(), sc.vt.data(), int(a - ts), int(e - ts), D);
        }
    }

    for (int r = 0; r < it.num_rows; ++r)
        for (int g = 0; g < G; ++g) {
            const int i = r * G + g;
            const float total = vsum_all(vload(sc.lane_sums.data() + size_t(i) * TILE));
            const float* acc = sc.acc.data() + size_t(i) * D;
            float* dst = P.out + ((row0 + r) * P.H + head0 + g) * int64_t(D);
            for (int d = 0; d < D; ++d) dst[d] = acc[d] / total;
        }
}

// Query rows per work item: enough to amortise each tile's conversion and transposition, few
// enough that the rows' accumulators (rows * G * D floats, <= 64 KB) stay in L2.
int rows_per_item(int G, int D) { return std::max(1, std::min(32, 16384 / (G * D))); }

void paged_attention(uintptr_t q, int64_t q_row_stride, int64_t q_head_stride, uintptr_t out, int64_t T, int H, int D,
                     uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scale, uintptr_t v_scale, int cache_type,
                     int Hkv, int64_t num_slots, uintptr_t cu_rows, uintptr_t start_pos, int S, uintptr_t block_tables,
                     int64_t table_width, int block_size, double scale, int window) {
    if (D % 16 != 0 || D <= 0) throw std::invalid_argument("head_dim must be a positive multiple of 16");
    if (Hkv <= 0 || H % Hkv != 0) throw std::invalid_argument("query heads must be a multiple of kv heads");
    if (block_size <= 0 || num_slots % block_size != 0) throw std::invalid_argument("bad block_size");
    if (cache_type < CACHE_F32 || cache_type > CACHE_I8) throw std::invalid_argument("bad cache type");
    const int64_t row_bytes = int64_t(D) * (cache_type == CACHE_F32 ? 4 : cache_type == CACHE_BF16 ? 2 : 1);
    Problem P{ptr<const float>(q), q_row_stride, q_head_stride, ptr<float>(out), H, Hkv, H / Hkv, D,
              CacheView{ptr<const void>(k_cache), cache_type == CACHE_I8 ? ptr<const float>(k_scale) : nullptr, num_slots, D, row_bytes},
              CacheView{ptr<const void>(v_cache), cache_type == CACHE_I8 ? ptr<const float>(v_scale) : nullptr, num_slots, D, row_bytes},
              ptr<const int32_t>(cu_rows), ptr<const int32_t>(start_pos), ptr<const int32_t>(block_tables), table_width,
              block_size, window, float(scale)};

    // Check every block the kernel will read before any thread starts (no throwing inside OpenMP).
    const int64_t num_blocks = num_slots / block_size;
    const int step = rows_per_item(P.G, D);
    std::vector<WorkItem> items;
    if (P.cu_rows[0] != 0 || P.cu_rows[S] != T) throw std::invalid_argument("cu_rows must run from 0 to T");
    for (int s = 0; s < S; ++s) {
        const int rows = P.cu_rows[s + 1] - P.cu_rows[s];
        if (rows < 0) throw std::invalid_argument("cu_rows must be non-decreasing");
        if (rows == 0) continue;
        const int64_t first = P.start_pos[s], last = first + rows - 1;
        if (first < 0) throw std::invalid_argument("negative start_pos");
        if (last / block_size >= table_width) throw std::invalid_argument("block table too narrow for sequence " + std::to_string(s));
        const int64_t lo = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
        for (int64_t b = lo / block_size; b <= last / block_size; ++b) {
            const int32_t id = P.tables[s * table_width + b];
            if (id < 0 || id >= num_blocks) throw std::out_of_range("block id out of range in sequence " + std::to_string(s));
        }
        for (int r = 0; r < rows; r += step) {
            const int n = std::min(step, rows - r);
            const int64_t p_last = first + r + n - 1;
            const int64_t keys = p_last + 1 - (window > 0 ? std::max<int64_t>(0, first + r - window + 1) : 0);
            for (int h = 0; h < Hkv; ++h) items.push_back({s, h, r, n, 0, P.G, keys * (n + 4)});
        }
    }
    // Too few items to keep every thread busy (one sequence decoding, few kv heads): split each
    // item's query heads. Heads never interact, so this changes no result, only who loads the tiles.
    const int threads_wanted = num_threads();
    while (int64_t(items.size()) < 2 * threads_wanted) {
        std::vector<WorkItem> split;
        for (const WorkItem& it : items) {
            if (it.num_heads < 2) { split.push_back(it); continue; }
            const int half = it.num_heads / 2;
            split.push_back({it.seq, it.kv_head, it.first_row, it.num_rows, it.first_head, half, it.cost / 2});
            split.push_back({it.seq, it.kv_head, it.first_row, it.num_rows, it.first_head + half, it.num_heads - half,
                             it.cost - it.cost / 2});
        }
        if (split.size() == items.size()) break;
        items.swap(split);
    }
    // Longest first, handed out one at a time: balances a long prefill against many decodes.
    std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

    auto run = [&](const WorkItem& it, Scratch& sc) {
        if (cache_type == CACHE_F32) run_item<CACHE_F32>(P, it, sc);
        else if (cache_type == CACHE_BF16) run_item<CACHE_BF16>(P, it, sc);
        else run_item<CACHE_I8>(P, it, sc);
    };
    const int64_t count = int64_t(items.size());
    int threads = int(std::min<int64_t>(num_threads(), count));
    auto scratch = [&](Scratch& sc) { sc.kt.resize(size_t(D) * TILE); sc.vt.resize(size_t(D) * TILE); };
    if (threads <= 1) {
        Scratch sc; scratch(sc);
        for (const WorkItem& it : items) run(it, sc);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        Scratch sc; scratch(sc);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; ++i) run(items[i], sc);
    }
#else
    Scratch sc; scratch(sc);
    for (const WorkItem& it : items) run(it, sc);
#endif
}

}  // namespace

void entry::paged_attention(const float* q, int64_t q_row_stride, int64_t q_head_stride, float* out, int64_t T, int H,
                            int D, const void* k_cache, const void* v_cache, const float* k_scale, const float* v_scale,
                            int cache_type, int Hkv, int64_t num_slots, const int32_t* cu_rows,
                            const int32_t* start_pos, int S, const int32_t* block_tables, int64_t table_width,
                            int block_size, float scale, int window) {
    tmk::paged_attention(uintptr_t(q), q_row_stride, q_head_stride, uintptr_t(out), T, H, D, uintptr_t(k_cache),
                         uintptr_t(v_cache), uintptr_t(k_scale), uintptr_t(v_scale), cache_type, Hkv, num_slots,
                         uintptr_t(cu_rows), uintptr_t(start_pos), S, uintptr_t(block_tables), table_width, block_size,
                         scale, window);
}
}  // namespace tmk

void register_kv_write(py::module_& m);

void register_paged_attention(py::module_& m) {
    m.def("paged_attention", &tmk::paged_attention, py::call_guard<py::gil_scoped_release>(),
          "Attention of T query rows over a paged [Hkv, slots, D] cache (raw addresses; see kernels/attention.py)",
          py::arg("q"), py::arg("q_row_stride"), py::arg("q_head_stride"), py::arg("out"), py::arg("T"), py::arg("H"),
          py::arg("D"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"),
          py::arg("cache_type"), py::arg("Hkv"), py::arg("num_slots"), py::arg("cu_rows"), py::arg("start_pos"),
          py::arg("S"), py::arg("block_tables"), py::arg("table_width"), py::arg("block_size"), py::arg("scale"),
          py::arg("window"));
    register_kv_write(m);
}
