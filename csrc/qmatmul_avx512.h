// AVX-512 VNNI qmatmul tile: one zmm lane per output column of the 16-row tile. Each step of 4 inputs
// is one vpdpbusd per activation plane (u8 weights x s8 activations broadcast to all lanes), so the
// integer dot products are exact; the symmetric types' offsets start the integer sum at -offset * S.
#pragma once

#include "qmatmul_layout.h"

#if defined(TM_AVX512)
namespace tmk::qmm {

// Unsigned 8-bit values of step j (inputs 4j..4j+3 of the block, 16 rows).
template <int T>
inline __m512i step_values(const uint8_t* qs, int j) {
    if constexpr (T == Q8_0) return _mm512_loadu_si512(qs + 64 * j);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i packed = _mm512_loadu_si512(qs + 64 * (j & 3));
    __m512i v = _mm512_and_si512(j < 4 ? packed : _mm512_srli_epi16(packed, 4), low4);
    if constexpr (T == Q5_0) {
        const __m512i plane = _mm512_loadu_si512(qs + 256);
        __mmask64 high = _mm512_test_epi8_mask(plane, _mm512_set1_epi8(char(1 << j)));
        v = _mm512_mask_add_epi8(v, high, v, _mm512_set1_epi8(0x10));
    }
    if constexpr (T == Q6_K) {
        const __m512i plane = _mm512_loadu_si512(qs + 256 + 64 * (j >> 2));
        __m512i hi;
        switch (j & 3) {  // bits 2t..2t+1 -> bits 4..5; bits leaking across bytes are masked off
            case 0: hi = _mm512_slli_epi16(plane, 4); break;
            case 1: hi = _mm512_slli_epi16(plane, 2); break;
            case 2: hi = plane; break;
            default: hi = _mm512_srli_epi16(plane, 2); break;
        }
        v = _mm512_or_si512(v, _mm512_and_si512(hi, _mm512_set1_epi8(0x30)));
    }
    return v;
}

template <int T, bool kDecoded>
inline __m512i step_at(const uint8_t* src, int j) {
    if constexpr (kDecoded)
        return _mm512_loadu_si512(src + 64 * j);
    else
        return step_values<T>(src, j);
}

template <int T>
inline const uint8_t* decoded_tile512(const Weight& w, int64_t tile) {
    return decoded_tile(w, tile, [](const uint8_t* qs, int j, uint8_t* dst) {
        _mm512_storeu_si512(dst, step_values<T>(qs, j));
    });
}

// acc += u8 v x the 4 s8 at x broadcast to every lane, the broadcast folded into the instruction's
// memory operand ({1to16}): GCC emits a separate vpbroadcastd per step otherwise, ~20% slower at
// 64-512 rows (bench/qmatmul.py).
inline __m512i dpbusd_bcast(__m512i acc, __m512i v, const int8_t* x) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*reinterpret_cast<const int32_t*>(x)));
    return acc;
}
inline __m512 load_halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 load_u8_as_f32(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

// Integer dots of steps [j0, j1) for MR rows, both activation planes (q2 lies K bytes after q1),
// joined and added to isum: isum += (q1 . u << kFine) + q2 . u. Each plane has its own vpdpbusd chain,
// and with few rows even and odd steps too, so a GEMV is not bound by the chains' latency (integer
// sums are exact: the split does not change any result).
template <int T, int MR, bool kDecoded>
inline void dot_steps(const uint8_t* qs, const int8_t* const* x, int64_t K, int j0, int j1, __m512i* isum) {
    constexpr int kSplit = MR <= 2 ? 2 : 1;
    __m512i hi[kSplit][MR], lo[kSplit][MR];
    for (int s = 0; s < kSplit; ++s)
        for (int r = 0; r < MR; ++r) hi[s][r] = lo[s][r] = _mm512_setzero_si512();
    for (int j = j0; j < j1; j += kSplit)
        for (int s = 0; s < kSplit; ++s) {
            const __m512i v = step_at<T, kDecoded>(qs, j + s);
            for (int r = 0; r < MR; ++r) {
                hi[s][r] = dpbusd_bcast(hi[s][r], v, x[r] + 4 * (j + s));
                lo[s][r] = dpbusd_bcast(lo[s][r], v, x[r] + K + 4 * (j + s));
            }
        }
    for (int r = 0; r < MR; ++r) {
        __m512i h = hi[0][r], l = lo[0][r];
        if constexpr (kSplit == 2) {
            h = _mm512_add_epi32(h, hi[1][r]);
            l = _mm512_add_epi32(l, lo[1][r]);
        }
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_slli_epi32(h, kFine), l));
    }
}

