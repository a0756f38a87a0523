// Greedy sampling's argmax over rows of float32 logits, with torch.max(dim=-1)'s rules: the first
// index of the largest value; a row holding a NaN gives its first NaN's index; -0.0 and 0.0 tie.
// kernels/argmax.py's reference is torch.max itself. torch's kernel read a 64 x 49,152 row block at
// ~6 GB/s inside a decode step (2.2 ms of it); this one is bound by memory.
//
// A segment of a row is scanned twice: once for its largest value (a vector max, NaNs noted on the
// side), then for the first index equal to it, which finds the segment in cache. Few rows are cut into
// segments so both threads share a row's bytes; segments are joined in index order, so the answer
// does not depend on the thread count.
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

struct Best {
    float value;
    int64_t index;  // first index of value, or of the first NaN when nan is set
    bool nan;
};

using sampling::segment_max;

// First index in x[0, n) whose value equals m (present by construction), or whose value is a NaN.
int64_t first_index(const float* x, int64_t n, float m, bool nan) {
    int64_t i = 0;
#if defined(TM_AVX512)
    const __m512 vm = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, vm, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(unsigned(hit));
    }
#elif defined(TM_AVX2)
    const __m256 vm = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, vm, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(unsigned(hit));
    }
#endif
    for (; i < n; ++i)
        if (nan ? std::isnan(x[i]) : x[i] == m) return i;
    return 0;  // not reached: m is one of the values, or a NaN was seen
}

Best scan(const float* x, int64_t n) {
    bool nan = false;
    const float m = segment_max(x, n, &nan);
    return {nan ? std::numeric_limits<float>::quiet_NaN() : m, first_index(x, n, m, nan), nan};
}

constexpr int64_t kMinSegment = 1 << 14;  // floats: below this a second thread costs more than it saves

void argmax_rows(uintptr_t logits, int64_t rows, int64_t cols, int64_t row_stride, uintptr_t out) {
    if (rows <= 0 || cols <= 0) return;
    const float* x = ptr<const float>(logits);
    int64_t* index = ptr<int64_t>(out);
    const int threads = num_threads();
    int64_t segments = rows >= threads ? 1 : (threads + rows - 1) / rows;
    segments = std::max<int64_t>(1, std::min<int64_t>(segments, cols / kMinSegment));
    // Every segment is non-empty: with segments <= cols / kMinSegment, (segments - 1) * seg_len < cols.
    const int64_t seg_len = (cols + segments - 1) / segments;
    std::vector<Best> best(size_t(rows * segments));
    parallel_for(rows * segments, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const int64_t r = t / segments, s0 = (t % segments) * seg_len;
            Best b = scan(x + r * row_stride + s0, std::min(seg_len, cols - s0));
            b.index += s0;
            best[size_t(t)] = b;
        }
    });
    for (int64_t r = 0; r < rows; ++r) {
        Best b = best[size_t(r * segments)];
        for (int64_t s = 1; s < segments && !b.nan; ++s) {
            const Best& c = best[size_t(r * segments + s)];
            if (c.nan || c.value > b.value) b = c;  // equal values keep the earlier segment's index
        }
        index[r] = b.index;
    }
}

}  // namespace
}  // namespace tmk

void register_argmax(py::module_& m) {
    m.def("argmax_rows_f32", &tmk::argmax_rows, py::call_guard<py::gil_scoped_release>(),
          "out[r] = torch.max(logits[r], dim=-1).indices for float32 rows (raw addresses)", py::arg("logits"),
          py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("out"));
}
