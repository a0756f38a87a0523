// Loading a tile of paged attention's keys from the cache (csrc/attention_tile.h does the math on it):
// the cache's view and types, the prefetch of the tile ahead, and one tile of K (transposed) or V as
// fp32, per ISA.
#pragma once

#include <cstdint>

#include "common.h"
#include "simd16.h"

namespace tmk::attn {

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

// A tile a work item will read a few tiles on (attention_items.h), prefetched into L2 while this
// one computes: blocks are scattered, so the hardware prefetcher cannot guess the next one. The
// decode path spreads the prefetches over its work, key j's rows with key j (CacheTile::scores).
// Issued all at once at the tile's start, their 64 (SmolLM2) to 256 (Gemma 3) lines outran the
// core's miss buffers and stalled the loads of the tile being computed: spread, the kernel's 64
// sequences x 1-4k decode ran 1.4-1.5x faster (bench/paged_attention.py, alternated, Zen 5).
struct TileAhead {
    const char* k = nullptr;
    const char* v = nullptr;
    const float* k_scale = nullptr;  // int8 only
    const float* v_scale = nullptr;
    int64_t row_bytes = 0;
    int keys = 0;  // rows to prefetch from k and v
    static void l2(const void* p) {
        // Volatile asm: gcc proves a function whose only effects are __builtin_prefetch pure, and
        // drops its calls.
#if defined(__x86_64__)
        asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
        __builtin_prefetch(p, 0, 2);
#endif
    }
    // Key j's K and V rows (and, with key 0, the tile's int8 scales). ROW_BYTES: row_bytes when
    // known at compile time (0: not).
    template <int ROW_BYTES = 0>
    void key(int j) const {
        if (j >= keys) return;
        const int64_t n = ROW_BYTES > 0 ? ROW_BYTES : row_bytes, off = j * n;
        for (int64_t b = 0; b < n; b += 64) {
            l2(k + off + b);
            l2(v + off + b);
        }
        if (j == 0 && k_scale != nullptr) {
            l2(k_scale);
            l2(v_scale);
        }
    }
    void all() const {
        for (int j = 0; j < keys; ++j) key(j);
    }
};

inline constexpr TileAhead NO_TILE_AHEAD{};  // keys = 0: prefetches nothing

template <int TYPE>
inline float load_one(const CacheView& c, int64_t row, int d) {  // row = head * num_slots + slot
    if constexpr (TYPE == CACHE_F32) return static_cast<const float*>(c.data)[row * c.D + d];
    else if constexpr (TYPE == CACHE_BF16) return bf16_to_f32(static_cast<const uint16_t*>(c.data)[row * c.D + d]);
    else if constexpr (TYPE == CACHE_F16) return f16_to_f32(static_cast<const uint16_t*>(c.data)[row * c.D + d]);
    else return float(static_cast<const int8_t*>(c.data)[row * c.D + d]) * c.scale[row];
}

#if defined(TM_AVX512)
// DIM: the head dim when known at compile time (0: c.D).
template <int TYPE, int DIM = 0>
inline __m512 load_row16(const CacheView& c, int64_t row, int d) {
    const int64_t D = DIM > 0 ? DIM : c.D;
    if constexpr (TYPE == CACHE_F32) return _mm512_loadu_ps(static_cast<const float*>(c.data) + row * D + d);
    else if constexpr (TYPE == CACHE_BF16) return load_bf16x16(static_cast<const uint16_t*>(c.data) + row * D + d);
    else if constexpr (TYPE == CACHE_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(c.data) + row * D + d)));
    else {
        __m128i b = _mm_loadu_si128((const __m128i*)(static_cast<const int8_t*>(c.data) + row * D + d));
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
template <int TYPE, int DIM = 0>
inline __m256 load_row8(const CacheView& c, int64_t row, int d) {
    const int64_t D = DIM > 0 ? DIM : c.D;
    if constexpr (TYPE == CACHE_F32) return _mm256_loadu_ps(static_cast<const float*>(c.data) + row * D + d);
    else if constexpr (TYPE == CACHE_BF16) return load_bf16x8(static_cast<const uint16_t*>(c.data) + row * D + d);
    else if constexpr (TYPE == CACHE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(c.data) + row * D + d)));
    else {
        __m128i b = _mm_loadl_epi64((const __m128i*)(static_cast<const int8_t*>(c.data) + row * D + d));
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

}  // namespace tmk::attn