// A block's float factors for one tile: the scale of its integer sums, and the offset term's factor
// (Q4_1 adds offset * dsum, Q4_K subtracts it).
template <int T>
struct BlockScales {
    __m512 scale, offset;
    BlockScales(const Weight& w, int64_t tile, int64_t b) {
        const uint8_t* sc = w.sc_at(tile, b);
        if constexpr (T == Q6_K)
            scale = load_halves(w.sup_at(tile, b));
        else if constexpr (T == Q4_K)
            scale = _mm512_mul_ps(load_halves(w.sup_at(tile, b)), load_u8_as_f32(sc));
        else
            scale = load_halves(sc);
        if constexpr (T == Q4_1)
            offset = load_halves(sc + 32);
        else if constexpr (T == Q4_K)
            offset = _mm512_mul_ps(load_halves(w.sup_at(tile, b) + 32), load_u8_as_f32(sc + 16));
        else
            offset = _mm512_setzero_ps();
    }
};

// acc += row m's integer sums of block b times the tile's scales and the row's dx, then the offset
// term: the float work per block and row of every kernel (VNNI, grouped or AMX), so how rows and tiles
// are grouped never changes a bit.
template <int T>
inline __m512 add_row_avx512(const BlockScales<T>& f, const Acts& a, int64_t m, int64_t b, __m512i isum, __m512 acc) {
    acc = _mm512_fmadd_ps(_mm512_mul_ps(f.scale, _mm512_set1_ps(a.dx(m, b))), _mm512_cvtepi32_ps(isum), acc);
    if constexpr (T == Q4_1) acc = _mm512_fmadd_ps(f.offset, _mm512_set1_ps(a.dsum(m, b)), acc);
    if constexpr (T == Q4_K) acc = _mm512_fnmadd_ps(f.offset, _mm512_set1_ps(a.dsum(m, b)), acc);
    return acc;
}

// acc[r] += block b's integer sums isum[r] (rows m0 + r), scaled: add_row_avx512 for MR rows.
template <int T, int MR>
inline void add_block_avx512(const Weight& w, int64_t tile, int64_t b, const Acts& a, int64_t m0,
                             const __m512i* isum, __m512* acc) {
    const BlockScales<T> f(w, tile, b);
    for (int r = 0; r < MR; ++r) acc[r] = add_row_avx512<T>(f, a, m0 + r, b, isum[r], acc[r]);
}

// dec: the tile's decoded values (kDecoded) or null. first_pass: the first rows over this tile in the
// call's pass, whose weight comes from memory (the next rows find it in cache).
template <int T, int MR, bool kDecoded>
void tile_avx512(const Weight& w, int64_t tile, const Acts& a, const uint8_t* dec, int64_t m0, float* out,
                 int64_t ldo, bool first_pass) {
    const int64_t nb = w.blocks();
    const int64_t left = w.N - tile * kTile;
    const __mmask16 cols = left >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    constexpr int c = int_offset(T);
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    const int8_t* x[MR];
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* qs = kDecoded ? dec + b * kDecodedBlock : w.qs_at(tile, b);
        const uint8_t* sc = w.sc_at(tile, b);
        if constexpr (!kDecoded) {  // the first pass's weight streams from memory: ask for it early
            if (first_pass) prefetch_ahead(T, qs, sc);
        }
        for (int r = 0; r < MR; ++r) x[r] = a.row(m0 + r) + b * kBlock;
        __m512i isum[MR];
        if constexpr (T == Q6_K) {
            const __m512i sc_a = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)sc));
            const __m512i sc_b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sc + 16)));
            __m512i half[MR];
            for (int r = 0; r < MR; ++r) half[r] = _mm512_set1_epi32(-c * a.sum16(m0 + r, 2 * b));
            dot_steps<T, MR, kDecoded>(qs, x, w.K, 0, 4, half);
            for (int r = 0; r < MR; ++r) isum[r] = _mm512_mullo_epi32(half[r], sc_a);
            for (int r = 0; r < MR; ++r) half[r] = _mm512_set1_epi32(-c * a.sum16(m0 + r, 2 * b + 1));
            dot_steps<T, MR, kDecoded>(qs, x, w.K, 4, 8, half);
            for (int r = 0; r < MR; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(half[r], sc_b));
        } else {
            for (int r = 0; r < MR; ++r) {
                if constexpr (T == Q4_1 || T == Q4_K)
                    isum[r] = _mm512_setzero_si512();
                else
                    isum[r] = _mm512_set1_epi32(-c * a.block_sum(m0 + r, b));
            }
            dot_steps<T, MR, kDecoded>(qs, x, w.K, 0, 8, isum);
        }
        add_block_avx512<T, MR>(w, tile, b, a, m0, isum, acc);
    }
    // Whole aligned lines only: a partial line would be merged in memory, slower than a normal store.
    if (w.stream_out && left >= kTile && (reinterpret_cast<uintptr_t>(out) & 63) == 0 && (ldo & 15) == 0) {
        for (int r = 0; r < MR; ++r) _mm512_stream_ps(out + (m0 + r) * ldo, acc[r]);
    } else {
        for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + (m0 + r) * ldo, cols, acc[r]);
    }
}

