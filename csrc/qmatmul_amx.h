// AMX-INT8 qmatmul for many rows (Sapphire Rapids and later; the avx512 variant built with AMX flags,
// used when cpu.cpp's amx_enabled() says Linux granted the tile state). A 16-row x 16-column x 32-input
// block is one TDPBSUD (TDPBSSD for the symmetric types) per activation plane: the activation rows are
// the signed A tile, and a weight block decoded to bytes is the B tile's layout (step j = inputs
// 4j..4j+3 of the 16 columns, 64 bytes). The products are exact int32 sums, the same integers the VNNI
// kernel forms, and the float work per block and row is add_row_avx512's, so the outputs are
// bit-identical to qmatmul_avx512.h's at any row count: AMX and VNNI rows may share a call.
//
// Where the time goes (SmolLM2's gate_up, 512 rows, 1 thread, Sapphire Rapids; 5.0 ms a call): the
// tile products and loads alone take 1.6 ms, and the per-block scaling of the sums (join, convert,
// scale, offset: ~6 vector ops a row) most of the rest, because tile products and vector ops do not
// overlap here: 64 independent FMAs a block added to a loop of bare products cost their full time.
// Tried and slower, with the same bits: TDPBF16PS on the same small integers (exact in bf16, their
// block sums exact in fp32), which saves the join and the conversion but takes twice the tile time
// (6.3 ms). Putting both planes in one 64-byte product ((16 u) . q1 + u . q2) needs a 4-bit fine
// plane, which cost greedy agreement with fp32 (88.7% against 100% over bench quality's prompts).
#pragma once

#include "qmatmul_avx512.h"

