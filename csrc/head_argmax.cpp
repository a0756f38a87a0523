// Greedy rows' token from a Q8_0 output head without all of its dot products: the argmax of
// qmatmul(x, head), bitwise the column torch.max would pick from the full logits.
//
// The activations' first plane alone (q1: half of the integer work, kernels' Acts layout) gives every
// column a coarse logit within a bound of the exact one: the fine plane q2 (|q2| <= 64) adds, in block
// b, scale_c * dc_b * (q2 . w_c), at most dc_b * 64 * L_b, where L_b is the largest |scale_c| * sum |w_c|
// over the head's columns (block_norms, once per weight). A column whose coarse logit lies more than
// twice the row's bound (plus float slack) below the best coarse logit cannot be the argmax; the few
// tiles left (bench/head_bound.py: SmolLM2 34 columns of 49,152 at the median, Gemma 3 7 of 262,144)
// are computed exactly by the qmatmul kernel itself (tile_avx512, one row), so their values are the
// full kernel's bits, and the first index of the largest wins as in torch.max. A row whose coarse
// logits hold a NaN or an infinity takes every tile exactly.
//
// AVX-512 only (the verification rows of speculative decoding, and batched greedy rows, are where a
// head's per-row work shows); kernels/head_argmax.py falls back to qmatmul + argmax elsewhere.
//
// A row alone (single-stream greedy decoding) is bound by reading the head from memory, not by its dot
// products: Gemma 3's 262,144 x 640 Q8_0 head is 178 MB a token, most of a step's bytes. Its coarse
// pass can read a 6-bit copy of the head instead (coarse_pack, once per head: each value's top six bits,
// u6 = u >> 2, in Q6_K's layout: 416 bytes a block of 16 columns with the scales, against Q8_0's 544),
// with both activation planes, which a row alone can afford. The coarse value 4 u6 + 1.5 - 128 is within
// 1.5 of the exact u - 128, so a column's exact logit sum_b scale_cb dc_b (w . X) (X = 128 q1 + q2, the
// joined planes) is within B_c = sum_b |scale_cb| 1.5 dc_b |X_b|_1 of its coarse one (one more FMA a
// block), and a column is a candidate when its coarse logit plus B_c reaches the row's best coarse logit
// less B there. On Gemma 3's real rows (bench speculative's prompts) a few tiles of 16,384 are left.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "qmatmul_avx512.h"

namespace py = pybind11;

namespace tmk::qmm {
namespace {

// Per block b: the largest |scale| * sum |w| of a column of the head (w the signed values u - 128).
void block_norms(const Weight& w, float* out) {
    const int64_t nb = w.blocks(), tiles = w.tiles();
    std::vector<float> part(size_t(tiles * nb));
    parallel_for(tiles, 64, [&](int64_t t0, int64_t t1) {
        uint8_t u[kTile][kBlock];
        for (int64_t t = t0; t < t1; ++t) {
            const int cols = int(std::min<int64_t>(kTile, w.N - t * kTile));
            for (int64_t b = 0; b < nb; ++b) {
                decode_block(w.type, w.qs_at(t, b), u);
                float most = 0.f;
                for (int c = 0; c < cols; ++c) {
                    int32_t l1 = 0;
                    for (int k = 0; k < kBlock; ++k) l1 += std::abs(int32_t(u[c][k]) - int_offset(Q8_0));
                    most = std::max(most, std::fabs(half_at(w.sc_at(t, b), c)) * float(l1));
                }
                part[size_t(t * nb + b)] = most;
            }
        }
    });
    for (int64_t b = 0; b < nb; ++b) {
        float most = 0.f;
        for (int64_t t = 0; t < tiles; ++t) most = std::max(most, part[size_t(t * nb + b)]);
        out[b] = most;
    }
}

// The 6-bit copy's bytes per block of a tile (Q6_K's qs layout: step_values<Q6_K> reads it); kernels/
// head_argmax.py's COARSE_BLOCK_BYTES, which sizes the copy.
constexpr int kCoarseBlock = 384;

// Writes w's 6-bit copy: tile t's block b at out + (t * blocks + b) * kCoarseBlock.
void coarse_pack(const Weight& w, uint8_t* out) {
    const int64_t nb = w.blocks();
    parallel_for(w.tiles(), 64, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* qs = w.qs_at(t, b);
                uint8_t* dst = out + (t * nb + b) * kCoarseBlock;
                std::memset(dst, 0, kCoarseBlock);
                for (int j = 0; j < 8; ++j)
                    for (int i = 0; i < 64; ++i) {
                        const int u6 = qs[64 * j + i] >> 2;
                        dst[64 * (j & 3) + i] |= uint8_t(j < 4 ? (u6 & 15) : (u6 & 15) << 4);
                        dst[256 + 64 * (j >> 2) + i] |= uint8_t((u6 >> 4) << (2 * (j & 3)));
                    }
            }
    });
}

