// AVX2 qmatmul: a 16-row tile is run as two halves of 8 output columns (one ymm lane each). The
// integer dot product of a step is maddubs (u8 x s8 pairs -> s16) then madd (-> s32), per activation
// plane. maddubs saturates above 32767: 4/5/6-bit values (<= 63) x |x| <= 127 stay far below it, but
// Q8_0's u8 values (q + 128) would not. Q8_0 instead joins the planes once per call into X = 128 q1 +
// q2 (int16) and takes one pmaddwd of the signed q (widened to int16) with X per 4 rows: a third of the
// instructions of maddubs with the abs/sign trick on each plane (the head's GEMV, bench/qmatmul.py).
#pragma once

#include "qmatmul_layout.h"

#if defined(TM_AVX2)
namespace tmk::qmm {

// Step j's 4/5/6-bit values for the 8 rows of half h.
template <int T>
inline __m256i step_values2(const uint8_t* qs, int j, int h) {
    static_assert(T != Q8_0, "Q8_0 widens its bytes straight from memory (dot_steps_q8)");
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i packed = _mm256_loadu_si256((const __m256i*)(qs + 64 * (j & 3) + 32 * h));
    __m256i v = _mm256_and_si256(j < 4 ? packed : _mm256_srli_epi16(packed, 4), low4);
    if constexpr (T == Q5_0) {
        const __m256i plane = _mm256_loadu_si256((const __m256i*)(qs + 256 + 32 * h));
        // bit j -> bit 4; bits shifted in from the neighbouring byte land outside bit 4
        __m256i hi = j < 4 ? _mm256_slli_epi16(plane, 4 - j) : _mm256_srli_epi16(plane, j - 4);
        v = _mm256_or_si256(v, _mm256_and_si256(hi, _mm256_set1_epi8(0x10)));
    }
    if constexpr (T == Q6_K) {
        const __m256i plane = _mm256_loadu_si256((const __m256i*)(qs + 256 + 64 * (j >> 2) + 32 * h));
        const int t = j & 3;
        __m256i hi = t < 2 ? _mm256_slli_epi16(plane, 4 - 2 * t) : t == 2 ? plane : _mm256_srli_epi16(plane, 2);
        v = _mm256_or_si256(v, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
    }
    return v;
}

template <int T, bool kDecoded>
inline __m256i step_at(const uint8_t* src, int j, int h) {
    if constexpr (kDecoded)
        return _mm256_loadu_si256((const __m256i*)(src + 64 * j + 32 * h));
    else
        return step_values2<T>(src, j, h);
}

template <int T>
inline const uint8_t* decoded_tile2(const Weight& w, int64_t tile) {
    return decoded_tile(w, tile, [](const uint8_t* qs, int j, uint8_t* dst) {
        for (int h = 0; h < 2; ++h) _mm256_storeu_si256((__m256i*)(dst + 32 * h), step_values2<T>(qs, j, h));
    });
}

// Steps whose maddubs sums add in int16 before widening: a pair's sum is at most 2 * vmax * 127, so
// 4-bit values (<= 15) take the whole block of 8 steps (30480), Q5_0 (<= 31) 4 and Q6_K (<= 63) 2
// (32004), all under 32767. Fewer widening madds means fewer multiplies (maddubs and madd share the
// multiply ports): per 32 products the 4-bit types go from 3 to 2.25 (SmolLM2's Q4_1 shapes 7-10%
// faster at 64-512 rows, bench/qmatmul.py --variant avx2, Zen 5).
template <int T>
constexpr int int16_steps() {
    return T == Q6_K ? 2 : T == Q5_0 ? 4 : 8;
}

// isum += (q1 . u << kFine) + q2 . u over steps [j0, j1) (q2 lies K bytes after q1): each group of
// int16_steps steps sums its maddubs per plane in int16, then the widening madd multiplies plane 1's
// sums by 128 and plane 2's by 1, which joins the two planes' dot products as one integer.
// With few rows both planes take each decoded step (decoding is most of a GEMV's work: one plane at a
// time made Gemma 3's Q5_0 gate_up 1.4x slower at one row); with more, a plane at a time keeps the
// MR int16 sums in registers (both at once spilled them at MR = 4), and the rows share the decode.
template <int T, int MR, bool kDecoded>
inline void dot_steps2(const uint8_t* qs, int h, const int8_t* const* x, int64_t K, int j0, int j1, __m256i* isum) {
    static_assert(T != Q8_0, "Q8_0 takes dot_steps_q8");
    constexpr int G = int16_steps<T>();
    constexpr int P = MR <= 2 ? 2 : 1;  // planes per pass over the group's steps
    const __m256i weight[2] = {_mm256_set1_epi16(1 << kFine), _mm256_set1_epi16(1)};
    for (int j = j0; j < j1; j += G)
        for (int p0 = 0; p0 < 2; p0 += P) {
            __m256i sum16[MR][P];
            for (int r = 0; r < MR; ++r)
                for (int p = 0; p < P; ++p) sum16[r][p] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int s = 0; s < G; ++s) {
                const __m256i v = step_at<T, kDecoded>(qs, j + s, h);
                for (int r = 0; r < MR; ++r)
                    for (int p = 0; p < P; ++p) {
                        const int8_t* xp = x[r] + (p0 + p) * K + 4 * (j + s);
                        const __m256i xs = _mm256_set1_epi32(int(load_u32(xp)));
                        sum16[r][p] = _mm256_add_epi16(sum16[r][p], _mm256_maddubs_epi16(v, xs));
                        // GCC otherwise reassociates the sums into a tree over all G steps' products,
                        // which keeps them all live and spills them (Q5_0 came out 20% slower)
                        asm("" : "+x"(sum16[r][p]));
                    }
            }
            for (int r = 0; r < MR; ++r)
                for (int p = 0; p < P; ++p)
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(sum16[r][p], weight[p0 + p]));
        }
}

