// A draw from each row's softmax(logits / temperature), with min_p: the sampler's path for rows with
// no top_k, top_p or typical_p (OpenAI's defaults, temperature alone). kernels/categorical.py holds
// the PyTorch reference: scale, drop below max + log(min_p), w = exp(v - max), float64 running sums,
// the first index whose sum passes u * total. In torch that is five passes over [rows, vocab] and a
// float64 copy: 25 ms of SmolLM2's 64-sequence decode step at temperature 1, half the step.
//
// Here a row is read twice. Pass 1 takes max(x) (division by a positive temperature keeps the
// order, so max(x / T) is max(x) / T exactly). Pass 2 writes the weights into the thread's scratch
// and sums them in float64 per block of 64, in a fixed order; the blocks' sums then give the total in
// sequence. The draw walks the block sums to the block that passes u * total, then that block's
// weights one by one. The weights are the reference's up to the last bit or two of exp (an
// approximation of ~1 ulp, kernels/categorical.py says so), so a draw can differ from the reference
// only when u * total falls within rounding of a boundary between two tokens.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

namespace py = pybind11;

namespace tmk {
namespace {

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

// The weight of one logit: 0 when dropped (below the min_p threshold, or -inf), else exp(v - m).
inline float weight(float x, float t, float m, float thresh) {
    const float v = x / t, d = v - m;
    if (!(v >= thresh) || v == -std::numeric_limits<float>::infinity() || d < kExpFloor) return 0.0f;
    return std::exp(d);
}

// Pass 2 over one block of 64 (n = 64) or the row's tail (n < 64): weights into w, their float64 sum.
double block_weights(const float* x, int64_t n, float t, float m, float thresh, float* w) {
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

// Largest value of x[0, n), or NaN if the row holds one.
float row_max(const float* x, int64_t n) {
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

// One row's draw, or -1 when the row has no token to draw from (a NaN, or every logit -inf): the
// Python side then takes the reference for it.
int64_t draw_row(const float* x, int64_t n, float t, float log_min_p, double u, std::vector<float>& w,
                 std::vector<double>& sums) {
    const float xmax = row_max(x, n);
    if (std::isnan(xmax) || xmax == -std::numeric_limits<float>::infinity()) return -1;
    const float m = xmax / t, thresh = m + log_min_p;
    if (std::isnan(m) || std::isinf(m)) return -1;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    w.resize(size_t(n));
    sums.resize(size_t(blocks));
    double total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t b0 = b * kBlock;
        sums[size_t(b)] = block_weights(x + b0, std::min(kBlock, n - b0), t, m, thresh, w.data() + b0);
        total += sums[size_t(b)];
    }
    const double target = u * total;
    double running = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
        const double next = running + sums[size_t(b)];
        if (!(next > target)) {
            running = next;
            continue;
        }
        // The block passes the target, so it holds a positive weight. Its weights summed one by one
        // may round below the block's sum: then the target lies within rounding of the block's end,
        // and its last token with a weight is the draw.
        const int64_t b0 = b * kBlock, b1 = std::min(n, b0 + kBlock);
        int64_t last = -1;
        for (int64_t i = b0; i < b1; ++i) {
            if (w[size_t(i)] <= 0.0f) continue;
            running += double(w[size_t(i)]);
            last = i;
            if (running > target) return i;
        }
        return last;
    }
    return -1;  // not reached: the blocks' running sum ends at total > target
}

void categorical_rows(uintptr_t logits, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t temperature,
                      uintptr_t log_min_p, uintptr_t uniforms, uintptr_t out) {
    if (rows <= 0 || cols <= 0) return;
    const float* x = ptr<const float>(logits);
    const float* t = ptr<const float>(temperature);
    const float* lm = ptr<const float>(log_min_p);
    const float* u = ptr<const float>(uniforms);
    int64_t* index = ptr<int64_t>(out);
    parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> w;
        std::vector<double> sums;
        for (int64_t r = begin; r < end; ++r)
            index[r] = draw_row(x + r * row_stride, cols, t[r], lm[r], double(u[r]), w, sums);
    });
}

}  // namespace
}  // namespace tmk

void register_categorical(py::module_& m) {
    m.def("categorical_rows_f32", &tmk::categorical_rows, py::call_guard<py::gil_scoped_release>(),
          "out[r] = a draw from softmax(logits[r] / temperature[r]) with min_p, by inverse CDF at uniforms[r] "
          "(-1: no token to draw; raw addresses)",
          py::arg("logits"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("temperature"),
          py::arg("log_min_p"), py::arg("uniforms"), py::arg("out"));
}
