// Paged attention for a flat batch of query rows (prefill chunks and decode rows alike) over a
// head-major KV cache [kv_heads, slots, head_dim] of fp32, bf16, fp16 or int8 (+ per-slot scales).
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
#include <atomic>
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
enum CacheType { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_I8 = 2, CACHE_F16 = 3 };

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
    else if constexpr (TYPE == CACHE_F16) return f16_to_f32(static_cast<const uint16_t*>(c.data)[row * c.D + d]);
    else return float(static_cast<const int8_t*>(c.data)[row * c.D + d]) * c.scale[row];
}

#if defined(TM_AVX512)
template <int TYPE>
inline __m512 load_row16(const CacheView& c, int64_t row, int d) {
    if constexpr (TYPE == CACHE_F32) return _mm512_loadu_ps(static_cast<const float*>(c.data) + row * c.D + d);
    else if constexpr (TYPE == CACHE_BF16) return load_bf16x16(static_cast<const uint16_t*>(c.data) + row * c.D + d);
    else if constexpr (TYPE == CACHE_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(c.data) + row * c.D + d)));
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
    else if constexpr (TYPE == CACHE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(c.data) + row * c.D + d)));
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

// Scores q . k_j: per key, 16 partial sums p_l (l = d mod 16, each a chain over d = l, l+16, ...: a
// product, then fused multiply-adds), then a fixed tree: p_l + p_(l+8), then + 4, + 2, + 1. The tile
// path below holds keys in lanes (K transposed, shared by the rows of a work item); the per-key path
// (CacheTile::scores) holds dims in lanes and needs no transposition. Both run these exact
// operations, so a row's scores do not depend on which path its work item took.
//
// NN heads at once share the K loads. Chains l and l+8 run side by side and are added as soon as
// they end (the tree's first level), which keeps NN * 8 partial sums in registers, not NN * 16.
template <int NN>
inline void tile_scores_of(const float* const* q, const float* kt, int D, V16* s) {
    V16 h[NN][8];
    for (int l = 0; l < 8; ++l) {
        V16 a[NN], b[NN];
        V16 ka = vload(kt + l * TILE), kb = vload(kt + (l + 8) * TILE);
        for (int n = 0; n < NN; ++n) {
            a[n] = vmul(vset1(q[n][l]), ka);
            b[n] = vmul(vset1(q[n][l + 8]), kb);
        }
        for (int d = 16; d < D; d += 16) {
            ka = vload(kt + (d + l) * TILE);
            kb = vload(kt + (d + l + 8) * TILE);
            for (int n = 0; n < NN; ++n) {
                a[n] = vfma(vset1(q[n][d + l]), ka, a[n]);
                b[n] = vfma(vset1(q[n][d + l + 8]), kb, b[n]);
            }
        }
        for (int n = 0; n < NN; ++n) h[n][l] = vadd(a[n], b[n]);
    }
    for (int n = 0; n < NN; ++n) {
        for (int w = 4; w >= 1; w /= 2)
            for (int l = 0; l < w; ++l) h[n][l] = vadd(h[n][l], h[n][l + w]);
        s[n] = h[n][0];
    }
}

template <int N>
inline void tile_scores(const float* const* q, const float* kt, int D, V16* s) {
    if constexpr (N == 3) {
        tile_scores_of<3>(q, kt, D, s);
    } else {
        int n = 0;
        for (; n + 2 <= N; n += 2) tile_scores_of<2>(q + n, kt, D, s + n);
        if (n < N) tile_scores_of<1>(q + n, kt, D, s + n);
    }
}

// The 16 keys of a tile as one source of V rows (and, for the per-key path, K rows), fp32 [16][D].
struct ScratchTile {
    const float* kt;
    const float* vt;
    int D;
    template <int N>
    void scores(const float* const* q, int, int, V16* s) const { tile_scores<N>(q, kt, D, s); }
    V16 v(int j, int d) const { return vload(vt + j * D + d); }
};

#if defined(TM_AVX512) || defined(TM_AVX2)
template <int TYPE>
inline V16 load16(const CacheView& c, int64_t row, int d) {
#if defined(TM_AVX512)
    return {load_row16<TYPE>(c, row, d)};
#else
    return {load_row8<TYPE>(c, row, d), load_row8<TYPE>(c, row, d + 8)};
#endif
}