// Q8_0: isum[r] += u . X over the block's 8 steps for the 8 rows of half h (the caller starts isum at
// -128 S, so the sum is q . X). pmaddwd leaves two int32 lanes per row (inputs 0+1 and 2+3 of the
// step); one hadd and a lane permute per block put the rows back in order. u <= 255 and
// |X| <= 16256 (qmatmul_layout.h) keep 8 steps of pairs far inside int32.
template <int MR>
inline void dot_steps_q8(const uint8_t* qs, int h, const int16_t* const* X, __m256i* isum) {
    __m256i lo[MR], hi[MR];  // rows 0-3 and 4-7 of the half
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {  // u = q + 128, widened straight from memory
        const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(qs + 64 * j + 32 * h)));
        const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(qs + 64 * j + 32 * h + 16)));
        for (int r = 0; r < MR; ++r) {
            int64_t four;
            std::memcpy(&four, X[r] + 4 * j, 8);
            const __m256i xb = _mm256_set1_epi64x(four);
            lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(w0, xb));
            hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(w1, xb));
        }
    }
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (int r = 0; r < MR; ++r)
        isum[r] = _mm256_add_epi32(isum[r], _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(lo[r], hi[r]), order));
}

// Rows [m0, m1) of Acts joined: X[m][k] = 128 q1 + q2 (int16).
inline void joined_rows(const Acts& a, int64_t m0, int64_t m1, int16_t* X) {
    for (int64_t m = m0; m < m1; ++m) {
        const int8_t* q1 = a.row(m);
        const int8_t* q2 = a.fine(m);
        int16_t* x = X + (m - m0) * a.K;
        for (int64_t k = 0; k < a.K; k += 16) {
            const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q1 + k)));
            const __m256i f = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q2 + k)));
            _mm256_storeu_si256((__m256i*)(x + k), _mm256_add_epi16(_mm256_slli_epi16(c, kFine), f));
        }
    }
}

