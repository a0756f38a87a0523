// Token embeddings looked up straight from a Q8_0 table (GGUF blocks of 32 inputs: an fp16 scale, then
// 32 int8), the token_embd type of both real models: each row dequantized as gguf's own arithmetic does
// it (model/quantized.py EmbeddingRows), float(q) * float(scale), one rounding, so the rows are bitwise
// its. A decode step looks up one row per sequence; through numpy that took ~0.1 ms of a single
// stream's 5 ms step here (a dozen small array operations right after the weights went through the
// caches), here one call.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common.h"

namespace py = pybind11;

namespace tmk {
namespace {

constexpr int64_t kQ8Block = 32, kQ8BlockBytes = 34;

void embed_rows_q8_0(uintptr_t table, int64_t vocab, int64_t dim, uintptr_t ids_addr, int64_t n, uintptr_t out_addr) {
    if (dim <= 0 || dim % kQ8Block) throw std::invalid_argument("a Q8_0 row holds whole blocks of 32");
    const int64_t* ids = ptr<const int64_t>(ids_addr);
    for (int64_t r = 0; r < n; ++r)
        if (ids[r] < 0 || ids[r] >= vocab)
            throw std::out_of_range("token id " + std::to_string(ids[r]) + " is not in the vocabulary");
    const uint8_t* base = ptr<const uint8_t>(table);
    float* out = ptr<float>(out_addr);
    const int64_t row_bytes = dim / kQ8Block * kQ8BlockBytes;
    for (int64_t r = 0; r < n; ++r) {
        const uint8_t* block = base + ids[r] * row_bytes;
        float* y = out + r * dim;
        for (int64_t b = 0; b < dim / kQ8Block; ++b, block += kQ8BlockBytes, y += kQ8Block) {
            const float d = f16_to_f32(uint16_t(block[0] | (block[1] << 8)));
            const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
            for (int i = 0; i < kQ8Block; ++i) y[i] = float(q[i]) * d;
        }
    }
}

}  // namespace
}  // namespace tmk

void register_embedding(py::module_& m) {
    using namespace pybind11::literals;
    m.def("embed_rows_q8_0", &tmk::embed_rows_q8_0, py::call_guard<py::gil_scoped_release>(), "table"_a, "vocab"_a,
          "dim"_a, "ids"_a, "n"_a, "out"_a,
          "out [n, dim] fp32 = the Q8_0 table's rows ids (model/quantized.py EmbeddingRows)");
}