// Rows [m0, m1) of one tile into out (the tile's first column), MR at a time; the tail takes a smaller
// MR with the same per-row math. Six rows (12 integer and 6 float accumulators) measured faster than
// four or eight (bench/qmatmul.py, Zen 4).
template <int T, bool kDecoded>
void rows_avx512_from(const Weight& w, int64_t tile, const Acts& a, const uint8_t* dec, int64_t m0, int64_t m1,
                      float* out, int64_t ldo) {
    constexpr int MR = 6;
    int64_t m = m0;
    for (; m + MR <= m1; m += MR) tile_avx512<T, MR, kDecoded>(w, tile, a, dec, m, out, ldo, m == m0);
    const bool first = m == m0;
    switch (m1 - m) {
        case 5: tile_avx512<T, 5, kDecoded>(w, tile, a, dec, m, out, ldo, first); break;
        case 4: tile_avx512<T, 4, kDecoded>(w, tile, a, dec, m, out, ldo, first); break;
        case 3: tile_avx512<T, 3, kDecoded>(w, tile, a, dec, m, out, ldo, first); break;
        case 2: tile_avx512<T, 2, kDecoded>(w, tile, a, dec, m, out, ldo, first); break;
        case 1: tile_avx512<T, 1, kDecoded>(w, tile, a, dec, m, out, ldo, first); break;
        default: break;
    }
}

// NT adjacent tiles at once, MR rows: each activation word, broadcast once into a register, feeds
// every tile's vpdpbusd, so a step makes NT + 2 MR loads for 2 NT MR dot products where one tile makes
// 1 + 2 MR (one per vpdpbusd's broadcast operand) for 2 MR. Types whose blocks are one scale and one
// integer sum (no K-quants). The per-row arithmetic is tile_avx512's, operation for operation, so the
// bits do not depend on grouping. Two tiles of three rows measured best (bench/qmatmul.py, Zen 5:
// SmolLM2's Q4_1 gate_up at 512 rows 1.3x faster than one tile of six rows; 2x2, 2x4, 3x2, 3x3 and 4x2
// in between).
template <int T>
constexpr bool kGrouped = T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q8_0;
constexpr int kGroupTiles = 2;
constexpr int kGroupRows = 3;

// Whether a pass over `rows` rows (of a kGrouped type) takes tiles [t, t + kGroupTiles) of a thread's
// range [.., t1) as a group: whole tiles only. The vocabulary-wide head groups too (SmolLM2's at 64
// rows ~20% faster, bench/qmatmul.py; its 64-sequence decode step 41.8-44.7 -> 38.6-40.4 ms,
// bench/profile_step.py, alternated).
inline bool takes_group(const Weight& w, int64_t t, int64_t t1, int64_t rows) {
    return rows >= kGroupRows && t + kGroupTiles <= t1 &&
           (t + kGroupTiles) * kTile <= w.N;
}