inline __m256 load_halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 load_u8_as_f32x8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// acc[r] += block b's integer sums isum[r] (rows m0 + r) for half h of the tile, times its scales and the
// row's dx, then the offset term (Q4_1 plus, Q4_K minus): the float work per block of every pass, so
// which pass took a row never changes a bit.
template <int T, int MR>
inline void add_block_avx2(const Weight& w, int64_t tile, int64_t b, int h, const Acts& a, int64_t m0,
                           const __m256i* isum, __m256* acc) {
    const uint8_t* sc = w.sc_at(tile, b);
    __m256 scale;
    if constexpr (T == Q6_K)
        scale = load_halves8(w.sup_at(tile, b) + 16 * h);
    else if constexpr (T == Q4_K)
        scale = _mm256_mul_ps(load_halves8(w.sup_at(tile, b) + 16 * h), load_u8_as_f32x8(sc + 8 * h));
    else
        scale = load_halves8(sc + 16 * h);
    for (int r = 0; r < MR; ++r) {
        const __m256 dx = _mm256_set1_ps(a.dx(m0 + r, b));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, dx), _mm256_cvtepi32_ps(isum[r]), acc[r]);
    }
    if constexpr (T == Q4_1) {
        const __m256 offset = load_halves8(sc + 32 + 16 * h);
        for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(a.dsum(m0 + r, b)), acc[r]);
    }
    if constexpr (T == Q4_K) {
        const __m256 offset = _mm256_mul_ps(load_halves8(w.sup_at(tile, b) + 32 + 16 * h), load_u8_as_f32x8(sc + 16 + 8 * h));
        for (int r = 0; r < MR; ++r) acc[r] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(a.dsum(m0 + r, b)), acc[r]);
    }
}

// acc[r] += half h of block b of the tile for rows m0.. m0 + MR - 1: the integer dot products of its 8
// output columns, scaled. qs: the block's values (decoded, or as packed); for Q8_0, X holds the rows
// joined (joined_rows).
template <int T, int MR, bool kDecoded>
inline void block_half_avx2(const Weight& w, int64_t tile, int64_t b, int h, const uint8_t* qs, const Acts& a,
                            const int16_t* X, int64_t m0, __m256* acc) {
    constexpr int c = int_offset(T);
    const uint8_t* sc = w.sc_at(tile, b);
    const int8_t* x[MR];
    for (int r = 0; r < MR; ++r) x[r] = a.row(m0 + r) + b * kBlock;
    __m256i isum[MR];
    if constexpr (T == Q6_K) {
        const __m256i sc_a = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(sc + 8 * h)));
        const __m256i sc_b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(sc + 16 + 8 * h)));
        __m256i half[MR];
        for (int r = 0; r < MR; ++r) half[r] = _mm256_set1_epi32(-c * a.sum16(m0 + r, 2 * b));
        dot_steps2<T, MR, kDecoded>(qs, h, x, w.K, 0, 4, half);
        for (int r = 0; r < MR; ++r) isum[r] = _mm256_mullo_epi32(half[r], sc_a);
        for (int r = 0; r < MR; ++r) half[r] = _mm256_set1_epi32(-c * a.sum16(m0 + r, 2 * b + 1));
        dot_steps2<T, MR, kDecoded>(qs, h, x, w.K, 4, 8, half);
        for (int r = 0; r < MR; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(half[r], sc_b));
    } else {
        for (int r = 0; r < MR; ++r) {
            if constexpr (T == Q4_1 || T == Q4_K)
                isum[r] = _mm256_setzero_si256();
            else
                isum[r] = _mm256_set1_epi32(-c * a.block_sum(m0 + r, b));
        }
        if constexpr (T == Q8_0) {
            const int16_t* xj[MR];
            for (int r = 0; r < MR; ++r) xj[r] = X + r * w.K + b * kBlock;
            dot_steps_q8<MR>(qs, h, xj, isum);
        } else {
            dot_steps2<T, MR, kDecoded>(qs, h, x, w.K, 0, 8, isum);
        }
    }
    add_block_avx2<T, MR>(w, tile, b, h, a, m0, isum, acc);
}

// Half h's 8 columns of rows m0.. m0 + MR - 1 into out (the tile's first column); a tail tile writes
// only its real columns.
template <int MR>
inline void store_half(const Weight& w, int64_t tile, int h, const __m256* acc, int64_t m0, float* out, int64_t ldo) {
    const int64_t cols = w.N - tile * kTile - 8 * h;
    for (int r = 0; r < MR; ++r) {
        float* o = out + (m0 + r) * ldo + 8 * h;
        if (cols >= 8) {
            _mm256_storeu_ps(o, acc[r]);
        } else if (cols > 0) {
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, acc[r]);
            for (int64_t i = 0; i < cols; ++i) o[i] = tmp[i];
        }
    }
}

