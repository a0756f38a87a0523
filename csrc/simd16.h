// A vector of 16 floats with one implementation per ISA (AVX-512: one zmm; AVX2: two ymm; scalar:
// an array), for kernels written once over 16 lanes. Every op is lane-wise except the two
// reductions, which use a fixed order, so a lane's value never depends on its neighbours.
#pragma once

#include <cmath>

#include "common.h"

namespace tmk::simd16 {

#if defined(TM_AVX512)
struct V16 { __m512 v; };
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vset1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vdiv(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float vmax_all(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline float vsum_all(V16 a) { return _mm512_reduce_add_ps(a.v); }
// Lanes first..last keep a, the rest become b.
inline V16 vselect(int first, int last, V16 a, V16 b) {
    __mmask16 m = __mmask16(((1u << (last + 1)) - 1u) & ~((1u << first) - 1u));
    return {_mm512_mask_blend_ps(m, b.v, a.v)};
}
inline V16 vexp(V16 x) {  // Cephes-style expf, ~1 ulp; x < -87.3 gives 0 (and -inf gives 0)
    __m512 small = _mm512_set1_ps(-87.3f);
    __mmask16 zero = _mm512_cmp_ps_mask(x.v, small, _CMP_LT_OQ) | _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q);
    __m512 c = _mm512_min_ps(_mm512_max_ps(x.v, small), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return {_mm512_maskz_mov_ps(__mmask16(~zero), _mm512_mul_ps(p, _mm512_castsi512_ps(e)))};
}
#elif defined(TM_AVX2)
struct V16 { __m256 lo, hi; };
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline V16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vdiv(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float hreduce8(__m256 v, bool is_max) {
    __m128 a = _mm256_castps256_ps128(v), b = _mm256_extractf128_ps(v, 1);
    __m128 s = is_max ? _mm_max_ps(a, b) : _mm_add_ps(a, b);
    __m128 t = _mm_movehl_ps(s, s);
    s = is_max ? _mm_max_ps(s, t) : _mm_add_ps(s, t);
    t = _mm_shuffle_ps(s, s, 1);
    s = is_max ? _mm_max_ss(s, t) : _mm_add_ss(s, t);
    return _mm_cvtss_f32(s);
}
inline float vmax_all(V16 a) { return hreduce8(_mm256_max_ps(a.lo, a.hi), true); }
inline float vsum_all(V16 a) { return hreduce8(_mm256_add_ps(a.lo, a.hi), false); }
inline V16 vselect(int first, int last, V16 a, V16 b) {
    __m256i lane_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), lane_hi = _mm256_add_epi32(lane_lo, _mm256_set1_epi32(8));
    __m256i f = _mm256_set1_epi32(first - 1), l = _mm256_set1_epi32(last + 1);
    __m256 m_lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lane_lo, f), _mm256_cmpgt_epi32(l, lane_lo)));
    __m256 m_hi = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lane_hi, f), _mm256_cmpgt_epi32(l, lane_hi)));
    return {_mm256_blendv_ps(b.lo, a.lo, m_lo), _mm256_blendv_ps(b.hi, a.hi, m_hi)};
}
inline __m256 exp8(__m256 x) {  // the AVX-512 vexp, 8 lanes wide
    __m256 small = _mm256_set1_ps(-87.3f);
    __m256 zero = _mm256_or_ps(_mm256_cmp_ps(x, small, _CMP_LT_OQ), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    __m256 c = _mm256_min_ps(_mm256_max_ps(x, small), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), c);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
inline V16 vexp(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }
#else
struct V16 { float x[16]; };
inline V16 vload(const float* p) { V16 r; for (int i = 0; i < 16; ++i) r.x[i] = p[i]; return r; }
inline void vstore(float* p, V16 a) { for (int i = 0; i < 16; ++i) p[i] = a.x[i]; }
inline V16 vset1(float s) { V16 r; for (int i = 0; i < 16; ++i) r.x[i] = s; return r; }
inline V16 vzero() { return vset1(0.0f); }
inline V16 vadd(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.x[i] += b.x[i]; return a; }
inline V16 vmul(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.x[i] *= b.x[i]; return a; }
inline V16 vdiv(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.x[i] /= b.x[i]; return a; }
// Not fused (-ffp-contract=off): two roundings, the same wherever the scalar build runs.
inline V16 vfma(V16 a, V16 b, V16 c) { for (int i = 0; i < 16; ++i) c.x[i] += a.x[i] * b.x[i]; return c; }
inline float vmax_all(V16 a) { float m = a.x[0]; for (int i = 1; i < 16; ++i) m = a.x[i] > m ? a.x[i] : m; return m; }
inline float vsum_all(V16 a) { float s = a.x[0]; for (int i = 1; i < 16; ++i) s += a.x[i]; return s; }
inline V16 vselect(int first, int last, V16 a, V16 b) {
    for (int i = 0; i < 16; ++i) if (i < first || i > last) a.x[i] = b.x[i];
    return a;
}
inline V16 vexp(V16 a) { for (int i = 0; i < 16; ++i) a.x[i] = std::exp(a.x[i]); return a; }
#endif

// cap * tanh(s / cap), lane-wise (Gemma 2's score and logit soft-capping), as cap * (1 - 2 / (e^(2s/cap) + 1)):
// within a few ulp of cap for |s| >> cap and an absolute error of about cap * 2^-24 near 0, where a
// softmax does not care; exp's clamping keeps both ends finite (+-cap).
inline V16 vsoftcap(V16 s, float cap) {
    const V16 e = vexp(vmul(s, vset1(2.0f / cap)));
    return vmul(vset1(cap), vadd(vset1(1.0f), vdiv(vset1(-2.0f), vadd(e, vset1(1.0f)))));
}

}  // namespace tmk::simd16