#if defined(TM_AVX512)
// Lanes of tile t that are columns of the head (a tail tile's others are padding).
inline __mmask16 tile_columns(const Weight& w, int64_t t) {
    const int64_t left = w.N - t * kTile;
    return left >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// A tile whose coarse logits (of one row) reach within the row's margin of the best coarse logit seen.
struct Candidate {
    int64_t row, tile;
    float most;  // its largest coarse logit
};

// One row's pass over a part of the tiles: the best coarse logit so far, and whether one was a NaN or
// an infinity (the row then takes every tile exactly).
struct RowScan {
    float margin;  // twice the row's bound, and float slack
    float best = -std::numeric_limits<float>::infinity();
    bool odd = false;
    const int64_t* excluded = nullptr;  // columns that are no candidates (the ids a row suppresses)
    int64_t num_excluded = 0;
    // Lanes of tile t that are columns of the head and not excluded.
    __mmask16 columns(const Weight& w, int64_t t) const {
        __mmask16 cols = tile_columns(w, t);
        for (int64_t i = 0; i < num_excluded; ++i)
            if (excluded[i] / kTile == t) cols = __mmask16(cols & ~(1u << (excluded[i] % kTile)));
        return cols;
    }
};

// The coarse logits of one row in tile t: kept as a candidate when they reach the best so far less the
// margin. The best only grows, so every tile that reaches the final floor (the row's best less the
// margin) is kept; the final floor then drops the ones kept early.
inline void scan_tile(const Weight& w, int64_t t, int64_t m, __m512 v, RowScan& row, std::vector<Candidate>& out) {
    const __mmask16 cols = row.columns(w, t);
    row.odd = row.odd || _mm512_mask_fpclass_ps_mask(cols, v, 0x99) != 0;  // NaN or infinity
    if (_mm512_mask_cmp_ps_mask(cols, v, _mm512_set1_ps(row.best - row.margin), _CMP_GE_OQ) == 0) return;
    const float most = _mm512_mask_reduce_max_ps(cols, v);
    out.push_back({m, t, most});
    row.best = std::max(row.best, most);
}

// The 6-bit copy and the per-row factors its column bounds take: e[m * blocks + b] = 1.02 * 1.5 dc_b
// |X_b|_1 (2% slack for the float rounding of the sums and of the bound, as the margins' 1%).
struct SixBit {
    const uint8_t* values;
    const float* e;
};

// A tile's coarse logits v of one row with their column bounds bnd (6-bit copy): kept as a candidate
// when v + bnd reaches the row's best v - bnd so far less the margin (0 with both planes); its `most` is
// its largest v + bnd.
inline void scan_tile_bounded(const Weight& w, int64_t t, int64_t m, __m512 v, __m512 bnd, RowScan& row,
                              std::vector<Candidate>& out) {
    const __mmask16 cols = row.columns(w, t);
    const __m512 hi = _mm512_add_ps(v, bnd), lo = _mm512_sub_ps(v, bnd);
    row.odd = row.odd || _mm512_mask_fpclass_ps_mask(cols, hi, 0x99) != 0 ||
              _mm512_mask_fpclass_ps_mask(cols, lo, 0x99) != 0;  // NaN or infinity
    row.best = std::max(row.best, _mm512_mask_reduce_max_ps(cols, lo));
    if (_mm512_mask_cmp_ps_mask(cols, hi, _mm512_set1_ps(row.best - row.margin), _CMP_GE_OQ) == 0) return;
    out.push_back({m, t, _mm512_mask_reduce_max_ps(cols, hi)});
}

// Coarse logits of rows [m0, m0 + MR) for tiles [t, t + NT): the first plane's integer dots (the
// offset taken off with that plane's own block sums s1), scaled by the tiles' scales and the rows'
// d1 = 128 dc, straight into the rows' scans (never stored). Each activation word is broadcast once for
// all NT tiles: one plane makes half the qmatmul kernel's products per load, so a tile at a time would
// be bound by loads. With kSix: the 6-bit copy's values against both planes, u6 . X joined as the qmatmul
// kernel joins them, 2 wc . X = 8 u6 . X - 253 S in the integer sums (scaled by dc / 2), and each
// column's bound beside.
template <int NT, int MR, bool kSix>
void coarse_group(const Weight& w, const SixBit* six, int64_t t, const Acts& a, const int32_t* s1, int64_t m0,
                  RowScan* rows, std::vector<Candidate>& out, int64_t ahead = -1) {
    const int64_t nb = w.blocks();
    __m512 acc[NT][MR], bnd[NT][MR];
    for (int n = 0; n < NT; ++n)
        for (int r = 0; r < MR; ++r) acc[n][r] = bnd[n][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* qs[NT];
        for (int n = 0; n < NT; ++n)
            qs[n] = kSix ? six->values + ((t + n) * nb + b) * kCoarseBlock : w.qs_at(t + n, b);
        if (m0 == 0)
            for (int n = 0; n < NT; ++n) prefetch_ahead(kSix ? Q6_K : Q8_0, qs[n], w.sc_at(t + n, b));
        if (ahead >= 0)
            for (int n = 0; n < NT; ++n)
                prefetch_block(kSix ? Q6_K : Q8_0,
                               kSix ? six->values + ((ahead + n) * nb + b) * kCoarseBlock : w.qs_at(ahead + n, b),
                               w.sc_at(ahead + n, b));
        __m512i isum[NT][MR], fine[kSix ? NT : 1][MR];
        for (int r = 0; r < MR; ++r) {
            const __m512i start = kSix ? _mm512_setzero_si512()
                                       : _mm512_set1_epi32(-int_offset(Q8_0) * s1[(m0 + r) * nb + b]);
            for (int n = 0; n < NT; ++n) isum[n][r] = start;
            if constexpr (kSix)
                for (int n = 0; n < NT; ++n) fine[n][r] = _mm512_setzero_si512();
        }
#pragma GCC unroll 8  // the 6-bit values' shifts per step are constants then
        for (int j = 0; j < 8; ++j) {
            __m512i v[NT];
            for (int n = 0; n < NT; ++n) v[n] = kSix ? step_values<Q6_K>(qs[n], j) : step_values<Q8_0>(qs[n], j);
            for (int r = 0; r < MR; ++r) {
                const __m512i x = _mm512_set1_epi32(int32_t(load_u32(a.row(m0 + r) + b * kBlock + 4 * j)));
                for (int n = 0; n < NT; ++n) isum[n][r] = _mm512_dpbusd_epi32(isum[n][r], v[n], x);
                if constexpr (kSix) {
                    const __m512i x2 = _mm512_set1_epi32(int32_t(load_u32(a.fine(m0 + r) + b * kBlock + 4 * j)));
                    for (int n = 0; n < NT; ++n) fine[n][r] = _mm512_dpbusd_epi32(fine[n][r], v[n], x2);
                }
            }
        }
        for (int n = 0; n < NT; ++n) {
            const __m512 scale = load_halves(w.sc_at(t + n, b));
            for (int r = 0; r < MR; ++r) {
                float d1 = a.dx(m0 + r, b) * float(1 << kFine);
                __m512i sums = isum[n][r];
                if constexpr (kSix) {  // u6 . X joined from both planes, then 2 wc . X = 8 u6 . X - 253 S
                    sums = _mm512_add_epi32(_mm512_slli_epi32(sums, kFine), fine[n][r]);
                    sums = _mm512_sub_epi32(_mm512_slli_epi32(sums, 3),
                                            _mm512_set1_epi32(253 * a.block_sum(m0 + r, b)));
                    d1 = 0.5f * a.dx(m0 + r, b);
                    bnd[n][r] = _mm512_fmadd_ps(_mm512_abs_ps(scale), _mm512_set1_ps(six->e[(m0 + r) * nb + b]),
                                                bnd[n][r]);
                }
                acc[n][r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(d1)), _mm512_cvtepi32_ps(sums),
                                            acc[n][r]);
            }
        }
    }
    for (int n = 0; n < NT; ++n)
        for (int r = 0; r < MR; ++r) {
            if constexpr (kSix)
                scan_tile_bounded(w, t + n, m0 + r, acc[n][r], bnd[n][r], rows[m0 + r], out);
            else
                scan_tile(w, t + n, m0 + r, acc[n][r], rows[m0 + r], out);
        }
}