// Many rows: half h of the tile over every block, MR rows at a time (the rows share each decoded
// step, and the MR int16 sums stay in registers). dec: the tile's decoded values (kDecoded) or null.
template <int T, int MR, bool kDecoded>
void half_tile_avx2(const Weight& w, int64_t tile, int h, const Acts& a, const int16_t* X, const uint8_t* dec,
                    int64_t m0, float* out, int64_t ldo) {
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.blocks(); ++b) {
        const uint8_t* qs = kDecoded ? dec + b * kDecodedBlock : w.qs_at(tile, b);
        block_half_avx2<T, MR, kDecoded>(w, tile, b, h, qs, a, X, m0, acc);
    }
    store_half<MR>(w, tile, h, acc, m0, out, ldo);
}

// 1-2 rows (a GEMV, the weight streaming from memory): both halves of each block in turn, so the
// weight is read once, in order, each cache line whole while it is in L1, rather than half of every
// line per pass over the tile. Gemma 3's 262144 x 640 Q8_0 head at one row: 4.0-4.2 -> 3.5-3.9 ms (a
// standalone timing alternated with the previous build), its AVX2 decode step 7.9-8.0 -> 6.4-6.7 ms
// (bench/profile_step.py --batch 1 --native-phases). The other types also ask for the weight 2 KB
// ahead, their per-block work being too long for the hardware prefetcher to keep ahead alone (Gemma
// 3's decode step: down 0.65-0.75 -> 0.48-0.58 ms, o_proj 0.23-0.36 -> 0.20-0.27); Q8_0, the output
// head, is one long stream that the prefetcher keeps up with, and the extra requests cost 0.4-0.6 ms
// a step there. Each output takes the same operations as in half_tile_avx2.
template <int T, int MR>
void tile_gemv_avx2(const Weight& w, int64_t tile, const Acts& a, const int16_t* X, int64_t m0, float* out,
                    int64_t ldo) {
    __m256 acc[2][MR];
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < MR; ++r) acc[h][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.blocks(); ++b) {
        const uint8_t* qs = w.qs_at(tile, b);
        if constexpr (T != Q8_0) prefetch_ahead(T, qs, w.sc_at(tile, b));
        for (int h = 0; h < 2; ++h) block_half_avx2<T, MR, false>(w, tile, b, h, qs, a, X, m0, acc[h]);
    }
    for (int h = 0; h < 2; ++h) store_half<MR>(w, tile, h, acc[h], m0, out, ldo);
}

// Both halves of a whole decoded tile at once, MR rows: each activation word, broadcast once, feeds
// both halves' maddubs, so a step loads 2 + MR times for 2 MR maddubs where a half alone loads 1 + MR
// times for MR. 4/5-bit types with one scale per block. Each output takes block_half_avx2's integer
// sums (the same int16 groups) and float operations, so the bits do not depend on the pass. Two rows
// measured best (bench/qmatmul.py --variant avx2, Zen 5: SmolLM2's Q4_1 qkv and gate_up at 512 rows
// 10-12% faster than a half at a time over four rows, down 3-4%; three rows spill and gain nothing).
template <int T>
constexpr bool kBothHalves = T == Q4_0 || T == Q4_1 || T == Q5_0;
constexpr int kBothHalvesRows = 2;

