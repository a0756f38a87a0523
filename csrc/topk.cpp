// Sampling's top_k over rows of float32 logits (kernels/topk.py): per row the k largest values in
// descending order, equal values by ascending index. That order is total on non-NaN values, so a
// row's answer is one set however the row is cut: the same for any thread count or batch. torch.topk
// (tie order unspecified) took ~5-6 ms of a 64-sequence SmolLM2 decode step on 2 threads.
//
// A row is scanned against a threshold that the k-th best value is known to reach: a vector compare
// per 64 values rejects almost all of them, and the few survivors go to a buffer that is cut back to
// its best k (raising the threshold) when it fills. The compare also lets NaNs through, so the
// survivor path sees them and reports the row: Python then asks torch.topk instead.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "common.h"

namespace py = pybind11;

namespace tmk {
namespace {

// A value's rank: an unsigned integer whose ascending order is descending value. -0.0 is ranked as
// 0.0 (they tie, as in torch); results are read back from the row by index, so -0.0 stays itself.
inline uint32_t rank_of(float v) {
    v += 0.0f;
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return ~(u ^ ((u >> 31) ? 0xffffffffu : 0x80000000u));
}

inline float value_of(uint32_t rank) {
    uint32_t u = ~rank;
    u ^= (u >> 31) ? 0x80000000u : 0xffffffffu;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}

// A candidate as one integer, (rank << 32 | index): ascending order is the result's order, and no
// two are equal, so selection needs no tie rule. (A bitwise search for the k-th rank over vectorized
// counts cut 144 candidates to 40 only ~30% faster than std::nth_element on AVX-512 and AVX2, and no
// faster on the scalar build: not worth its tie logic.)
inline uint64_t key(float v, int64_t index) { return uint64_t(rank_of(v)) << 32 | uint64_t(index); }
inline float key_value(uint64_t key) { return value_of(uint32_t(key >> 32)); }

// Blocks of 64 values. above(p, thr), bit j: !(p[j] <= thr), i.e. p[j] > thr or p[j] is a NaN (thr a
// NaN lets everything through). block_max(p, nan): the largest of p[0, 64), NaNs noted in *nan.
constexpr int64_t kBlock = 64;
#if defined(TM_AVX512)
inline uint64_t above(const float* p, float thr) {
    const __m512 t = _mm512_set1_ps(thr);
    uint64_t bits = 0;
    for (int j = 0; j < 4; ++j)
        bits |= uint64_t(_mm512_cmp_ps_mask(_mm512_loadu_ps(p + 16 * j), t, _CMP_NLE_UQ)) << 16 * j;
    return bits;
}
inline float block_max(const float* p, bool* nan) {
    const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16), c = _mm512_loadu_ps(p + 32),
                 d = _mm512_loadu_ps(p + 48);
    *nan |= (_mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, d, _CMP_UNORD_Q)) != 0;
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(c, d)));
}
#elif defined(TM_AVX2)
inline uint64_t above(const float* p, float thr) {
    const __m256 t = _mm256_set1_ps(thr);
    uint64_t bits = 0;
    for (int j = 0; j < 8; ++j)
        bits |= uint64_t(unsigned(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + 8 * j), t, _CMP_NLE_UQ))))
                << 8 * j;
    return bits;
}
inline float block_max(const float* p, bool* nan) {
    __m256 m = _mm256_loadu_ps(p), unord = _mm256_setzero_ps();
    for (int j = 1; j < 8; ++j) {
        const __m256 v = _mm256_loadu_ps(p + 8 * j);
        unord = _mm256_or_ps(unord, _mm256_cmp_ps(m, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    *nan |= _mm256_movemask_ps(unord) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    return *std::max_element(lanes, lanes + 8);
}
#else
inline uint64_t above(const float* p, float thr) {
    uint64_t bits = 0;
    for (int j = 0; j < kBlock; ++j) bits |= uint64_t(!(p[j] <= thr)) << j;
    return bits;
}
inline float block_max(const float* p, bool* nan) {
    float m = p[0];
    for (int j = 0; j < kBlock; ++j) {
        *nan |= std::isnan(p[j]);
        m = p[j] > m ? p[j] : m;
    }
    return m;
}
#endif

// Rows of 2k to 32k blocks get a first pass over block maxima. On random rows it saved 5-20% at
// 64 x 49,152 (k=40, 256) and cost ~10% at 1 x 262,144 (k=40), so longer rows go without.
constexpr int64_t kMinBlocksPerK = 2, kMaxBlocksPerK = 32;

// The best min(k, end - begin) values of row[begin, end) as keys, sorted, into out; returns how many,
// or -1 when that stretch holds a NaN. A value not above the threshold cannot enter (an equal one
// ranks lower: its index is larger). Scanning from the start, the threshold is the k-th best so far;
// it rises slowly, and each survivor costs a mispredicted branch. So rows of the right length first
// take the k-th largest block maximum (found by this same function over the maxima) as threshold,
// which is close to the k-th best, and then visit only blocks whose maximum is above it.
int64_t segment_topk(const float* row, int64_t begin, int64_t end, int64_t k, std::vector<uint64_t>& c,
                     uint64_t* out) {
    const int64_t n = end - begin, m = std::min(k, n), blocks = n / kBlock;
    float thr = std::numeric_limits<float>::quiet_NaN();  // lets everything through
    std::vector<float> maxima;
    if (blocks >= kMinBlocksPerK * k && blocks <= kMaxBlocksPerK * k) {
        maxima.resize(size_t(blocks));
        bool nan = false;
        for (int64_t b = 0; b < blocks; ++b) maxima[size_t(b)] = block_max(row + begin + b * kBlock, &nan);
        if (nan) return -1;
        std::vector<uint64_t> best(static_cast<size_t>(k));
        segment_topk(maxima.data(), 0, blocks, k, c, best.data());
        const float kth = key_value(best[size_t(k - 1)]);  // k values reach it
        if (kth > -INFINITY) thr = std::nextafter(kth, -INFINITY);
    }
    // Room for k + slack survivors: a cut costs O(size), so slack ~ k keeps it O(1) a survivor.
    const size_t cap = size_t(2 * k + 64);
    c.resize(cap);
    size_t size = 0;
    auto take = [&](int64_t i) {  // false: row[i] is a NaN
        const float v = row[i];
        if (v <= thr) return true;  // stale bits: thr may have risen since `above`
        if (v != v) return false;
        c[size++] = key(v, i);
        if (size == size_t(k)) {  // once: a cut leaves k, the next push makes k + 1
            thr = key_value(*std::max_element(c.begin(), c.begin() + k));
        } else if (size == cap) {
            std::nth_element(c.begin(), c.begin() + (k - 1), c.end());
            thr = key_value(c[size_t(k - 1)]);
            size = size_t(k);
        }
        return true;
    };
    for (int64_t b = 0; b < blocks; ++b) {
        if (!maxima.empty() && maxima[size_t(b)] <= thr) continue;
        const int64_t i = begin + b * kBlock;
        for (uint64_t bits = above(row + i, thr); bits; bits &= bits - 1)
            if (!take(i + __builtin_ctzll(bits))) return -1;
    }
    for (int64_t i = begin + blocks * kBlock; i < end; ++i)
        if (!take(i)) return -1;
    // Not std::partial_sort: its heap sort took ~15 us more a row at k=256 than selecting, then sorting.
    if (size > size_t(m)) std::nth_element(c.begin(), c.begin() + (m - 1), c.begin() + size);
    std::sort(c.begin(), c.begin() + m);
    std::copy(c.begin(), c.begin() + m, out);
    return m;
}

// floats: a row is cut for more threads only into pieces this long. 1 x 262,144 (k=40) took 43 us on
// one thread and 20 on two; cutting 1 x 49,152 in two gained nothing measurable.
constexpr int64_t kMinSegment = 1 << 15;

int64_t topk_rows(uintptr_t logits, int64_t rows, int64_t cols, int64_t row_stride, int64_t k, uintptr_t out_values,
                  uintptr_t out_ids) {
    if (k < 1 || k > cols) throw std::invalid_argument("topk_rows_f32: need 1 <= k <= cols");
    if (cols > int64_t(UINT32_MAX)) throw std::invalid_argument("topk_rows_f32: indices must fit 32 bits");
    if (rows <= 0) return 0;
    const float* x = ptr<const float>(logits);
    float* values = ptr<float>(out_values);
    int64_t* ids = ptr<int64_t>(out_ids);
    const int threads = num_threads();
    int64_t segments = rows >= threads ? 1 : (threads + rows - 1) / rows;
    segments = std::max<int64_t>(1, std::min<int64_t>(segments, cols / kMinSegment));
    const int64_t seg_len = (cols + segments - 1) / segments;  // every segment non-empty (see argmax.cpp)
    std::vector<uint64_t> found(size_t(rows * segments * k));
    std::vector<int64_t> counts(size_t(rows * segments));
    parallel_for(rows * segments, 1, [&](int64_t begin, int64_t end) {
        std::vector<uint64_t> buf;
        for (int64_t t = begin; t < end; ++t) {
            const int64_t r = t / segments, s0 = (t % segments) * seg_len;
            counts[size_t(t)] = segment_topk(x + r * row_stride, s0, std::min(s0 + seg_len, cols), k, buf,
                                             found.data() + t * k);
        }
    });
    int64_t nan_rows = 0;
    std::vector<uint64_t> merged;
    for (int64_t r = 0; r < rows; ++r) {
        const uint64_t* best = found.data() + r * segments * k;
        const int64_t* count = counts.data() + r * segments;
        if (std::any_of(count, count + segments, [](int64_t c) { return c < 0; })) {
            ++nan_rows;
            continue;
        }
        if (segments > 1) {  // each segment's best k, sorted, hold the row's best k
            merged.clear();
            for (int64_t s = 0; s < segments; ++s) {
                const size_t mid = merged.size();
                merged.insert(merged.end(), best + s * k, best + s * k + count[s]);
                std::inplace_merge(merged.begin(), merged.begin() + mid, merged.end());
            }
            best = merged.data();
        }
        for (int64_t j = 0; j < k; ++j) {
            ids[r * k + j] = int64_t(best[j] & 0xffffffffu);
            values[r * k + j] = x[r * row_stride + ids[r * k + j]];
        }
    }
    return nan_rows;
}

}  // namespace
}  // namespace tmk

void register_topk(py::module_& m) {
    m.def("topk_rows_f32", &tmk::topk_rows, py::call_guard<py::gil_scoped_release>(),
          "values/ids [rows, k] = each float32 row's k largest values (descending, ties by ascending index) "
          "and their indices (raw addresses); returns the number of rows holding a NaN (their outputs unset)",
          py::arg("logits"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"), py::arg("k"),
          py::arg("out_values"), py::arg("out_ids"));
}
