// The repacked GGUF weight and quantized activations the qmatmul kernels read (written by
// src/tokenmill/kernels/qmatmul.py, whose docstring draws the layout), and the portable scalar kernel
// that is the reading of that layout every SIMD path must agree with.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace tmk::qmm {

// ggml's type numbers, so Python passes GGMLQuantizationType values straight through.
enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

constexpr int kTile = 16;    // output rows interleaved in one tile
constexpr int kBlock = 32;   // inputs per block
constexpr int kSuper = 256;  // K-quant super block

inline int qs_bytes(int t) { return t == Q8_0 ? 512 : t == Q5_0 ? 320 : t == Q6_K ? 384 : 256; }
inline int sc_bytes(int t) { return t == Q4_1 ? 64 : 32; }
inline int sup_bytes(int t) { return t == Q4_K ? 64 : t == Q6_K ? 32 : 0; }
// Bytes ahead in the weight stream that the few-row (GEMV) kernels prefetch: there the weight comes
// from memory and each block's work is too short for the hardware prefetcher to keep ahead alone.
constexpr int kPrefetch = 2048;
inline void prefetch_ahead(int t, const uint8_t* qs, const uint8_t* sc) {
    for (int i = 0; i < qs_bytes(t); i += 64) __builtin_prefetch(qs + kPrefetch + i, 0, 3);
    __builtin_prefetch(sc + kPrefetch / 8, 0, 3);  // the scales stream about 1/8 as fast
}

// One block's weight lines and its scales, into L2 (a block the next group of tiles reads: L1 holds
// the current group's).
inline void prefetch_block(int t, const uint8_t* qs, const uint8_t* sc) {
    for (int i = 0; i < qs_bytes(t); i += 64) __builtin_prefetch(qs + i, 0, 2);
    __builtin_prefetch(sc, 0, 2);
}

// Symmetric types: w = d * (u - offset), so the offset folds into the integer dot product.
constexpr int int_offset(int t) { return t == Q4_0 ? 8 : t == Q5_0 ? 16 : t == Q8_0 ? 128 : t == Q6_K ? 32 : 0; }

// An input row is quantized as two int8 planes per block of 32: q1 = round(x / d1) with d1 = absmax/127
// (llama.cpp's Q8 activations), and q2 = round((x - d1 q1) / (d1/128)) in [-64, 64], the rounding
// residual on a 128x finer grid. So x ~ dc (128 q1 + q2) with dc = d1/128: one plane alone costs a third
// of greedy agreement with fp32, two are closer to fp32 than bf16 is. The kernels take both planes'
// dot products with each decoded weight step and join them as one integer (dot1 << 7) + dot2, so the
// fp32 work per block stays that of one plane.
// Row layout (kernels/qmatmul.py QuantizedActivations): q1 int8 [K] | q2 int8 [K] | dc fp32 [K/32] |
// ds = dc * S fp32 [K/32] | S per 16 int32 [K/16], where S = 128 sum(q1) + sum(q2).
constexpr int kFine = 7;  // q2's grid is 2^-kFine of q1's
// |X| = |128 q1 + q2| <= 16256 (q1 = +-127 leaves a residual of the other sign), so the joined integer
// sums fit int32: a block's u . X <= 32 * 255 * 16256 ~ 1.3e8 (Q8_0), and Q6_K's two 16-input halves
// times their int8 scales <= 2 * 16 * 32 * 16256 * 128 ~ 2.13e9 < 2^31.

struct Acts {
    const uint8_t* data;
    int64_t K;
    static int64_t row_bytes(int64_t K) { return 2 * K + 8 * (K / kBlock) + 4 * (K / 16); }
    const uint8_t* at(int64_t m) const { return data + m * row_bytes(K); }
    const int8_t* row(int64_t m) const { return reinterpret_cast<const int8_t*>(at(m)); }        // q1
    const int8_t* fine(int64_t m) const { return reinterpret_cast<const int8_t*>(at(m)) + K; }   // q2
    float dx(int64_t m, int64_t b) const { return load<float>(at(m) + 2 * K + 4 * b); }
    float dsum(int64_t m, int64_t b) const { return load<float>(at(m) + 2 * K + 4 * (K / kBlock) + 4 * b); }
    int32_t sum16(int64_t m, int64_t half) const { return load<int32_t>(at(m) + 2 * K + 8 * (K / kBlock) + 4 * half); }
    int32_t block_sum(int64_t m, int64_t b) const { return sum16(m, 2 * b) + sum16(m, 2 * b + 1); }  // S of block b
    template <typename V>
    static V load(const uint8_t* p) {
        V v;
        std::memcpy(&v, p, sizeof(V));
        return v;
    }
};

struct Weight {
    int type;
    const uint8_t* qs;
    const uint8_t* sc;
    const uint8_t* sup;
    int64_t N, K;
    bool stream_out = false;  // kStreamColumns (qmatmul.cpp)
    int64_t blocks() const { return K / kBlock; }
    int64_t tiles() const { return (N + kTile - 1) / kTile; }
    const uint8_t* qs_at(int64_t tile, int64_t b) const { return qs + (tile * blocks() + b) * qs_bytes(type); }
    const uint8_t* sc_at(int64_t tile, int64_t b) const { return sc + (tile * blocks() + b) * sc_bytes(type); }
    const uint8_t* sup_at(int64_t tile, int64_t b) const {
        return sup + (tile * (K / kSuper) + b / (kSuper / kBlock)) * sup_bytes(type);
    }
};

