// What the sampling kernels share (argmax.cpp, categorical.cpp, nucleus.cpp): a row's largest value,
// and its weights exp(v - max) for v = x / temperature, written out with their float64 sums per block
// of 64.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common.h"
#include "simd16.h"

namespace tmk::sampling {

constexpr int64_t kBlock = 64;  // weights per float64 block sum

// Below this, exp(d) is under float's smallest normal: such a token's weight is 0 (simd16's vexp; the
// torch reference keeps a denormal of at most 1e-38, against the top token's weight of 1).
constexpr float kExpFloor = -87.3f;

// Largest value of x[0, n), and whether any NaN occurs (argmax.cpp, and the draws' row_max).
inline float segment_max(const float* x, int64_t n, bool* has_nan) {
    float m = -std::numeric_limits<float>::infinity();
    int64_t i = 0;
    bool nan = false;
#if defined(TM_AVX512)
    __m512 vm = _mm512_set1_ps(m);
    __mmask16 vnan = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(vm, v);
    }
    nan = vnan != 0;
    m = _mm512_reduce_max_ps(vm);
#elif defined(TM_AVX2)
    __m256 vm = _mm256_set1_ps(m), vnan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(vm, v);
    }
    nan = _mm256_movemask_ps(vnan) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vm);
    for (float l : lanes) m = l > m ? l : m;
#endif
    for (; i < n; ++i) {
        nan |= std::isnan(x[i]);
        m = x[i] > m ? x[i] : m;
    }
    *has_nan = nan;
    return m;
}

// Largest value of x[0, n), or NaN if the row holds one.
inline float row_max(const float* x, int64_t n) {
    bool nan = false;
    const float m = segment_max(x, n, &nan);
    return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// The weight of one logit: 0 when dropped (below the min_p threshold, or -inf), else exp(v - m).
inline float weight(float x, float t, float m, float thresh) {
    const float v = x / t, d = v - m;
    if (!(v >= thresh) || d < kExpFloor) return 0.0f;  // -inf too: d is -inf
    return std::exp(d);
}

// Pass 2 over one block of 64 (n = 64) or the row's tail (n < 64): weights into w, their float64 sum.
inline double block_weights(const float* x, int64_t n, float t, float m, float thresh, float* w) {
    int64_t i = 0;
    double sum = 0.0;
#if defined(TM_AVX512)
    if (n == kBlock) {
        const __m512 vt = _mm512_set1_ps(t), vm = _mm512_set1_ps(m), vth = _mm512_set1_ps(thresh);
        __m512d acc = _mm512_setzero_pd();
        for (; i < kBlock; i += 16) {
            const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), vt);
            const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, vth, _CMP_GE_OQ),
                                                 simd16::vexp({_mm512_sub_ps(v, vm)}).v);
            _mm512_storeu_ps(w + i, e);
            acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
        }
        return _mm512_reduce_add_pd(acc);
    }
#elif defined(TM_AVX2)
    if (n == kBlock) {
        const __m256 vt = _mm256_set1_ps(t), vm = _mm256_set1_ps(m), vth = _mm256_set1_ps(thresh);
        __m256d acc = _mm256_setzero_pd();
        for (; i < kBlock; i += 8) {
            const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), vt);
            const __m256 e = _mm256_and_ps(_mm256_cmp_ps(v, vth, _CMP_GE_OQ), simd16::exp8(_mm256_sub_ps(v, vm)));
            _mm256_storeu_ps(w + i, e);
            acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        alignas(32) double lanes[4];
        _mm256_store_pd(lanes, acc);
        return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    }
#endif
    for (; i < n; ++i) {
        w[i] = weight(x[i], t, m, thresh);
        sum += double(w[i]);
    }
    return sum;
}

}  // namespace tmk::sampling
