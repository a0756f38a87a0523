// A draw among each row's top_k candidates: the sampler's path for rows with top_k (Ollama's defaults:
// temperature 0.8, top_k 40, top_p 0.9). topk.cpp has already picked the k largest logits, sorted
// descending; here they are scaled by the temperature, cut to the shortest prefix whose probability
// (renormalised over the k) reaches top_p, cut again below max + log(min_p), and drawn from by inverse
// CDF with float64 sums. kernels/categorical.py holds the PyTorch reference, which is the torch path
// the sampler took before (engine/truncation.py): ~30 small torch operations on 40 values, most of a
// sampler that took ~13% of a single-stream SmolLM2 step (2 threads) with Ollama's defaults.
//
// The reference adds its probabilities in float32 (exp(v - logsumexp) and a cumsum), the kernel the
// weights exp(v - max) in float64: where a prefix's mass lies within rounding of top_p the two may end
// the nucleus one token apart, and a draw whose u * total lies within rounding of a boundary between
// two tokens may differ (kernels/categorical.py says so, as for nucleus.cpp).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace py = pybind11;

namespace tmk {
namespace {

// One row's draw among values[0, k) (sorted descending, raw logits) and their ids, or -1 when the
// kernel leaves the row to the reference (a NaN, or no candidate with any weight).
int64_t top_k_row(const float* values, const int64_t* ids, int64_t k, float t, float top_p, float log_min_p,
                  double u, std::vector<double>& w) {
    if (k <= 0) return -1;
    for (int64_t j = 0; j < k; ++j)
        if (std::isnan(values[j])) return -1;
    // Dividing by a positive temperature keeps the order, so the first value stays the largest.
    const float m = values[0] / t;
    if (std::isnan(m) || std::isinf(m)) return -1;
    w.resize(size_t(k));
    double total = 0.0;
    for (int64_t j = 0; j < k; ++j) {
        // The reference's weight: exp in float32 of the scaled difference, widened afterwards.
        w[size_t(j)] = double(std::exp(values[j] / t - m));
        total += w[size_t(j)];
    }
    // top_p: keep candidates while the mass before them is under top_p of the total; the first is
    // always kept, even at top_p = 0.
    int64_t keep = k;
    if (top_p < 1.0f) {
        const double want = double(top_p) * total;
        double before = 0.0;
        for (int64_t j = 0; j < k; ++j) {
            if (j > 0 && before >= want && before > 0.0) {
                keep = j;
                break;
            }
            before += w[size_t(j)];
        }
    }
    // min_p: below max + log(min_p) a candidate has no weight (sorted: the rest neither).
    const float thresh = m + log_min_p;
    for (int64_t j = 1; j < keep; ++j)
        if (values[j] / t < thresh) {
            keep = j;
            break;
        }
    double kept = 0.0;
    for (int64_t j = 0; j < keep; ++j) kept += w[size_t(j)];
    if (!(kept > 0.0)) return -1;
    const double target = u * kept;
    double running = 0.0;
    int64_t last = -1;
    for (int64_t j = 0; j < keep; ++j) {
        if (w[size_t(j)] <= 0.0) continue;  // -inf candidates (fewer than k tokens left) are never drawn
        running += w[size_t(j)];
        last = j;
        if (running > target) return ids[j];
    }
    return ids[last];  // the target within rounding of the end
}

int64_t top_k_draw_rows(uintptr_t values, uintptr_t ids, int64_t rows, int64_t cols, uintptr_t k, uintptr_t temperature,
                     uintptr_t top_p, uintptr_t log_min_p, uintptr_t uniforms, uintptr_t out) {
    if (rows <= 0 || cols <= 0) return 0;
    const float* v = ptr<const float>(values);
    const int64_t *id = ptr<const int64_t>(ids), *ks = ptr<const int64_t>(k);
    const float *t = ptr<const float>(temperature), *p = ptr<const float>(top_p), *lm = ptr<const float>(log_min_p);
    const float* u = ptr<const float>(uniforms);
    int64_t* index = ptr<int64_t>(out);
    // A row is a few hundred operations: only batches of many rows are worth the pool.
    parallel_for(rows, 64, [&](int64_t begin, int64_t end) {
        thread_local std::vector<double> w;
        for (int64_t r = begin; r < end; ++r)
            index[r] = top_k_row(v + r * cols, id + r * cols, std::min(ks[r], cols), t[r], p[r], lm[r], double(u[r]), w);
    });
    int64_t left = 0;
    for (int64_t r = 0; r < rows; ++r) left += index[r] < 0;
    return left;
}

}  // namespace
}  // namespace tmk

void register_topk_draw(py::module_& m) {
    m.def("top_k_draw_rows_f32", &tmk::top_k_draw_rows, py::call_guard<py::gil_scoped_release>(),
          "out[r] = ids[r, j] for a draw j among values[r, :k[r]] (sorted descending) / temperature[r], cut to "
          "the top_p nucleus and by min_p, by inverse CDF at uniforms[r] (-1: left to the reference); "
          "returns how many rows it left. Raw addresses of contiguous float32 values, int64 ids and k, float32 "
          "per-row arguments",
          py::arg("values"), py::arg("ids"), py::arg("rows"), py::arg("cols"), py::arg("k"), py::arg("temperature"),
          py::arg("top_p"), py::arg("log_min_p"), py::arg("uniforms"), py::arg("out"));
}