// A many-row call decodes each weight tile's values once into a buffer and its MR-row passes (and
// both activation planes) read them from there: the nibble and bit-plane decoding is a good share of
// the vector ALU work, most of all without VNNI (bench/qmatmul.py). The layout is Q8_0's: block b's
// step j (inputs 4j..4j+3 of its 16 rows, as unsigned bytes) at b * kDecodedBlock + 64 j.
// store_step(qs, j, dst) writes step j of the packed block qs to dst (the variant's own decoding).
constexpr int kDecodedBlock = 512;
// Tiles [t0, t0 + n) decoded into dst, tile i at dst + i * blocks * kDecodedBlock.
template <typename StoreStep>
inline void decode_tiles(const Weight& w, int64_t t0, int64_t n, uint8_t* dst, StoreStep store_step) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t b = 0; b < w.blocks(); ++b)
            for (int j = 0; j < 8; ++j)
                store_step(w.qs_at(t0 + i, b), j, dst + (i * w.blocks() + b) * kDecodedBlock + 64 * j);
}

template <typename StoreStep>
inline const uint8_t* decoded_tile(const Weight& w, int64_t tile, StoreStep store_step) {
    thread_local LineBuffer<uint8_t> buffer;  // each worker thread its own
    uint8_t* const values = buffer.get(size_t(w.blocks()) * kDecodedBlock);
    decode_tiles(w, tile, 1, values, store_step);
    return values;
}

inline uint32_t load_u32(const void* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

inline float half_at(const uint8_t* p, int i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return f16_to_f32(h);
}

// The 32 unsigned values of 16 rows of one block: u[row][k].
inline void decode_block(int t, const uint8_t* qs, uint8_t u[kTile][kBlock]) {
    for (int j = 0; j < 8; ++j)
        for (int r = 0; r < kTile; ++r)
            for (int i = 0; i < 4; ++i) {
                int at = 4 * r + i;
                uint8_t v;
                if (t == Q8_0) {
                    v = qs[64 * j + at];
                } else {
                    v = qs[64 * (j & 3) + at];
                    v = j < 4 ? v & 0xF : v >> 4;
                    if (t == Q5_0) v |= ((qs[256 + at] >> j) & 1) << 4;
                    if (t == Q6_K) v |= ((qs[256 + 64 * (j >> 2) + at] >> (2 * (j & 3))) & 3) << 4;
                }
                u[r][4 * j + i] = v;
            }
}

// Scalar kernel: rows [m0, m1) x tile into out (the tile's first column, row stride ldo). Per block and
// output: the two planes' integer dot products joined (offsets folded in), then
// acc += (w_scale * dx) * isum [+ w_offset * ds], in K order.
inline void tile_scalar(const Weight& w, int64_t tile, const Acts& a, int64_t m0, int64_t m1, float* out,
                        int64_t ldo) {
    const int t = w.type, c = int_offset(t);
    const int64_t nb = w.blocks();
    const int cols = int(w.N - tile * kTile < kTile ? w.N - tile * kTile : kTile);
    uint8_t u[kTile][kBlock];
    for (int64_t m = m0; m < m1; ++m) {
        float acc[kTile] = {};
        const int8_t* x = a.row(m);
        for (int64_t b = 0; b < nb; ++b) {
            decode_block(t, w.qs_at(tile, b), u);
            const uint8_t* sc = w.sc_at(tile, b);
            const int8_t* xb = x + b * kBlock;
            const int8_t* fb = a.fine(m) + b * kBlock;
            const float dx = a.dx(m, b), ds = a.dsum(m, b);
            const int32_t sa = a.sum16(m, 2 * b), sb = a.sum16(m, 2 * b + 1);
            for (int r = 0; r < kTile; ++r) {
                int32_t dot_a = 0, dot_b = 0, fine_a = 0, fine_b = 0;
                for (int k = 0; k < 16; ++k) dot_a += int32_t(u[r][k]) * xb[k];
                for (int k = 16; k < 32; ++k) dot_b += int32_t(u[r][k]) * xb[k];
                for (int k = 0; k < 16; ++k) fine_a += int32_t(u[r][k]) * fb[k];
                for (int k = 16; k < 32; ++k) fine_b += int32_t(u[r][k]) * fb[k];
                dot_a = (dot_a << kFine) + fine_a;
                dot_b = (dot_b << kFine) + fine_b;
                if (t == Q6_K) {
                    const int32_t isum = int32_t(int8_t(sc[r])) * (dot_a - c * sa) +
                                         int32_t(int8_t(sc[16 + r])) * (dot_b - c * sb);
                    acc[r] = acc[r] + (half_at(w.sup_at(tile, b), r) * dx) * float(isum);
                } else if (t == Q4_K) {
                    const uint8_t* sup = w.sup_at(tile, b);
                    const float scale = half_at(sup, r) * float(sc[r]), offset = half_at(sup, 16 + r) * float(sc[16 + r]);
                    acc[r] = acc[r] + (scale * dx) * float(dot_a + dot_b);
                    acc[r] = acc[r] - offset * ds;
                } else if (t == Q4_1) {
                    acc[r] = acc[r] + (half_at(sc, r) * dx) * float(dot_a + dot_b);
                    acc[r] = acc[r] + half_at(sc, 16 + r) * ds;
                } else {
                    acc[r] = acc[r] + (half_at(sc, r) * dx) * float(dot_a + dot_b - c * (sa + sb));
                }
            }
        }
        for (int r = 0; r < cols; ++r) out[m * ldo + r] = acc[r];
    }
}

}  // namespace tmk::qmm