// first_pass: the pass's first rows over these tiles, which come from memory: each tile's blocks are
// asked for kPrefetch bytes ahead, as tile_avx512 does for one or two rows. This replaced a prefetch of
// the next group's tiles whole (prefetch_tile, 288 requests in a burst before each group, SmolLM2's
// head): on the 2-core Sapphire Rapids box (bench/qmatmul.py, 1 thread, alternated builds) SmolLM2's
// Q8_0 head at 3 / 4 / 8 rows took 1.14-1.22 / 1.53-1.55 / 2.7 ms against 1.84-1.92 / 2.26-2.33 /
// 3.3-3.4 (two rows: 1.11-1.17), Gemma 3's 14.0 / 16.2 / 22.5 ms against 18.1 / 21.9 / 28.3; at 64 rows
// with AMX off, the same. Verifying a few proposed tokens and decoding a few sequences are such calls:
// with this (and tile_avx512 prefetching the same way at any row count) a SmolLM2 step of one sequence
// with 3 / 4 / 5 rows (2-4 proposals) took 12.0-12.5 / 15.4-15.9 / 17.3-17.7 ms against 13.8-14.5 /
// 17.6-18.3 / 20.0-20.5, and a Gemma 3 decode step of 3 / 4 sequences 22.7-23.8 / 26.3-27.4 ms against
// 29.9-31.0 / 35.3-36.5 (1 thread); one sequence alone and 16 or 64 took the same.
//
// ahead: the first of the NT tiles this thread takes next (-1: none, or not on this pass), whose blocks
// are asked for along the way, block b's with block b: a pass over tiles already in cache is all
// arithmetic and leaves the memory idle, so the next group's first pass finds its weight in L2
// instead of waiting for it. On the 2-core Sapphire Rapids box (1 thread, each call's weight from
// memory: 40 copies of it in turn; three alternated rounds) SmolLM2's gate_up at 5 / 8 / 12 rows took
// 164-166 / 205-220 / 300-317 us against 182-197 / 241-255 / 339-358, its head 2.05-2.27 / 2.52-2.91 /
// 4.19-4.78 ms against 2.28-2.35 / 3.06-3.29 / 4.89-5.07 (down, K = 1536, the same); one sequence
// verifying 7 proposals (8 rows, 2 threads, ~330 keys) 13.6-14.3 ms a step against 15.5-17.6.
template <int T, int MR, int NT>
void tile_group_avx512(const Weight& w, int64_t tile, const Acts& a, int64_t m0, float* out, int64_t ldo,
                       bool first_pass, int64_t ahead = -1) {
    static_assert(kGrouped<T>);
    constexpr int c = int_offset(T);
    const int64_t nb = w.blocks();
    __m512 acc[NT][MR];
    for (int h = 0; h < NT; ++h)
        for (int r = 0; r < MR; ++r) acc[h][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* qs[NT];
        for (int h = 0; h < NT; ++h) qs[h] = w.qs_at(tile + h, b);
        if (first_pass)
            for (int h = 0; h < NT; ++h) prefetch_ahead(T, qs[h], w.sc_at(tile + h, b));
        if (ahead >= 0)
            for (int h = 0; h < NT; ++h) prefetch_block(T, w.qs_at(ahead + h, b), w.sc_at(ahead + h, b));
        const int8_t* x[MR];
        for (int r = 0; r < MR; ++r) x[r] = a.row(m0 + r) + b * kBlock;
        __m512i hi[MR][NT], lo[MR][NT];
        for (int r = 0; r < MR; ++r) {
            // The symmetric types' offset enters as the fine plane's start, as isum's in tile_avx512.
            const __m512i start = c == 0 ? _mm512_setzero_si512()
                                         : _mm512_set1_epi32(-c * a.block_sum(m0 + r, b));
            for (int h = 0; h < NT; ++h) {
                hi[r][h] = _mm512_setzero_si512();
                lo[r][h] = start;
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            __m512i v[NT];
            for (int h = 0; h < NT; ++h) v[h] = step_values<T>(qs[h], j);
            for (int r = 0; r < MR; ++r) {
                const __m512i xh = _mm512_set1_epi32(int32_t(load_u32(x[r] + 4 * j)));
                const __m512i xl = _mm512_set1_epi32(int32_t(load_u32(x[r] + w.K + 4 * j)));
                for (int h = 0; h < NT; ++h) {
                    hi[r][h] = _mm512_dpbusd_epi32(hi[r][h], v[h], xh);
                    lo[r][h] = _mm512_dpbusd_epi32(lo[r][h], v[h], xl);
                }
            }
        }
        for (int h = 0; h < NT; ++h) {
            __m512i isum[MR];
            for (int r = 0; r < MR; ++r) isum[r] = _mm512_add_epi32(_mm512_slli_epi32(hi[r][h], kFine), lo[r][h]);
            add_block_avx512<T, MR>(w, tile + h, b, a, m0, isum, acc[h]);
        }
    }
    // As tile_avx512: a wide output (the head) by streaming stores of whole aligned lines.
    const bool stream = w.stream_out && (reinterpret_cast<uintptr_t>(out) & 63) == 0 && (ldo & 15) == 0;
    for (int r = 0; r < MR; ++r)
        for (int h = 0; h < NT; ++h) {
            float* o = out + (m0 + r) * ldo + h * kTile;
            if (stream)
                _mm512_stream_ps(o, acc[h][r]);
            else
                _mm512_storeu_ps(o, acc[h][r]);
        }
}

// Rows [m0, m1) of kGroupTiles whole tiles from tile on into out (the first tile's first column).
// Groups of kGroupRows, but a row count that would leave one row over (4, 7, 10, ...) starts with a group
// of four, and one that would leave two (8, 11, ...) with two: a pass of one or two rows costs most of
// a pass of three (its dot products are too few to fill the pipeline), while a fourth row in a group
// costs about a third of one. On the 2-core Sapphire Rapids box (bench/qmatmul.py, 1 thread, two
// alternated rounds) SmolLM2's gate_up at 4 / 7 / 8 / 10 rows took 80 / 134 / 149-157 / 188-190 us
// against 94-95 / 149 / 161 / 202-204 and its head 1.30 / 2.13 / 2.37-2.41 / 2.90 ms against 1.52-1.55 /
// 2.34-2.43 / 2.57-2.62 / 3.15-3.27; a verifying step of one sequence with 4 / 7 rows (1 thread) 3-4%
// faster. Five rows stay three and two; other rows left over run as a group of their own over the
// same tiles (rather than a tile at a time, where one row is a single chain of dependent dot products).
// next: the first of the group of tiles the thread takes after these (-1: none), which the second pass
// asks for along the way (tile_group_avx512's ahead), or the only pass where there is one (3 or 4 rows:
// a verification of 2 or 3 proposals), which otherwise met each group's first blocks in memory. On a
// 2-core Xeon without AMX (1 thread, the weight from memory: 400 copies of it in turn) SmolLM2's
// gate_up at 3 / 4 rows took 78-90 / 91 us against 110-117 / 118-126 (1 and 2 rows: 87 / 80); its
// engine steps of one sequence with 3 / 4 rows (2 threads, three alternated rounds of
// speculative_bound.step_costs) 4.57-4.61 / 5.39-5.50 ms against 4.70-4.85 / 5.76-5.83.
template <int T>
void rows_group_avx512(const Weight& w, int64_t tile, const Acts& a, int64_t m0, int64_t m1, float* out, int64_t ldo,
                       int64_t next = -1) {
    int64_t m = m0;
    int pass = 0;
    const int64_t left = (m1 - m0) % kGroupRows;
    const int64_t fours = left == 1 && m1 - m0 >= 4 ? 1 : left == 2 && m1 - m0 >= 8 ? 2 : 0;
    const int64_t rest = m1 - m0 - 4 * fours;
    const int ahead_pass = fours + rest / kGroupRows + (rest % kGroupRows != 0) >= 2 ? 1 : 0;
    for (int64_t i = 0; i < fours; ++i, m += 4, ++pass)
        tile_group_avx512<T, 4, kGroupTiles>(w, tile, a, m, out, ldo, pass == 0, pass == ahead_pass ? next : -1);
    for (; m + kGroupRows <= m1; m += kGroupRows, ++pass)
        tile_group_avx512<T, kGroupRows, kGroupTiles>(w, tile, a, m, out, ldo, pass == 0, pass == ahead_pass ? next : -1);
    static_assert(kGroupRows == 3);
    switch (m1 - m) {
        case 2: tile_group_avx512<T, 2, kGroupTiles>(w, tile, a, m, out, ldo, pass == 0, pass == ahead_pass ? next : -1); break;
        case 1: tile_group_avx512<T, 1, kGroupTiles>(w, tile, a, m, out, ldo, pass == 0, pass == ahead_pass ? next : -1); break;
        default: break;
    }
}

constexpr int64_t kDecodeRows512 = 12;  // rows from which a call decodes its tiles first

// Whether a pass of `rows` rows over one tile at a time wants the next tile prefetched whole
// (qmatmul.cpp's prefetch_tile): only where it decodes each tile first, reading it all at once;
// otherwise tile_avx512 asks for its blocks ahead itself.
template <int T>
constexpr bool prefetches_next_tile(int64_t rows) {
    return (T == Q4_K || T == Q6_K) && rows >= kDecodeRows512;
}

template <int T>
void rows_avx512(const Weight& w, int64_t tile, const Acts& a, int64_t m0, int64_t m1, float* out, int64_t ldo) {
    // With VNNI only the K-quants gain from decoding first (bench/qmatmul.py at 64-512 rows, Zen 5:
    // Gemma 3's Q4_K attn_out and Q6_K down 10-18% faster); the other 4/5-bit types measured the same
    // or slower, and Q8_0's bytes are its values already.
    if constexpr (T == Q4_K || T == Q6_K) {
        if (m1 - m0 >= kDecodeRows512) {
            rows_avx512_from<T, true>(w, tile, a, decoded_tile512<T>(w, tile), m0, m1, out, ldo);
            return;
        }
    }
    rows_avx512_from<T, false>(w, tile, a, nullptr, m0, m1, out, ldo);
}

}  // namespace tmk::qmm
#endif