// Tiles [t, t + NT) of every row: rows three at a time (and the last one or two). next: the first of
// the tiles this thread scans after these (-1: none), whose blocks the second pass (or a call's only
// one) asks for along the way, into L2, as the qmatmul kernel's grouped passes do: otherwise each
// group's first pass met its first blocks in memory. With the head from memory (ten copies of it in
// turn, 2 threads, real rows of a verification), SmolLM2's head at 3 / 4 / 8 / 17 rows took 1.15-1.20 /
// 1.40-1.45 / 1.79-1.88 / 2.72-2.82 ms against 1.37-1.39 / 1.53-1.55 / 2.01-2.56 / 2.95-3.07, Gemma 3's
// at 3 / 4 / 8 rows 5.9 / 6.9-7.0 / 8.2 ms against 6.5-6.6 / 7.2-7.3 / 9.3-9.4. Engine steps of one
// sequence with 3 / 6 / 8 rows (three alternated rounds of speculative_bound.step_costs): Gemma 3's
// 9.1-9.6 / 12.6-13.3 / 15.5-15.7 ms against 10.1-10.2 / 14.0-14.2 / 16.4-17.0; SmolLM2's the same
// within the box's noise (its head, 30 MB of 260 MB of L3, is partly in cache there). One
// or two rows stream the head as they did (next -1): bound by memory, they have no time to spare.
template <int NT, bool kSix>
void coarse_tiles(const Weight& w, const SixBit* six, int64_t t, const Acts& a, const int32_t* s1, int64_t M,
                  RowScan* rows, std::vector<Candidate>& out, int64_t next) {
    const int64_t ahead_m = M > 3 ? 3 : 0;
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) coarse_group<NT, 3, kSix>(w, six, t, a, s1, m, rows, out, m == ahead_m ? next : -1);
    if (M - m == 2) coarse_group<NT, 2, kSix>(w, six, t, a, s1, m, rows, out, m == ahead_m ? next : -1);
    if (M - m == 1) coarse_group<NT, 1, kSix>(w, six, t, a, s1, m, rows, out, m == ahead_m ? next : -1);
}