// t[j]'s 16 lanes summed by the tree of tile_scores, for 16 keys at once: lane j of the result is key j.
inline V16 reduce_lanes(V16 t[16]) {
#if defined(TM_AVX512)
    __m512 c[8], e[4], g[2];
    for (int i = 0; i < 8; ++i)  // l + (l+8): two keys per vector, 8 partials each
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i].v, t[2 * i + 1].v, 0x44),
                             _mm512_shuffle_f32x4(t[2 * i].v, t[2 * i + 1].v, 0xEE));
    for (int i = 0; i < 4; ++i)  // + 4: 128-bit lane k holds key 4i+k's 4 partials
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)  // + 2: lane k holds keys 8i+k and 8i+4+k, 2 partials each
        g[i] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0xEE));
    // + 1: element 4k+e holds key 4e+k
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
    return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s)};
#else
    __m256 c[16], e[8], g[4], s[2];
    for (int i = 0; i < 16; ++i) c[i] = _mm256_add_ps(t[i].lo, t[i].hi);  // l + (l+8)
    for (int i = 0; i < 8; ++i)  // + 4: 128-bit lane k holds key 2i+k
        e[i] = _mm256_add_ps(_mm256_permute2f128_ps(c[2 * i], c[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(c[2 * i], c[2 * i + 1], 0x31));
    for (int i = 0; i < 4; ++i)  // + 2: lane k holds keys 4i+k and 4i+2+k
        g[i] = _mm256_add_ps(_mm256_shuffle_ps(e[2 * i], e[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(e[2 * i], e[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)  // + 1: element 4k+e holds key 8i+2e+k
        s[i] = _mm256_add_ps(_mm256_shuffle_ps(g[2 * i], g[2 * i + 1], 0x88),
                             _mm256_shuffle_ps(g[2 * i], g[2 * i + 1], 0xDD));
    const __m256i idx = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    return {_mm256_permutevar8x32_ps(s[0], idx), _mm256_permutevar8x32_ps(s[1], idx)};
#endif
}

// A decode row's tile read straight from the cache: K rows dotted with the queries without a
// transposed copy, V rows converted as they are accumulated. Worth it for one query row; several
// rows share the ScratchTile's conversions instead.
template <int TYPE>
struct CacheTile {
    const CacheView* k;
    const CacheView* vc;
    int64_t row0;
    int D;
    template <int N>
    void scores(const float* const* q, int first, int last, V16* s) const {
        V16 t[N][TILE];
        for (int j = 0; j < TILE; ++j) {
            if (j < first || j > last) {
                for (int n = 0; n < N; ++n) t[n][j] = vzero();
                continue;
            }
            V16 acc[N];
            const V16 k0 = load16<TYPE>(*k, row0 + j, 0);
            for (int n = 0; n < N; ++n) acc[n] = vmul(vload(q[n]), k0);
            for (int d = 16; d < D; d += 16) {
                const V16 kd = load16<TYPE>(*k, row0 + j, d);
                for (int n = 0; n < N; ++n) acc[n] = vfma(vload(q[n] + d), kd, acc[n]);
            }
            for (int n = 0; n < N; ++n) t[n][j] = acc[n];
        }
        for (int n = 0; n < N; ++n) s[n] = reduce_lanes(t[n]);
    }
    V16 v(int j, int d) const { return load16<TYPE>(*vc, row0 + j, d); }
};
constexpr bool kPerKeyPath = true;
#else
constexpr bool kPerKeyPath = false;
#endif

// acc[d] = acc[d] * alpha (if rescaling) + sum over j = first..last, in order, of p[j] * v[j][d].
template <int N, int B, typename Tile>
inline void accumulate_block(RowState* st, const float (*p)[TILE], const bool* rescale, const V16* alpha, int first,
                             int last, const Tile& tile, int d) {
    constexpr int C = B / 16;
    V16 acc[N][C];
    for (int n = 0; n < N; ++n)
        for (int c = 0; c < C; ++c) {
            acc[n][c] = vload(st[n].acc + d + 16 * c);
            if (rescale[n]) acc[n][c] = vmul(acc[n][c], alpha[n]);
        }
    for (int j = first; j <= last; ++j) {
        V16 v[C];
        for (int c = 0; c < C; ++c) v[c] = tile.v(j, d + 16 * c);
        for (int n = 0; n < N; ++n) {
            const V16 pj = vset1(p[n][j]);
            for (int c = 0; c < C; ++c) acc[n][c] = vfma(pj, v[c], acc[n][c]);
        }
    }
    for (int n = 0; n < N; ++n)
        for (int c = 0; c < C; ++c) vstore(st[n].acc + d + 16 * c, acc[n][c]);
}

template <int N, typename Tile>
inline void attend_group(const float* const* q, RowState* st, const Tile& tile, int first, int last, int D) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    V16 s[N], alpha[N];
    for (int n = 0; n < N; ++n) alpha[n] = vset1(1.0f);
    bool rescale[N];
    alignas(64) float p[N][TILE];
    tile.template scores<N>(q, first, last, s);
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
    for (; d + V_BLOCK <= D; d += V_BLOCK) accumulate_block<N, V_BLOCK>(st, p, rescale, alpha, first, last, tile, d);
    for (; d < D; d += 16) accumulate_block<N, 16>(st, p, rescale, alpha, first, last, tile, d);
}

// The G heads of one row, in groups of at most MAX_GROUP.
template <typename Tile>
inline void attend_row(const float* const* q, RowState* st, int G, const Tile& tile, int first, int last, int D) {
    for (int g = 0; g < G; g += MAX_GROUP) {
        switch (std::min(MAX_GROUP, G - g)) {
            case 1: attend_group<1>(q + g, st + g, tile, first, last, D); break;
            case 2: attend_group<2>(q + g, st + g, tile, first, last, D); break;
            case 3: if constexpr (MAX_GROUP >= 3) attend_group<3>(q + g, st + g, tile, first, last, D); break;
            default: if constexpr (MAX_GROUP >= 4) attend_group<4>(q + g, st + g, tile, first, last, D); break;
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
    std::vector<const float*> qp;
    std::vector<RowState> st;
};

// Tiles ahead to prefetch, into L2 (the line-fill buffers of L1 are few, and filling them with
// prefetches stalled the loads of the tile being computed). Measured with the per-key decode path,
// 64 sequences x 112 and x 1024 keys (bench/paged_attention.py, Zen 4): 1-3 tiles ahead ran alike,
// 4 and 8 up to 1.4x slower.
constexpr int PREFETCH_TILES = 2;

// Where a work item's keys lie. Tiles are numbered in position order: tile t is block t / per_block
// at offset (t % per_block) * 16.
struct ItemTiles {
    const Problem& P;
    const int32_t* table;
    int64_t head_row, lo, pos_last, t_first, t_end;
    int per_block;
    ItemTiles(const Problem& p, const WorkItem& it)
        : P(p), table(p.tables + it.seq * p.table_width), head_row(int64_t(it.kv_head) * p.k.num_slots) {
        const int64_t pos0 = int64_t(P.start_pos[it.seq]) + it.first_row;
        pos_last = pos0 + it.num_rows - 1;
        lo = first_key(pos0);
        per_block = (P.block_size + TILE - 1) / TILE;
        t_first = lo / P.block_size * per_block;
        t_end = (pos_last / P.block_size + 1) * per_block;
    }
    int64_t first_key(int64_t pos) const { return P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : int64_t(0); }
    int64_t start(int64_t t) const { return t / per_block * P.block_size + (t % per_block) * TILE; }
    int64_t end(int64_t t) const { return std::min<int64_t>(start(t) + TILE, (t / per_block + 1) * P.block_size) - 1; }
    int64_t row(int64_t t) const { return head_row + int64_t(table[t / per_block]) * P.block_size + (t % per_block) * TILE; }
    bool has(int64_t t) const { return t < t_end && start(t) <= pos_last && end(t) >= lo; }
    // Blocks are scattered, so the hardware prefetcher cannot guess the next one.
    template <int TYPE>
    void prefetch(int64_t t) const {
        // Volatile asm: gcc proves a function whose only effects are __builtin_prefetch pure, and
        // drops its calls.
        auto l2 = [](const void* p) {
#if defined(__x86_64__)
            asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
            __builtin_prefetch(p, 0, 2);
#endif
        };
        if (!has(t)) return;
        const int64_t bytes = std::min<int64_t>(TILE, pos_last + 1 - start(t)) * P.k.row_bytes;
        const char* k = static_cast<const char*>(P.k.data) + row(t) * P.k.row_bytes;
        const char* v = static_cast<const char*>(P.v.data) + row(t) * P.k.row_bytes;
        for (int64_t off = 0; off < bytes; off += 64) {
            l2(k + off);
            l2(v + off);
        }
        if constexpr (TYPE == CACHE_I8) {
            l2(P.k.scale + row(t));
            l2(P.v.scale + row(t));
        }
    }
    // The first PREFETCH_TILES tiles: a short decode context is mostly these, so without this most of
    // its tiles would be waited for one after another.
    template <int TYPE>
    void prefetch_first() const {
        int64_t t = t_first;
        while (t < t_end && end(t) < lo) ++t;
        for (int i = 0; i < PREFETCH_TILES; ++i) prefetch<TYPE>(t + i);
    }
};

template <int TYPE>
void run_item(const Problem& P, const WorkItem& it, Scratch& sc) {
    // G: this item's query heads, from the kv head's first_head-th on.
    const int D = P.D, G = it.num_heads, n = it.num_rows * G;
    const int64_t head0 = int64_t(it.kv_head) * P.G + it.first_head;
    const int64_t row0 = P.cu_rows[it.seq] + it.first_row;
    const ItemTiles tiles(P, it);
    tiles.prefetch_first<TYPE>();
    const int64_t pos0 = tiles.pos_last - (it.num_rows - 1), lo = tiles.lo;

    sc.q.resize(size_t(n) * D);
    sc.acc.assign(size_t(n) * D, 0.0f);
    sc.lane_sums.assign(size_t(n) * TILE, 0.0f);
    sc.qp.resize(size_t(n));
    sc.st.resize(size_t(n));
    const float** qp = sc.qp.data();
    RowState* st = sc.st.data();
    for (int r = 0; r < it.num_rows; ++r)
        for (int g = 0; g < G; ++g) {
            const int i = r * G + g;
            const float* src = P.q + (row0 + r) * P.q_row_stride + (head0 + g) * P.q_head_stride;
            float* dst = sc.q.data() + size_t(i) * D;
            for (int d = 0; d < D; ++d) dst[d] = src[d] * P.scale;
            qp[i] = dst;
            st[i] = RowState{-std::numeric_limits<float>::infinity(), sc.lane_sums.data() + size_t(i) * TILE,
                             sc.acc.data() + size_t(i) * D};
        }

    for (int64_t t = tiles.t_first; t < tiles.t_end; ++t) {
        const int64_t ts = tiles.start(t), te = tiles.end(t);  // inclusive
        if (te < lo) continue;
        if (ts > tiles.pos_last) break;
        tiles.prefetch<TYPE>(t + PREFETCH_TILES);
        const int first = int(std::max(ts, lo) - ts), last = int(std::min(te, tiles.pos_last) - ts);
        const int64_t row = tiles.row(t);
#if defined(TM_AVX512) || defined(TM_AVX2)
        if (kPerKeyPath && it.num_rows == 1) {
            attend_row(qp, st, G, CacheTile<TYPE>{&P.k, &P.v, row, D}, first, last, D);
            continue;
        }
#endif
        load_k_tile<TYPE>(P.k, row, first, last, sc.kt.data());
        load_v_tile<TYPE>(P.v, row, first, last, sc.vt.data());
        const ScratchTile tile{sc.kt.data(), sc.vt.data(), D};
        for (int r = 0; r < it.num_rows; ++r) {
            const int64_t pos = pos0 + r, a = std::max(ts, tiles.first_key(pos)), e = std::min(te, pos);
            if (a > e) continue;
            attend_row(qp + r * G, st + r * G, G, tile, int(a - ts), int(e - ts), D);
        }
    }

    for (int i = 0; i < n; ++i) {
        const int r = i / G, g = i % G;
        const V16 total = vset1(vsum_all(vload(st[i].lane_sums)));
        float* dst = P.out + ((row0 + r) * P.H + head0 + g) * int64_t(D);
        for (int d = 0; d < D; d += 16) vstore(dst + d, vdiv(vload(st[i].acc + d), total));
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
    if (cache_type < CACHE_F32 || cache_type > CACHE_F16) throw std::invalid_argument("bad cache type");
    const int64_t row_bytes = int64_t(D) * (cache_type == CACHE_F32 ? 4 : cache_type == CACHE_I8 ? 1 : 2);
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
        else if (cache_type == CACHE_F16) run_item<CACHE_F16>(P, it, sc);
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
    auto prefetch_first = [&](const WorkItem& it) {
        const ItemTiles tiles(P, it);
        if (cache_type == CACHE_F32) tiles.prefetch_first<CACHE_F32>();
        else if (cache_type == CACHE_BF16) tiles.prefetch_first<CACHE_BF16>();
        else if (cache_type == CACHE_F16) tiles.prefetch_first<CACHE_F16>();
        else tiles.prefetch_first<CACHE_I8>();
    };
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
    {
        Scratch sc; scratch(sc);
        // Handed out one at a time, but claimed one ahead: the next item's first tiles load while
        // this one computes (at short contexts those are most of an item's tiles).
        int64_t i = next.fetch_add(1);
        while (i < count) {
            const int64_t j = next.fetch_add(1);
            if (j < count) prefetch_first(items[j]);
            run(items[i], sc);
            i = j;
        }
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
