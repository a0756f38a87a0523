// Quantized matmul y = x @ W^T from repacked GGUF blocks (kernels/qmatmul.py holds the Python side):
// activations are quantized to two int8 planes per block of 32 once per call, then every output goes
// through integer dot products and the same fp32 sequence whatever M, the other rows or the thread
// count (work is split over output tiles only, never over K), so results are batch invariant.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>

// GCC 12 flags the _mm512_undefined_* placeholders inside its own AVX-512 headers (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "common.h"
#include "kernels.h"
#include "qmatmul_avx2.h"
#include "qmatmul_avx512.h"
#include "qmatmul_layout.h"

namespace py = pybind11;

namespace tmk::qmm {

// One block of 32: q = round_half_even(x * (127 / absmax)); returns absmax. Every path rounds the same
// way (cvtps2dq and nearbyint in the default mode), so all variants give identical bytes.
static inline float quantize_block(const float* x, int8_t* q, int32_t sums[2]) {
#if defined(TM_AVX512)
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(qb));
    sums[0] = _mm512_reduce_add_epi32(qa);
    sums[1] = _mm512_reduce_add_epi32(qb);
    return amax;
#elif defined(TM_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    alignas(32) int32_t qi[32];
    for (int i = 0; i < 4; ++i) _mm256_store_si256((__m256i*)(qi + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
    for (int i = 0; i < 32; ++i) {
        q[i] = int8_t(qi[i]);
        sums[i >> 4] += qi[i];
    }
    return amax;
#else
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < kBlock; ++i) {
        q[i] = int8_t(std::nearbyint(x[i] * inv));
        sums[i >> 4] += q[i];
    }
    return amax;
#endif
}

// Writes one plane's block (q, d = absmax/127, ds = d * sum(q), sum(q) per 16) into Acts row o; returns d.
static inline float write_block(const float* x, uint8_t* o, int64_t K, int64_t b) {
    const int64_t nb = K / kBlock;
    int32_t sums[2] = {0, 0};
    const float amax = quantize_block(x, reinterpret_cast<int8_t*>(o) + b * kBlock, sums);
    const float scale = amax / 127.f, dsum = scale * float(sums[0] + sums[1]);
    std::memcpy(o + K + 4 * b, &scale, 4);
    std::memcpy(o + K + 4 * (nb + b), &dsum, 4);
    std::memcpy(o + K + 8 * nb + 8 * b, sums, 8);
    return scale;
}

// x [M, K] fp32 (row stride ldx) -> kPlanes Acts rows per input row: the block, then its residual
// x - d1 q1 (multiply then subtract, no FMA: the Python reference computes it so).
static void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, uint8_t* out) {
    static_assert(kPlanes == 2, "one residual plane");
    const int64_t nb = K / kBlock, row_bytes = Acts::row_bytes(K);
    parallel_for(M, 16, [&](int64_t m0, int64_t m1) {
        alignas(64) float residual[kBlock];
        for (int64_t m = m0; m < m1; ++m) {
            const float* xr = x + m * ldx;
            uint8_t* hi = out + kPlanes * m * row_bytes;
            uint8_t* lo = hi + row_bytes;
            for (int64_t b = 0; b < nb; ++b) {
                const float* xb = xr + b * kBlock;
                const float d = write_block(xb, hi, K, b);
                const int8_t* q = reinterpret_cast<const int8_t*>(hi) + b * kBlock;
                for (int i = 0; i < kBlock; ++i) residual[i] = xb[i] - float(q[i]) * d;
                write_block(residual, lo, K, b);
            }
        }
    });
}

template <int T>
static void rows(const Weight& w, int64_t tile, const Acts& a, int64_t m0, int64_t m1, float* out, int64_t ldo) {
#if defined(TM_AVX512)
    rows_avx512<T>(w, tile, a, m0, m1, out, ldo);
#elif defined(TM_AVX2)
    rows_avx2<T>(w, tile, a, m0, m1, out, ldo);
#else
    tile_scalar(w, tile, a, m0, m1, out, ldo);
#endif
}