// Tiles [t0, t1): four at a time for one or two rows (independent chains enough to hide vpdpbusd's
// latency), two at a time for more.
template <bool kSix>
void coarse_range(const Weight& w, const SixBit* six, int64_t t0, int64_t t1, const Acts& a, const int32_t* s1,
                  int64_t M, RowScan* rows, std::vector<Candidate>& out) {
    int64_t t = t0;
    if (M <= 2)
        for (; t + 4 <= t1; t += 4) coarse_tiles<4, kSix>(w, six, t, a, s1, M, rows, out, -1);
    for (; t + 2 <= t1; t += 2) coarse_tiles<2, kSix>(w, six, t, a, s1, M, rows, out, M >= 3 && t + 4 <= t1 ? t + 2 : -1);
    for (; t < t1; ++t) coarse_tiles<1, kSix>(w, six, t, a, s1, M, rows, out, -1);
}

// tokens[m] = argmax over columns of row m's logits (torch.max's index). norms: block_norms of w (not
// read with the 6-bit copy, coarse: from coarse_pack).
void head_argmax(const Weight& w, const Acts& a, int64_t M, const float* norms, int64_t* tokens,
                 const uint8_t* coarse = nullptr, const int64_t* excluded = nullptr, int64_t num_excluded = 0) {
    const int64_t nb = w.blocks(), tiles = w.tiles();
    // The first plane's sums per row and block (Acts holds both planes' joined sums only), and each
    // row's margin: twice its bound (one for a candidate, one for the best), with a 1% slack that covers
    // the float rounding of both sums and of the bound itself many times over (about 1e-3 of it). With
    // the 6-bit copy the bounds are per column (e) and the margin 0.
    std::vector<int32_t> s1(size_t(M * nb));
    std::vector<float> e(coarse ? size_t(M * nb) : 0);
    std::vector<RowScan> start(static_cast<size_t>(M));
    for (int64_t m = 0; m < M; ++m) {
        float bound = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
            int32_t s = 0;
            for (int k = 0; k < kBlock; ++k) s += a.row(m)[b * kBlock + k];
            s1[size_t(m * nb + b)] = s;
            if (coarse) {  // |X_b|_1 of the joined planes
                int32_t l1 = 0;
                for (int k = 0; k < kBlock; ++k)
                    l1 += std::abs((int32_t(a.row(m)[b * kBlock + k]) << kFine) + a.fine(m)[b * kBlock + k]);
                e[size_t(m * nb + b)] = 1.02f * 1.5f * a.dx(m, b) * float(l1);
            } else {
                bound += a.dx(m, b) * norms[b];
            }
        }
        start[size_t(m)].margin = coarse ? 0.f : 2.02f * 64.f * bound;
        start[size_t(m)].odd = !std::isfinite(start[size_t(m)].margin);
        start[size_t(m)].excluded = excluded;
        start[size_t(m)].num_excluded = num_excluded;
    }
    const SixBit six{coarse, e.data()};
    // Each part of the tiles scans them with its own rows' state and candidate list.
    const int parts = int(std::max<int64_t>(1, std::min<int64_t>(num_threads(), tiles / 16)));
    std::vector<std::vector<RowScan>> scans(static_cast<size_t>(parts), start);
    std::vector<std::vector<Candidate>> found(static_cast<size_t>(parts));
    run(parts, [&](int part, int n) {
        const int64_t per = (tiles + n - 1) / n, t0 = part * per, t1 = std::min(tiles, t0 + per);
        if (t0 >= t1) return;
        if (coarse)
            coarse_range<true>(w, &six, t0, t1, a, s1.data(), M, scans[size_t(part)].data(), found[size_t(part)]);
        else
            coarse_range<false>(w, nullptr, t0, t1, a, s1.data(), M, scans[size_t(part)].data(), found[size_t(part)]);
    });
    // Each row's floor from every part's best; the candidates that reach it, or every tile of an odd row.
    std::vector<float> floor(static_cast<size_t>(M));
    std::vector<char> every(static_cast<size_t>(M), 0);
    for (int64_t m = 0; m < M; ++m) {
        float best = -std::numeric_limits<float>::infinity();
        for (const auto& scan : scans) {
            best = std::max(best, scan[size_t(m)].best);
            every[size_t(m)] |= scan[size_t(m)].odd;
        }
        floor[size_t(m)] = best - start[size_t(m)].margin;
        every[size_t(m)] |= !std::isfinite(floor[size_t(m)]);
    }
    std::vector<Candidate> pairs;
    for (const auto& list : found)
        for (const Candidate& c : list)
            if (!every[size_t(c.row)] && c.most >= floor[size_t(c.row)]) pairs.push_back(c);
    for (int64_t m = 0; m < M; ++m)
        if (every[size_t(m)])
            for (int64_t t = 0; t < tiles; ++t) pairs.push_back({m, t, 0.f});

    // The candidates exactly, by the qmatmul kernel's own tile (w.stream_out is off: plain stores).
    std::vector<float> values(pairs.size() * kTile);
    parallel_for(int64_t(pairs.size()), 8, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p)
            tile_avx512<Q8_0, 1, false>(w, pairs[size_t(p)].tile, a, nullptr, pairs[size_t(p)].row,
                                        values.data() + p * kTile, 0, false);  // ldo 0: row m lands at the pointer
    });
    // torch.max's rules, in any order of the candidates: the largest value at its first index, or the
    // first NaN.
    std::vector<float> top(static_cast<size_t>(M), 0.f);
    std::vector<char> nan(static_cast<size_t>(M), 0);
    for (int64_t m = 0; m < M; ++m) tokens[m] = -1;
    for (size_t p = 0; p < pairs.size(); ++p) {
        const size_t m = size_t(pairs[p].row);
        const __mmask16 cols = start[m].columns(w, pairs[p].tile);
        for (int64_t i = 0; i < kTile; ++i) {
            if (!((cols >> i) & 1)) continue;
            const float v = values[p * kTile + size_t(i)];
            const int64_t index = pairs[p].tile * kTile + i;
            if (std::isnan(v)) {
                if (!nan[m] || index < tokens[m]) tokens[m] = index;
                nan[m] = 1;
            } else if (!nan[m] && (tokens[m] < 0 || v > top[m] || (v == top[m] && index < tokens[m]))) {
                top[m] = v;
                tokens[m] = index;
            }
        }
    }
    // A row with every column excluded: torch.max's index over logits all -inf.
    for (int64_t m = 0; m < M; ++m)
        if (tokens[m] < 0) tokens[m] = 0;
}
#endif

}  // namespace
}  // namespace tmk::qmm