template <int T, int MR>
void tile_both_halves_avx2(const Weight& w, int64_t tile, const Acts& a, const uint8_t* dec, int64_t m0, float* out,
                           int64_t ldo) {
    static_assert(kBothHalves<T>);
    constexpr int G = int16_steps<T>();
    constexpr int c = int_offset(T);
    const __m256i weight[2] = {_mm256_set1_epi16(1 << kFine), _mm256_set1_epi16(1)};
    __m256 acc[2][MR];
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < MR; ++r) acc[h][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.blocks(); ++b) {
        const uint8_t* qs = dec + b * kDecodedBlock;
        const int8_t* x[MR];
        for (int r = 0; r < MR; ++r) x[r] = a.row(m0 + r) + b * kBlock;
        __m256i isum[2][MR];
        for (int r = 0; r < MR; ++r)
            isum[0][r] = isum[1][r] = c == 0 ? _mm256_setzero_si256()
                                             : _mm256_set1_epi32(-c * a.block_sum(m0 + r, b));
        for (int j = 0; j < 8; j += G)
            for (int p = 0; p < 2; ++p) {
                __m256i sum16[2][MR];
                for (int h = 0; h < 2; ++h)
                    for (int r = 0; r < MR; ++r) sum16[h][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int s = 0; s < G; ++s) {
                    const __m256i v0 = _mm256_loadu_si256((const __m256i*)(qs + 64 * (j + s)));
                    const __m256i v1 = _mm256_loadu_si256((const __m256i*)(qs + 64 * (j + s) + 32));
                    for (int r = 0; r < MR; ++r) {
                        const __m256i xs = _mm256_set1_epi32(int(load_u32(x[r] + p * w.K + 4 * (j + s))));
                        sum16[0][r] = _mm256_add_epi16(sum16[0][r], _mm256_maddubs_epi16(v0, xs));
                        sum16[1][r] = _mm256_add_epi16(sum16[1][r], _mm256_maddubs_epi16(v1, xs));
                        asm("" : "+x"(sum16[0][r]), "+x"(sum16[1][r]));  // as in dot_steps2: no reassociation
                    }
                }
                for (int h = 0; h < 2; ++h)
                    for (int r = 0; r < MR; ++r)
                        isum[h][r] = _mm256_add_epi32(isum[h][r], _mm256_madd_epi16(sum16[h][r], weight[p]));
            }
        for (int h = 0; h < 2; ++h) add_block_avx2<T, MR>(w, tile, b, h, a, m0, isum[h], acc[h]);
    }
    for (int h = 0; h < 2; ++h) store_half<MR>(w, tile, h, acc[h], m0, out, ldo);
}

// Rows [m0, m1) of one tile into out (the tile's first column), both halves; for Q8_0, X holds those
// rows joined (joined_rows).
template <int T, bool kDecoded>
void rows_avx2_from(const Weight& w, int64_t tile, const Acts& a, const int16_t* X, const uint8_t* dec, int64_t m0,
                    int64_t m1, float* out, int64_t ldo) {
    constexpr int MR = 4;
    if constexpr (kDecoded && kBothHalves<T>) {
        if (w.N - tile * kTile >= kTile) {
            for (; m0 + kBothHalvesRows <= m1; m0 += kBothHalvesRows)
                tile_both_halves_avx2<T, kBothHalvesRows>(w, tile, a, dec, m0, out, ldo);
            if (m0 == m1) return;
        }
    }
    for (int h = 0; h < 2; ++h) {
        if (w.N - tile * kTile <= 8 * h) break;  // the tail tile's second half is padding only
        int64_t m = m0;
        auto rows_x = [&] { return X == nullptr ? nullptr : X + (m - m0) * w.K; };
        for (; m + MR <= m1; m += MR) half_tile_avx2<T, MR, kDecoded>(w, tile, h, a, rows_x(), dec, m, out, ldo);
        switch (m1 - m) {
            case 3: half_tile_avx2<T, 3, kDecoded>(w, tile, h, a, rows_x(), dec, m, out, ldo); break;
            case 2: half_tile_avx2<T, 2, kDecoded>(w, tile, h, a, rows_x(), dec, m, out, ldo); break;
            case 1: half_tile_avx2<T, 1, kDecoded>(w, tile, h, a, rows_x(), dec, m, out, ldo); break;
            default: break;
        }
    }
}

constexpr int64_t kDecodeRows2 = 8;  // rows from which a call decodes its tiles first

template <int T>
void rows_avx2(const Weight& w, int64_t tile, const Acts& a, const int16_t* X, int64_t m0, int64_t m1, float* out,
               int64_t ldo) {
    if (m1 - m0 == 1) return tile_gemv_avx2<T, 1>(w, tile, a, X, m0, out, ldo);
    if (m1 - m0 == 2) return tile_gemv_avx2<T, 2>(w, tile, a, X, m0, out, ldo);
    if constexpr (T != Q8_0) {  // Q8_0's bytes are its values already
        if (m1 - m0 >= kDecodeRows2) {
            rows_avx2_from<T, true>(w, tile, a, X, decoded_tile2<T>(w, tile), m0, m1, out, ldo);
            return;
        }
    }
    rows_avx2_from<T, false>(w, tile, a, X, nullptr, m0, m1, out, ldo);
}

}  // namespace tmk::qmm
#endif