// Input rows per pass over a thread's tiles: their planes stay in L1/L2 while the weight tiles stream.
constexpr int64_t kRowChunk = 64;

// Each tile's planes land in a small buffer, then out = plane 1 + plane 2 (the same two fp32 sums
// and one add for every row, whatever M).
template <int T>
static void run(const Weight& w, const Acts& a, int64_t M, float* out, int64_t ldo) {
    // Enough tiles per thread that a small GEMV is not all fork/join; the split never changes results.
    const int64_t work_per_tile = kPlanes * M * w.K * kTile;
    const int64_t grain = work_per_tile >= (1 << 16) ? 1 : (1 << 16) / work_per_tile;
    parallel_for(w.tiles(), grain, [&](int64_t t0, int64_t t1) {
        alignas(64) float planes[kPlanes * kRowChunk][kTile];
        for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
            const int64_t n = std::min(kRowChunk, M - m0);
            const Acts chunk{a.at(kPlanes * m0), a.K};
            for (int64_t t = t0; t < t1; ++t) {
                rows<T>(w, t, chunk, 0, kPlanes * n, planes[0], kTile);
                const int64_t cols = std::min<int64_t>(kTile, w.N - t * kTile);
                for (int64_t m = 0; m < n; ++m) {
                    float* o = out + (m0 + m) * ldo + t * kTile;
                    for (int64_t c = 0; c < cols; ++c) o[c] = planes[2 * m][c] + planes[2 * m + 1][c];
                }
            }
        }
    });
}

static void qmatmul(int type, uintptr_t acts, int64_t M, int64_t K, uintptr_t qs, uintptr_t sc, uintptr_t sup,
                    int64_t N, uintptr_t out, int64_t ldo) {
    const Acts a{ptr<const uint8_t>(acts), K};
    const Weight w{type, ptr<const uint8_t>(qs), ptr<const uint8_t>(sc), ptr<const uint8_t>(sup), N, K};
    float* y = ptr<float>(out);
    switch (type) {
        case Q4_0: run<Q4_0>(w, a, M, y, ldo); break;
        case Q4_1: run<Q4_1>(w, a, M, y, ldo); break;
        case Q5_0: run<Q5_0>(w, a, M, y, ldo); break;
        case Q8_0: run<Q8_0>(w, a, M, y, ldo); break;
        case Q4_K: run<Q4_K>(w, a, M, y, ldo); break;
        case Q6_K: run<Q6_K>(w, a, M, y, ldo); break;
        default: break;  // Python only passes SUPPORTED_TYPES
    }
}

}  // namespace tmk::qmm

namespace tmk::entry {
int64_t act_row_bytes(int64_t K) { return qmm::kPlanes * qmm::Acts::row_bytes(K); }
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, uint8_t* out) {
    qmm::quantize_rows(x, M, K, ldx, out);
}
void qmatmul(int type, const uint8_t* acts, int64_t M, int64_t K, const uint8_t* qs, const uint8_t* sc,
             const uint8_t* sup, int64_t N, float* out, int64_t ldo) {
    qmm::qmatmul(type, uintptr_t(acts), M, K, uintptr_t(qs), uintptr_t(sc), uintptr_t(sup), N, uintptr_t(out), ldo);
}
}  // namespace tmk::entry

void register_qmatmul(py::module_& m) {
    m.def(
        "quantize_activations",
        [](uintptr_t x, int64_t M, int64_t K, int64_t ldx, uintptr_t out) {
            tmk::qmm::quantize_rows(tmk::ptr<const float>(x), M, K, ldx, tmk::ptr<uint8_t>(out));
        },
        py::call_guard<py::gil_scoped_release>(), "x fp32 [M, K] -> two int8 planes per row (per 32: q, scale, sums)");
    m.def("qmatmul", &tmk::qmm::qmatmul, py::call_guard<py::gil_scoped_release>(),
          "y [M, N] (row stride ldo) = activations [M, K] @ repacked GGUF weight [N, K]^T");
}