namespace tmk::entry {
bool head_argmax(const uint8_t* acts, int64_t M, int64_t K, const uint8_t* qs, const uint8_t* sc, int64_t N,
                 const float* norms, int64_t* tokens, const uint8_t* coarse, const int64_t* excluded,
                 int64_t num_excluded) {
#if defined(TM_AVX512)
    qmm::head_argmax(qmm::Weight{qmm::Q8_0, qs, sc, nullptr, N, K}, qmm::Acts{acts, K}, M, norms, tokens, coarse,
                     num_excluded ? excluded : nullptr, num_excluded);
    return true;
#else
    (void)acts, (void)M, (void)K, (void)qs, (void)sc, (void)N, (void)norms, (void)tokens, (void)coarse,
        (void)excluded, (void)num_excluded;
    return false;
#endif
}
}  // namespace tmk::entry

void register_head_argmax(py::module_& m) {
    using namespace tmk::qmm;
    // A repacked Q8_0 head [N, K] from its arrays' addresses.
    const auto head = [](uintptr_t qs, uintptr_t sc, int64_t N, int64_t K) {
        return Weight{Q8_0, tmk::ptr<const uint8_t>(qs), tmk::ptr<const uint8_t>(sc), nullptr, N, K};
    };
    m.def(
        "head_block_norms",
        [head](uintptr_t qs, uintptr_t sc, int64_t N, int64_t K, uintptr_t out) {
            block_norms(head(qs, sc, N, K), tmk::ptr<float>(out));
        },
        py::call_guard<py::gil_scoped_release>(),
        "a repacked Q8_0 weight [N, K] -> per block of 32 inputs, the largest |scale| * sum |q| of a column");
    m.def(
        "head_coarse_pack",
        [head](uintptr_t qs, uintptr_t sc, int64_t N, int64_t K, uintptr_t out) {
            coarse_pack(head(qs, sc, N, K), tmk::ptr<uint8_t>(out));
        },
        py::call_guard<py::gil_scoped_release>(),
        "a repacked Q8_0 head [N, K] -> its 6-bit copy (tiles x K / 32 x 384 bytes)");
#if defined(TM_AVX512)
    m.def(
        "head_argmax",
        [head](uintptr_t acts, int64_t M, int64_t K, uintptr_t qs, uintptr_t sc, int64_t N, uintptr_t norms,
               uintptr_t out, uintptr_t coarse, uintptr_t excluded, int64_t num_excluded) {
            head_argmax(head(qs, sc, N, K), Acts{tmk::ptr<const uint8_t>(acts), K}, M, tmk::ptr<const float>(norms),
                        tmk::ptr<int64_t>(out), coarse ? tmk::ptr<const uint8_t>(coarse) : nullptr,
                        num_excluded ? tmk::ptr<const int64_t>(excluded) : nullptr, num_excluded);
        },
        py::arg("acts"), py::arg("M"), py::arg("K"), py::arg("qs"), py::arg("sc"), py::arg("N"), py::arg("norms"),
        py::arg("out"), py::arg("coarse") = 0, py::arg("excluded") = 0, py::arg("num_excluded") = 0,
        py::call_guard<py::gil_scoped_release>(),
        "tokens [M] int64 = argmax of activations [M, K] @ a repacked Q8_0 head [N, K]^T (torch.max's index); "
        "coarse: its 6-bit copy (head_coarse_pack), or 0; excluded: int64 [num_excluded] columns no row may take "
        "(suppressed ids: the argmax of the rest)");
#endif
}