#if defined(TM_AMX)
namespace tmk::qmm {

bool amx_enabled();  // cpu.cpp
void count_amx_pass();  // cpu.cpp: how many thread passes took AMX, so tests can see that it ran

constexpr int64_t kAmxRows = 16;  // rows of an A tile: a call takes AMX for whole groups of 16
// A vocabulary-wide output (the head, Weight::stream_out) takes AMX only from this many rows: its weight
// streams from memory once per call, and with one or two groups of 16 the VNNI kernels, which ask for
// each block ahead as they go, hide that better than the AMX pass's decode of a chunk of tiles. On the
// 2-core Sapphire Rapids box (2 threads, alternated, fastest of 4) a Q8_0 head of 262,144 x 640 (Gemma
// 3's) at 16 / 24 / 32 / 48 / 64 rows took 21.8 / 31.0 / 40.6 / 56.9 / 84.4 ms on VNNI against 28.4 /
// 39.6 / 42.2 / 56.7 / 68.5 on AMX, one of 49,152 x 576 (SmolLM2's) 2.64 / 4.21 / 5.05 / 8.22 / 10.9
// against 2.94 / 4.70 / 4.98 / 7.45 / 9.53; the other weights gain from 16 rows (bench/qmatmul.py).
constexpr int64_t kAmxWideRows = 48;
inline int64_t amx_min_rows(const Weight& w) { return w.stream_out ? kAmxWideRows : kAmxRows; }

// Types with one scale per block of 32. Q6_K's integer scales are per 16 inputs: with a tile product
// per half block it measured no faster than VNNI (bench/qmatmul.py, Gemma 3's down), so it stays there.
template <int T>
constexpr bool kAmxType = T != Q6_K;

// Tiles: 0 and 1 hold the two activation planes' rows of a block (16 x 32 bytes), 2 the weight block
// (B: 8 rows of 64 bytes), 4..7 the int32 sums (16 x 16) of two planes x two blocks in flight.
struct TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

inline void amx_configure() {
    TileConfig c;
    for (int i : {0, 1}) {
        c.rows[i] = kAmxRows;
        c.colsb[i] = kBlock;
    }
    c.rows[2] = kBlock / 4;
    c.colsb[2] = 64;
    for (int i = 4; i < 8; ++i) {
        c.rows[i] = kAmxRows;
        c.colsb[i] = 64;
    }
    // Not gcc 12's _tile_loadconfig: its asm tells the compiler it reads 8 bytes, so the stores of
    // the rest of the configuration may be dropped, and ldtilecfg faults on what the stack held.
    asm volatile("ldtilecfg %0" : : "m"(c));
}

// gcc 12's _tile_loadd does not tell the compiler what it reads. Its inputs here are written before
// the call (the activations) or between amx_values' compiler barriers (the decoded weight), so the tile
// loads need no "memory" clobber, which would make the compiler reload every value it keeps in memory
// after each of them. A store names the 1 KB it writes (16 rows of 64 bytes), so the scaling loop's
// reads of the sums stay after it.
struct SumTile {
    int32_t v[256];
};
#define TM_TILE_LOAD(t, base, stride) asm volatile("tileloadd (%0,%1,1), %%tmm" #t : : "r"(base), "r"((long)(stride)))
#define TM_TILE_STORE(t, base)                                                                             \
    asm volatile("tilestored %%tmm" #t ", (%1,%2,1)" : "=m"(*reinterpret_cast<SumTile*>(base)) : "r"(base), \
                 "r"(64L))

// Both planes' products of a block of 16 rows (x: the first row's q1, rows `stride` bytes apart, q2 K
// bytes after q1) with the weight columns v, into sum tiles C1 and C2; signed weights (SIGNED true)
// take TDPBSSD, unsigned ones TDPBSUD. gcc's tile intrinsics paste their tile numbers into the
// assembly, so they must be literal numbers: macros, not templates.
#define TM_AMX_PRODUCTS(SIGNED, C1, C2, x, K, stride, v) \
    do {                                                   \
        TM_TILE_LOAD(0, (x), (stride));                    \
        TM_TILE_LOAD(1, (x) + (K), (stride));              \
        TM_TILE_LOAD(2, (v), 64);                          \
        _tile_zero(C1);                                    \
        _tile_zero(C2);                                    \
        if constexpr (SIGNED) {                            \
            _tile_dpbssd(C1, 0, 2);                        \
            _tile_dpbssd(C2, 1, 2);                        \
        } else {                                           \
            _tile_dpbsud(C1, 0, 2);                        \
            _tile_dpbsud(C2, 1, 2);                        \
        }                                                  \
    } while (0)
#define TM_AMX_STORE(C1, C2, sums)            \
    do {                                      \
        TM_TILE_STORE(C1, (sums));            \
        TM_TILE_STORE(C2, (sums) + 256);      \
    } while (0)

// Rows [m0, m0 + 16) of one tile into out (the tile's first column). v: the tile's values in the
// decoded layout (block b at v + b * kDecodedBlock). A pipeline two blocks deep: block b + 1's sums are
// stored and block b + 2's products issued (into the sum tiles block b left) before block b's sums,
// stored one block earlier, are read back, so the scaling never waits for products just issued.
template <int T>
void tile_amx(const Weight& w, int64_t tile, const Acts& a, const uint8_t* v, int64_t m0, float* out, int64_t ldo) {
    static_assert(kAmxType<T>);
    constexpr bool kSigned = int_offset(T) != 0;  // amx_values took the offset off
    constexpr int R = int(kAmxRows);
    const int64_t nb = w.blocks(), stride = Acts::row_bytes(w.K);
    const int8_t* x0 = a.row(m0);
    alignas(64) int32_t sums[2][2][R][16];  // [block parity][plane][row][column]
    __m512 acc[R];
#pragma GCC unroll 16  // every loop over acc is unrolled: one indexed access keeps all of acc in memory
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    TM_AMX_PRODUCTS(kSigned, 4, 5, x0, w.K, stride, v);
    if (nb > 1) TM_AMX_PRODUCTS(kSigned, 6, 7, x0 + kBlock, w.K, stride, v + kDecodedBlock);
    TM_AMX_STORE(4, 5, &sums[0][0][0][0]);
    for (int64_t b = 0; b < nb; ++b) {
        if (b + 1 < nb) {
            if (b & 1)
                TM_AMX_STORE(4, 5, &sums[0][0][0][0]);
            else
                TM_AMX_STORE(6, 7, &sums[1][0][0][0]);
        }
        if (b + 2 < nb) {
            const int8_t* x = x0 + (b + 2) * kBlock;
            const uint8_t* vb = v + (b + 2) * kDecodedBlock;
            if (b & 1)
                TM_AMX_PRODUCTS(kSigned, 6, 7, x, w.K, stride, vb);
            else
                TM_AMX_PRODUCTS(kSigned, 4, 5, x, w.K, stride, vb);
        }
        const BlockScales<T> f(w, tile, b);
        const int32_t* s = &sums[b & 1][0][0][0];
#pragma GCC unroll 16  // acc stays in registers
        for (int r = 0; r < R; ++r) {
            const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(s + 16 * r), kFine),
                                                  _mm512_load_si512(s + 256 + 16 * r));
            acc[r] = add_row_avx512<T>(f, a, m0 + r, b, isum, acc[r]);
        }
    }
    const int64_t left = w.N - tile * kTile;
    const __mmask16 cols = left >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    if (w.stream_out && left >= kTile && (reinterpret_cast<uintptr_t>(out) & 63) == 0 && (ldo & 15) == 0) {
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) _mm512_stream_ps(out + (m0 + r) * ldo, acc[r]);
    } else {
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (m0 + r) * ldo, cols, acc[r]);
    }
}

// Tiles [t0, t0 + n)'s values in the decoded layout, tile i at the result + i * blocks * kDecodedBlock,
// decoded into the thread's buffer. The symmetric types' values are stored signed, offset taken off
// (u - c fits int8 for each of them: Q8_0's is the GGUF's own q), so their products need no offset
// term: the same integers the VNNI kernel forms as u . x - c S, with two vector ops a row fewer in
// the scaling: SmolLM2's Q8_0 head at 64 rows 7.5-8.2 -> 7.0-7.4 ms, Gemma 3's Q5_0 gate_up at 512
// rows 4.1-4.6 -> 3.8 ms (alternated builds, two rounds each).
template <int T>
inline const uint8_t* amx_values(const Weight& w, int64_t t0, int64_t n) {
    thread_local LineBuffer<uint8_t> buffer;  // not decoded_tile's: the VNNI tails of a pass use that one
    asm volatile("" : : : "memory");  // and the last pass's tile loads are done with the buffer first
    uint8_t* const values = buffer.get(size_t(n * w.blocks()) * kDecodedBlock);
    decode_tiles(w, t0, n, values, [](const uint8_t* qs, int j, uint8_t* dst) {
        constexpr int c = int_offset(T);
        __m512i v = step_values<T>(qs, j);
        if constexpr (c != 0) v = _mm512_sub_epi8(v, _mm512_set1_epi8(char(c)));
        _mm512_storeu_si512(dst, v);
    });
    asm volatile("" : : : "memory");  // the decoded values are in memory before any tile load
    return values;
}

}  // namespace tmk::qmm
#endif
