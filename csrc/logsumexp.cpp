// Each row's log-sum-exp, for the logprobs a request asks for (kernels/logprobs.py): a token's logprob
// is its logit minus the row's log-sum-exp. Two reads of the row: its max (sampling_math.h), then
// exp(x - max) summed in float64 per block of 64, as the draw kernels weigh a row.
#include <pybind11/pybind11.h>

#include <cmath>
#include <limits>

#include "common.h"
#include "sampling_math.h"

namespace py = pybind11;

namespace tmk {
namespace {

float row_logsumexp(const float* x, int64_t n) {
    const float m = sampling::row_max(x, n);
    if (std::isnan(m) || std::isinf(m)) return m;  // NaN row; all -inf (no mass); a +inf logit
    alignas(64) float w[sampling::kBlock];
    double sum = 0.0;
    for (int64_t i = 0; i < n; i += sampling::kBlock) {
        const int64_t len = n - i < sampling::kBlock ? n - i : sampling::kBlock;
        sum += sampling::block_weights(x + i, len, 1.0f, m, -std::numeric_limits<float>::infinity(), w);
    }
    return float(double(m) + std::log(sum));
}

void logsumexp_rows(uintptr_t logits, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t out) {
    const float* x = ptr<const float>(logits);
    float* y = ptr<float>(out);
    parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) y[r] = row_logsumexp(x + r * row_stride, cols);
    });
}

}  // namespace
}  // namespace tmk

void register_logsumexp(py::module_& m) {
    m.def("logsumexp_rows_f32", &tmk::logsumexp_rows, py::call_guard<py::gil_scoped_release>(),
          "out[r] = log(sum(exp(row r of logits))) in float32 (raw addresses)", py::arg("logits"), py::arg("rows"),
          py::arg("cols"), py::arg("row_stride"), py::arg("out"));
}
