// Shared by every kernel family: bf16/fp16 conversions, the thread pool's loops, and the ISA this
// translation unit was compiled for. Each .cpp is compiled once per variant (setup.py); code picks
// its path with the compiler's own macros (__AVX512VNNI__, __AVX2__), so the scalar build is the
// portable reference and the others only ever run on CPUs that kernels/native.py checked.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "thread_pool.h"  // num_threads, parallel_for, run

namespace tmk {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define TM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TM_AVX2 1
#endif
// The avx512 variant carries AMX-INT8 code when the compiler takes its flags (setup.py); it runs only
// where cpu.cpp's amx_enabled() says the CPU has it and Linux granted the tile state.
#if defined(TM_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TM_AMX 1
#endif

// A growable scratch buffer whose data starts on a 64-byte line, so loads of 64-byte rows (tile rows,
// zmm vectors) never straddle two lines. Growing does not keep the contents.
template <typename T>
class LineBuffer {
public:
    T* get(size_t n) {  // room for n values
        if (bytes_.size() < n * sizeof(T) + 64) bytes_.resize(n * sizeof(T) + 64);
        return data();
    }
    T* data() { return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(bytes_.data()) + 63) & ~uintptr_t(63)); }

private:
    std::vector<uint8_t> bytes_;
};

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, as PyTorch's .to(torch.bfloat16) does (NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

// Round to nearest even, as PyTorch's .to(torch.float16) does: overflow to inf, subnormals kept,
// NaN as the quiet NaN 0x7e00 (with its sign).
inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u);
    if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds past 65504
    if (ax < 0x38800000u) {                                  // below 2^-14: a subnormal half, or zero
        if (ax < 0x33000000u) return uint16_t(sign);         // below 2^-25
        const int shift = 126 - int(ax >> 23);               // 14..24
        const uint32_t m = (ax & 0x7fffffu) | 0x800000u, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        uint32_t h = m >> shift;
        if (rem > half || (rem == half && (h & 1u))) ++h;
        return uint16_t(sign | h);
    }
    uint32_t h = (ax - 0x38000000u) >> 13;  // rebias the exponent, keep 10 mantissa bits
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent, as it should
    return uint16_t(sign | h);
}

inline float f16_to_f32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do { ++e; man <<= 1; } while (!(man & 0x400u));
            u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | man << 13;
    } else {
        u = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

#if defined(TM_AVX512)
// 16 bf16 -> 16 fp32 (a shift: no AVX512_BF16 needed).
inline __m512 load_bf16x16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#endif
#if defined(TM_AVX512) || defined(TM_AVX2)
inline __m256 load_bf16x8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

// A raw buffer address handed over from Python (tensor.data_ptr()).
template <typename T>
inline T* ptr(uintptr_t address) { return reinterpret_cast<T*>(address); }

}  // namespace tmk
