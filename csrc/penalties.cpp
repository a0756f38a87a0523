// The repetition penalties (llama.cpp's penalties sampler: repeat, frequency, presence) applied in
// place to rows of float32 logits, each over its own window of recent token ids. kernels/penalties.py
// holds the torch reference; the arithmetic is its float32 sequence, operation for operation, so the
// results are bitwise the same. In Python the windows were counted with a Counter per row and the
// logits copied whole: 3-6 ms of a 64-sequence SmolLM2 step at Ollama's defaults (repeat_penalty 1.1
// over the last 64 tokens).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <vector>

#include "common.h"

namespace py = pybind11;

namespace tmk {
namespace {

// One row: each distinct id of the window (ids outside [0, cols) are ignored) once, with its count.
void penalise_row(float* x, int64_t cols, const int64_t* ids, int64_t n, float repeat, float frequency,
                  float presence, std::vector<int64_t>& window) {
    window.assign(ids, ids + n);
    std::sort(window.begin(), window.end());
    const float r = std::max(repeat, FLT_MIN);  // a penalty of 0 would turn logits into inf and NaN
    for (size_t i = 0; i < window.size();) {
        size_t j = i;
        while (j < window.size() && window[j] == window[i]) ++j;
        const int64_t t = window[i];
        if (t >= 0 && t < cols) {
            const float v = x[t];
            float p = v > 0.0f ? v / r : v * r;  // dividing a negative logit would favour the token
            p = p > FLT_MAX ? FLT_MAX : p;
            p = p - float(int64_t(j - i)) * frequency;
            x[t] = p - presence;
        }
        i = j;
    }
}

void apply_penalties(uintptr_t logits, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t ids,
                     uintptr_t offsets, uintptr_t repeat, uintptr_t frequency, uintptr_t presence) {
    if (rows <= 0 || cols <= 0) return;
    float* x = ptr<float>(logits);
    const int64_t* t = ptr<const int64_t>(ids);
    const int64_t* off = ptr<const int64_t>(offsets);
    const float *rep = ptr<const float>(repeat), *freq = ptr<const float>(frequency), *pres = ptr<const float>(presence);
    // A row's work is its ids (a sort, then one logit each), not its logits: ~512 ids a thread, so a
    // batch of short histories stays on one thread rather than waking 16 for a microsecond each.
    const int64_t ids_per_row = std::max<int64_t>(1, (off[rows] - off[0]) / rows);
    parallel_for(rows, std::max<int64_t>(1, 512 / ids_per_row), [&](int64_t begin, int64_t end) {
        std::vector<int64_t> window;
        for (int64_t r = begin; r < end; ++r)
            if (off[r + 1] > off[r])
                penalise_row(x + r * row_stride, cols, t + off[r], off[r + 1] - off[r], rep[r], freq[r], pres[r], window);
    });
}

}  // namespace
}  // namespace tmk

void register_penalties(py::module_& m) {
    m.def("apply_penalties_f32", &tmk::apply_penalties, py::call_guard<py::gil_scoped_release>(),
          "in place: row r's logits at the distinct ids of ids[offsets[r]:offsets[r + 1]] take the repeat, "
          "frequency and presence penalties (raw addresses)",
          py::arg("logits"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("ids"), py::arg("offsets"),
          py::arg("repeat"), py::arg("frequency"), py::arg("presence"));
}
