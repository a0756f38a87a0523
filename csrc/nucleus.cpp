// A draw from each row's top_p nucleus of softmax(logits / temperature), then min_p: the sampler's
// path for rows with top_p and no top_k (vLLM's and many clients' settings). kernels/categorical.py
// holds the PyTorch reference: sort the row, keep the shortest prefix whose probability reaches top_p,
// drop what min_p drops, draw by inverse CDF. In torch (a partial top-k of 1024, then 8192, then a
// sort) that added 19-22 ms to a 51 ms SmolLM2 64-sequence decode step at top_p 0.95.
//
// Here no row is sorted whole. The weights w = exp(v - max) are written once (sampling_math.h), then a
// bisection on a weight threshold finds one whose tokens hold at least top_p of the mass; only those
// candidates are sorted (value descending, index ascending: the reference's stable order), and the
// nucleus, min_p and the draw are taken over them exactly as the reference does, with float64 sums.
// The reference adds its probabilities in float32, so where a prefix's sum lies within rounding of
// top_p the two may end the nucleus one token apart (kernels/categorical.py says so).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "common.h"
#include "sampling_math.h"

namespace py = pybind11;

namespace tmk {
namespace {

using sampling::block_weights;
using sampling::kBlock;
using sampling::kExpFloor;
using sampling::row_max;

constexpr int kBisections = 10;  // the threshold to 87 / 1024 of a nat: few candidates past the nucleus
// A float sum of up to a few hundred thousand weights is off by far less than this (relative), so a
// threshold the bisection accepts keeps at least top_p of the mass in float64 too.
constexpr float kMassMargin = 1e-3f;

struct Scratch {
    std::vector<float> w;
    std::vector<std::pair<float, int32_t>> candidates;  // (v, index)
};

// The weight of the tokens with w >= theta, summed in float: only the bisection reads it, and it
// keeps a margin for float's error (kMassMargin).
float mass_from(const float* w, int64_t n, float theta) {
    int64_t i = 0;
    float mass = 0.0f;
#if defined(TM_AVX512)
    const __m512 th = _mm512_set1_ps(theta);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(w + i);
        acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(v, th, _CMP_GE_OQ), acc, v);
    }
    mass = _mm512_reduce_add_ps(acc);
#elif defined(TM_AVX2)
    const __m256 th = _mm256_set1_ps(theta);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(w + i);
        acc = _mm256_add_ps(acc, _mm256_and_ps(_mm256_cmp_ps(v, th, _CMP_GE_OQ), v));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    for (float l : lanes) mass += l;
#endif
    for (; i < n; ++i)
        if (w[i] >= theta) mass += w[i];
    return mass;
}

// The indices i with w[i] >= theta, in order, appended as (x[i] / t, i).
void gather(const float* x, const float* w, int64_t n, float theta, float t,
            std::vector<std::pair<float, int32_t>>& out) {
    int64_t i = 0;
#if defined(TM_AVX512)
    const __m512 th = _mm512_set1_ps(theta);
    for (; i + 16 <= n; i += 16)
        for (unsigned hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(w + i), th, _CMP_GE_OQ); hit; hit &= hit - 1) {
            const int64_t j = i + __builtin_ctz(hit);
            out.emplace_back(x[j] / t, int32_t(j));
        }
#elif defined(TM_AVX2)
    const __m256 th = _mm256_set1_ps(theta);
    for (; i + 8 <= n; i += 8)
        for (unsigned hit = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + i), th, _CMP_GE_OQ))); hit;
             hit &= hit - 1) {
            const int64_t j = i + __builtin_ctz(hit);
            out.emplace_back(x[j] / t, int32_t(j));
        }
#endif
    for (; i < n; ++i)
        if (w[i] >= theta) out.emplace_back(x[i] / t, int32_t(i));
}

// One row's draw, or -1 when the kernel leaves the row to the reference (a NaN, all -inf).
int64_t nucleus_row(const float* x, int64_t n, float t, float top_p, float log_min_p, double u, Scratch& s) {
    const float xmax = row_max(x, n);
    if (std::isnan(xmax) || xmax == -std::numeric_limits<float>::infinity()) return -1;
    const float m = xmax / t;
    if (std::isnan(m) || std::isinf(m)) return -1;
    s.w.resize(size_t(n));
    float* w = s.w.data();
    double total = 0.0;
    for (int64_t b0 = 0; b0 < n; b0 += kBlock)
        total += block_weights(x + b0, std::min(kBlock, n - b0), t, m, -std::numeric_limits<float>::infinity(), w + b0);
    const double want = double(top_p) * total;

    // Bisect on log w: `lo` always keeps at least `want` of the mass (every weight is >= exp(kExpFloor)
    // or 0, so at the start it keeps all of it).
    const float enough = float(want) * (1.0f + kMassMargin);
    float lo = kExpFloor, hi = 0.0f;
    for (int k = 0; k < kBisections; ++k) {
        const float mid = 0.5f * (lo + hi);
        if (mass_from(w, n, std::exp(mid)) >= enough) lo = mid;
        else hi = mid;
    }
    s.candidates.clear();
    gather(x, w, n, std::exp(lo), t, s.candidates);
    std::sort(s.candidates.begin(), s.candidates.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
    });

    // The nucleus: up to the first candidate whose running mass reaches top_p (all of them if
    // rounding leaves the sum just short). Then min_p's threshold, below the top value.
    const float thresh = m + log_min_p;
    size_t keep = 0;
    double mass = 0.0;
    while (keep < s.candidates.size()) {
        const auto [v, i] = s.candidates[keep];
        if (keep > 0 && v < thresh) break;  // sorted: the rest are below it too
        mass += double(w[i]);
        ++keep;
        if (mass >= want) break;
    }
    double kept = 0.0;
    for (size_t j = 0; j < keep; ++j) kept += double(w[s.candidates[j].second]);
    const double target = u * kept;
    double running = 0.0;
    for (size_t j = 0; j < keep; ++j) {
        running += double(w[s.candidates[j].second]);
        if (running > target) return s.candidates[j].second;
    }
    return s.candidates[keep - 1].second;  // the target within rounding of the end
}

void nucleus_rows(uintptr_t logits, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t temperature,
                  uintptr_t top_p, uintptr_t log_min_p, uintptr_t uniforms, uintptr_t out) {
    if (rows <= 0 || cols <= 0) return;
    const float* x = ptr<const float>(logits);
    const float *t = ptr<const float>(temperature), *p = ptr<const float>(top_p), *lm = ptr<const float>(log_min_p);
    const float* u = ptr<const float>(uniforms);
    int64_t* index = ptr<int64_t>(out);
    parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
        thread_local Scratch s;  // kept between calls, as categorical.cpp's weights
        for (int64_t r = begin; r < end; ++r)
            index[r] = nucleus_row(x + r * row_stride, cols, t[r], p[r], lm[r], double(u[r]), s);
    });
}

}  // namespace
}  // namespace tmk

void register_nucleus(py::module_& m) {
    m.def("nucleus_rows_f32", &tmk::nucleus_rows, py::call_guard<py::gil_scoped_release>(),
          "out[r] = a draw from the top_p nucleus of softmax(logits[r] / temperature[r]), then min_p, by inverse "
          "CDF at uniforms[r] (-1: left to the reference; raw addresses)",
          py::arg("logits"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("temperature"),
          py::arg("top_p"), py::arg("log_min_p"), py::arg("uniforms"), py::arg("out"));
}
