// Grammar token masks applied to rows of a logits matrix: bit t of a row's little-endian 32-bit
// words clear means token t is not allowed, and its logit becomes -inf. Tokens past the mask's words
// (padding ids of a wider logits row) are never allowed. The sampler's PyTorch reference is
// kernels/token_mask.py's apply_token_bitmask_reference; this gives the same floats (it only writes
// -inf or leaves a value as it is).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>

#include "common.h"

namespace py = pybind11;

namespace tmk {
namespace {

void apply_token_bitmask(uintptr_t logits, int64_t row_stride, int64_t vocab, uintptr_t rows, int64_t num_rows,
                         uintptr_t bits, int64_t words) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t* row_index = ptr<const int64_t>(rows);
    const uint32_t* masks = ptr<const uint32_t>(bits);
    // A row is 49k-262k floats: one or a few rows are already worth both threads' write bandwidth,
    // but the split stays per row so no two threads touch one row.
    parallel_for(num_rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            float* row = ptr<float>(logits) + row_index[r] * row_stride;
            const uint32_t* mask = masks + r * words;
            for (int64_t base = 0; base < vocab; base += 32) {
                const int64_t w = base / 32;
                const uint32_t word = w < words ? mask[w] : 0u;
                if (word == 0xFFFFFFFFu) continue;
                const int n = int(vocab - base < 32 ? vocab - base : 32);
                if (word == 0u) {  // the common case under a grammar: nothing in these 32 ids
                    for (int i = 0; i < n; ++i) row[base + i] = neg_inf;
                    continue;
                }
                for (int i = 0; i < n; ++i)
                    if (!((word >> i) & 1u)) row[base + i] = neg_inf;
            }
        }
    });
}

}  // namespace
}  // namespace tmk

void register_token_mask(py::module_& m) {
    m.def("apply_token_bitmask_f32", &tmk::apply_token_bitmask, py::call_guard<py::gil_scoped_release>(),
          "Set logits[rows[r], t] = -inf where bit t of bits[r] is clear (raw addresses)", py::arg("logits"),
          py::arg("row_stride"), py::arg("vocab"), py::arg("rows"), py::arg("num_rows"), py::arg("bits"),
          py::arg("words"));
}
