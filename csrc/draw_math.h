// What the sampling draws share (categorical.cpp, nucleus.cpp): a row's largest value, and its
// weights exp(v - max) for v = x / temperature, written out with their float64 sums per block of 64.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common.h"

namespace tmk::draw {

constexpr int64_t kBlock = 64;  // weights per float64 block sum

// Below this, exp(d) is under float's smallest normal: such a token's weight is taken as 0 (the
// reference keeps a denormal of at most 1e-38, against the top token's weight of 1).
constexpr float kExpFloor = -87.0f;

#if defined(TM_AVX512)
// exp(d) for kExpFloor <= d <= 0: Cody-Waite reduction d = n ln2 + r, then Cephes expf's polynomial
// (~1 ulp).
inline __m512 exp_ps(__m512 d) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), d);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#elif defined(TM_AVX2)
inline __m256 exp_ps(__m256 d) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(d, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), d);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^n from its exponent bits: n >= -126 for d >= kExpFloor, so the result is a normal float.
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// Largest value of x[0, n), or NaN if the row holds one.
inline float row_max(const float* x, int64_t n) {
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
    int64_t i = 0;
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
    return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// The weight of one logit: 0 when dropped (below the min_p threshold, or -inf), else exp(v - m).
inline float weight(float x, float t, float m, float thresh) {
    const float v = x / t, d = v - m;
    if (!(v >= thresh) || v == -std::numeric_limits<float>::infinity() || d < kExpFloor) return 0.0f;
    return std::exp(d);
}

// Pass 2 over one block of 64 (n = 64) or the row's tail (n < 64): weights into w, their float64 sum.
inline double block_weights(const float* x, int64_t n, float t, float m, float thresh, float* w) {
    int64_t i = 0;
    double sum = 0.0;
#if defined(TM_AVX512)
    if (n == kBlock) {
        const __m512 vt = _mm512_set1_ps(t), vm = _mm512_set1_ps(m), vth = _mm512_set1_ps(thresh);
        const __m512 floor = _mm512_set1_ps(kExpFloor), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        __m512d acc = _mm512_setzero_pd();
        for (; i < kBlock; i += 16) {
            const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), vt);
            const __m512 d = _mm512_sub_ps(v, vm);
            const __mmask16 keep = _mm512_cmp_ps_mask(v, vth, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ) &
                                   _mm512_cmp_ps_mask(d, floor, _CMP_GE_OQ);
            const __m512 e = _mm512_maskz_mov_ps(keep, exp_ps(_mm512_max_ps(d, floor)));
            _mm512_storeu_ps(w + i, e);
            acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
        }
        return _mm512_reduce_add_pd(acc);
    }
#elif defined(TM_AVX2)
    if (n == kBlock) {
        const __m256 vt = _mm256_set1_ps(t), vm = _mm256_set1_ps(m), vth = _mm256_set1_ps(thresh);
        const __m256 floor = _mm256_set1_ps(kExpFloor), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        __m256d acc = _mm256_setzero_pd();
        for (; i < kBlock; i += 8) {
            const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), vt);
            const __m256 d = _mm256_sub_ps(v, vm);
            const __m256 keep = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(v, vth, _CMP_GE_OQ), _mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ)),
                                              _mm256_cmp_ps(d, floor, _CMP_GE_OQ));
            const __m256 e = _mm256_and_ps(keep, exp_ps(_mm256_max_ps(d, floor)));
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

}  // namespace tmk::draw
