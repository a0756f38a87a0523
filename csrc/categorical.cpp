// A draw from each row's softmax(logits / temperature), with min_p: the sampler's path for rows with
// no top_k, top_p or typical_p (OpenAI's defaults, temperature alone). kernels/categorical.py holds
// the PyTorch reference: scale, drop below max + log(min_p), w = exp(v - max), float64 running sums,
// the first index whose sum passes u * total. In torch that is five passes over [rows, vocab] and a
// float64 copy: 18-19 ms on top of a 51 ms SmolLM2 64-sequence decode step at temperature 1
// (bench/sampling.py, 2 threads).
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
#include "sampling_math.h"

namespace py = pybind11;

namespace tmk {
namespace {

using sampling::block_weights;
using sampling::kBlock;
using sampling::row_max;

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
        // Kept by the thread between calls: a vocabulary's weights are 196 KB (SmolLM2) to 1 MB (Gemma 3),
        // which malloc would map and fault in afresh every step.
        thread_local std::vector<float> w;
        thread_local std::vector<double> sums;
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
