// The tile-level math of paged attention (csrc/paged_attention.cpp runs it over a batch) on 16 keys
// of K/V (csrc/attention_load.h loads them): the scores of a row's query heads against them, one
// online-softmax update, and V accumulated key by key. Every row runs the same fp32 operations on a
// tile whichever path loaded it (a transposed copy shared by a work item's rows, or straight from the
// cache for a decode row), so a row's result never depends on the rows it shares a step or a work
// item with.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_load.h"
#include "common.h"
#include "simd16.h"

namespace tmk::attn {

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
    int dim() const { return D; }
    ScratchTile without_prefetch() const { return *this; }
    template <int N>
    void scores(const float* const* q, int, int, V16* s) const { tile_scores<N>(q, kt, D, s); }
    V16 v(int j, int d) const { return vload(vt + j * D + d); }
};

#if defined(TM_AVX512) || defined(TM_AVX2)
template <int TYPE, int DIM = 0>
inline V16 load16(const CacheView& c, int64_t row, int d) {
#if defined(TM_AVX512)
    return {load_row16<TYPE, DIM>(c, row, d)};
#else
    return {load_row8<TYPE, DIM>(c, row, d), load_row8<TYPE, DIM>(c, row, d + 8)};
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
// rows share the ScratchTile's conversions instead. DIM: the head dim when known at compile time
// (0: D), which lets the compiler unroll a key's dims and drop the loop's index arithmetic.
template <int TYPE, int DIM = 0>
struct CacheTile {
    const CacheView* k;
    const CacheView* vc;
    int64_t row0;
    int D;
    const TileAhead* ahead;  // the tile ahead: scores() prefetches its key j with key j
    static constexpr int ROW_BYTES = DIM * (TYPE == CACHE_F32 ? 4 : TYPE == CACHE_I8 ? 1 : 2);
    int dim() const { return DIM > 0 ? DIM : D; }
    // The same tile for a row's later head groups: the first group already prefetched the tile ahead.
    CacheTile without_prefetch() const {
        CacheTile t = *this;
        t.ahead = &NO_TILE_AHEAD;
        return t;
    }
    template <int N>
    void scores(const float* const* q, int first, int last, V16* s) const {
#if defined(TM_AVX512)
        // Short heads (SmolLM2's 3 of 64 dims: 12 registers) keep their queries in registers for the
        // tile's 16 keys rather than loading them again with each key: the same products, and on the
        // 2-core Sapphire Rapids box (one decode row, 1 thread, f16 cache in L2, alternated builds)
        // 300 / 1,200 / 3,000 keys took 20 / 53 / 137 us a call against 21.3 / 59 / 144; in a decode
        // step, where the cache comes from memory, its attention 1-6% faster (within the noise).
        if constexpr (DIM > 0 && DIM * N <= 256) {
            V16 held[N][DIM / 16];
            for (int n = 0; n < N; ++n)
                for (int c = 0; c < DIM / 16; ++c) held[n][c] = vload(q[n] + 16 * c);
            scores_of<N>([&](int n, int d) { return held[n][d / 16]; }, first, last, s);
            return;
        }
#endif
        scores_of<N>([&](int n, int d) { return vload(q[n] + d); }, first, last, s);
    }
    // query(n, d): dims d..d+15 of the n-th query vector.
    template <int N, typename Query>
    void scores_of(const Query& query, int first, int last, V16* s) const {
        const int D = dim();
        V16 t[N][TILE];
        for (int j = 0; j < TILE; ++j) {
            ahead->key<ROW_BYTES>(j);
            if (j < first || j > last) {
                for (int n = 0; n < N; ++n) t[n][j] = vzero();
                continue;
            }
            V16 acc[N];
            const V16 k0 = load16<TYPE, DIM>(*k, row0 + j, 0);
            for (int n = 0; n < N; ++n) acc[n] = vmul(query(n, 0), k0);
            for (int d = 16; d < D; d += 16) {
                const V16 kd = load16<TYPE, DIM>(*k, row0 + j, d);
                for (int n = 0; n < N; ++n) acc[n] = vfma(query(n, d), kd, acc[n]);
            }
            for (int n = 0; n < N; ++n) t[n][j] = acc[n];
        }
        for (int n = 0; n < N; ++n) s[n] = reduce_lanes(t[n]);
    }
    V16 v(int j, int d) const { return load16<TYPE, DIM>(*vc, row0 + j, d); }
};
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

// CAP: each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2): a template
// parameter, so the uncapped kernels carry nothing of it. Never inlined: gcc's choice moved with the
// instantiations around it, and with every group inlined into its caller (a 9.5 KB decode item
// instead of 3.2) SmolLM2's 64 x 1024 decode ran 8-10% slower (both builds in one process, alternated).
template <int N, bool CAP, typename Tile>
[[gnu::noinline]] void attend_group(const float* const* q, RowState* st, const Tile& tile, int first, int last, float softcap) {
    const int D = tile.dim();
    const float neg_inf = -std::numeric_limits<float>::infinity();
    V16 s[N], alpha[N];
    for (int n = 0; n < N; ++n) alpha[n] = vset1(1.0f);
    bool rescale[N];
    alignas(64) float p[N][TILE];
    tile.template scores<N>(q, first, last, s);
    if constexpr (CAP)
        for (int n = 0; n < N; ++n) s[n] = vsoftcap(s[n], softcap);
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

// The G heads of one row, in groups of at most MAX_GROUP (AVX2: SmolLM2's 3 in 2 + 1, Gemma's 4 in 2 + 2).
template <bool CAP, typename Tile>
inline void attend_row(const float* const* q, RowState* st, int G, const Tile& tile, int first, int last,
                       float softcap) {
    const Tile rest = tile.without_prefetch();
    for (int g = 0; g < G; g += MAX_GROUP) {
        const Tile& t = g == 0 ? tile : rest;
        switch (std::min(MAX_GROUP, G - g)) {
            case 1: attend_group<1, CAP>(q + g, st + g, t, first, last, softcap); break;
            case 2: attend_group<2, CAP>(q + g, st + g, t, first, last, softcap); break;
            case 3: if constexpr (MAX_GROUP >= 3) attend_group<3, CAP>(q + g, st + g, t, first, last, softcap); break;
            default: if constexpr (MAX_GROUP >= 4) attend_group<4, CAP>(q + g, st + g, t, first, last, softcap); break;
        }
    }
}

// ---- Segments. A row's keys are taken a segment at a time: a fixed run of whole blocks (about
// SEGMENT_KEYS positions, aligned to absolute positions), over which the row's softmax state starts
// afresh, and which then joins the row's total in position order (fold_segment). Because the
// segments are fixed, a long decode row's segments can run on different threads and be folded
// afterwards with the same operations, in the same order, as when one thread walks them all: the
// bits never depend on the split (paged_attention.cpp).
constexpr int SEGMENT_KEYS = 256;
inline int segment_blocks(int block_size) { return std::max(1, SEGMENT_KEYS / block_size); }

inline void reset_state(RowState& s, int D) {
    s.max = -std::numeric_limits<float>::infinity();
    for (int l = 0; l < TILE; l += 16) vstore(s.lane_sums + l, vzero());
    for (int d = 0; d < D; d += 16) vstore(s.acc + d, vzero());
}

// total (the row's earlier segments) joined by seg (the next one). An empty side leaves the other's
// bits as they are.
inline void fold_segment(RowState& total, const RowState& seg, int D) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    if (seg.max == neg_inf) return;
    if (total.max == neg_inf) {
        total.max = seg.max;
        for (int l = 0; l < TILE; l += 16) vstore(total.lane_sums + l, vload(seg.lane_sums + l));
        for (int d = 0; d < D; d += 16) vstore(total.acc + d, vload(seg.acc + d));
        return;
    }
    const float m = std::max(total.max, seg.max);
    const V16 a = vexp(vset1(total.max - m)), b = vexp(vset1(seg.max - m));
    for (int l = 0; l < TILE; l += 16)
        vstore(total.lane_sums + l, vfma(vload(seg.lane_sums + l), b, vmul(vload(total.lane_sums + l), a)));
    for (int d = 0; d < D; d += 16) vstore(total.acc + d, vfma(vload(seg.acc + d), b, vmul(vload(total.acc + d), a)));
    total.max = m;
}

// At a segment boundary: each of n states joins its total and starts afresh. Kept out of line so
// the per-tile loops that call it stay as small as they were: inlined, Gemma 3's 64 x 4k decode ran
// about 5% slower (bench/paged_attention.py, alternated with the build before segments).
[[gnu::noinline]] inline void close_segment(RowState* total, RowState* st, int n, int D) {
    for (int i = 0; i < n; ++i) {
        fold_segment(total[i], st[i], D);
        reset_state(st[i], D);
    }
}

}  // namespace tmk::attn
