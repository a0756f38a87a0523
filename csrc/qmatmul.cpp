// Quantized matmul y = x @ W^T from repacked GGUF blocks (kernels/qmatmul.py holds the Python side):
// activations are quantized to two int8 planes per block of 32 once per call, then every output goes
// through integer dot products and the same fp32 sequence whatever M, the other rows or the thread
// count (work is split over output tiles only, never over K), so results are batch invariant.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <vector>

// GCC 12 flags the _mm512_undefined_* placeholders inside its own AVX-512 headers (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "common.h"
#include "kernels.h"
#include "qmatmul_amx.h"
#include "qmatmul_avx2.h"
#include "qmatmul_avx512.h"
#include "qmatmul_layout.h"

namespace py = pybind11;

namespace tmk::qmm {

// One block of 32: q1 = round_half_even(x * inv) with inv = 127 / absmax, the residual r = x - q1 * d1
// (multiply then subtract, d1 = absmax / 127) and q2 = round_half_even(r * inv * 128); S[h] = 128 *
// sum(q1) + sum(q2) per 16. Returns d1. Every path takes the same IEEE operations in the same order
// (cvtps2dq and nearbyint round half to even; no FMA), so all variants give identical bytes.
static inline float quantize_block(const float* x, int8_t* q1, int8_t* q2, int32_t S[2]) {
#if defined(TM_AVX512)
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float inv_s = amax > 0.f ? 127.f / amax : 0.f, d1_s = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(inv_s), d1 = _mm512_set1_ps(d1_s);
    const __m512 fine = _mm512_set1_ps(inv_s * float(1 << kFine));
    const __m512 v[2] = {a, b};
    for (int h = 0; h < 2; ++h) {
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], inv));
        const __m512 r = _mm512_sub_ps(v[h], _mm512_mul_ps(_mm512_cvtepi32_ps(c), d1));
        const __m512i f = _mm512_cvtps_epi32(_mm512_mul_ps(r, fine));
        _mm_storeu_si128((__m128i*)(q1 + 16 * h), _mm512_cvtepi32_epi8(c));
        _mm_storeu_si128((__m128i*)(q2 + 16 * h), _mm512_cvtepi32_epi8(f));
        S[h] = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(c, kFine), f));
    }
    return d1_s;
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
    const float inv_s = amax > 0.f ? 127.f / amax : 0.f, d1_s = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(inv_s), d1 = _mm256_set1_ps(d1_s);
    const __m256 fine = _mm256_set1_ps(inv_s * float(1 << kFine));
    alignas(32) int32_t c[32], f[32];
    for (int i = 0; i < 4; ++i) {
        const __m256i ci = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        const __m256 r = _mm256_sub_ps(v[i], _mm256_mul_ps(_mm256_cvtepi32_ps(ci), d1));
        _mm256_store_si256((__m256i*)(c + 8 * i), ci);
        _mm256_store_si256((__m256i*)(f + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(r, fine)));
    }
    S[0] = S[1] = 0;
    for (int i = 0; i < 32; ++i) {
        q1[i] = int8_t(c[i]);
        q2[i] = int8_t(f[i]);
        S[i >> 4] += c[i] * (1 << kFine) + f[i];
    }
    return d1_s;
#else
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f, d1 = amax / 127.f, fine = inv * float(1 << kFine);
    S[0] = S[1] = 0;
    for (int i = 0; i < kBlock; ++i) {
        const float c = std::nearbyint(x[i] * inv);
        const float r = x[i] - c * d1;
        q1[i] = int8_t(c);
        q2[i] = int8_t(std::nearbyint(r * fine));
        S[i >> 4] += int32_t(q1[i]) * (1 << kFine) + q2[i];
    }
    return d1;
#endif
}

// x [M, K] fp32 (row stride ldx) -> Acts rows (qmatmul_layout.h): per 32, q1, q2, dc = d1 / 128 and
// ds = dc * S; per 16, S. Rows [m0, m1) on the calling thread.
static void quantize_row_range(const float* x, int64_t K, int64_t ldx, uint8_t* out, int64_t m0, int64_t m1) {
    const int64_t nb = K / kBlock, row_bytes = Acts::row_bytes(K);
    for (int64_t m = m0; m < m1; ++m) {
        const float* xr = x + m * ldx;
        uint8_t* o = out + m * row_bytes;
        int8_t* q = reinterpret_cast<int8_t*>(o);
        for (int64_t b = 0; b < nb; ++b) {
            int32_t S[2];
            const float d1 = quantize_block(xr + b * kBlock, q + b * kBlock, q + K + b * kBlock, S);
            const float dc = d1 * (1.f / float(1 << kFine)), dsum = dc * float(S[0] + S[1]);
            std::memcpy(o + 2 * K + 4 * b, &dc, 4);
            std::memcpy(o + 2 * K + 4 * (nb + b), &dsum, 4);
            std::memcpy(o + 2 * K + 8 * nb + 8 * b, S, 8);
        }
    }
}

constexpr int64_t kQuantizeGrain = 16;  // rows

static void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, uint8_t* out) {
    parallel_for(M, kQuantizeGrain, [&](int64_t m0, int64_t m1) { quantize_row_range(x, K, ldx, out, m0, m1); });
}

// X: the AVX2 Q8_0 kernel's joined activations of rows [m0, m1) (null elsewhere).
template <int T>
static void rows(const Weight& w, int64_t tile, const Acts& a, [[maybe_unused]] const int16_t* X, int64_t m0,
                 int64_t m1, float* out, int64_t ldo) {
#if defined(TM_AVX512)
    rows_avx512<T>(w, tile, a, m0, m1, out, ldo);
#elif defined(TM_AVX2)
    rows_avx2<T>(w, tile, a, X, m0, m1, out, ldo);
#else
    tile_scalar(w, tile, a, m0, m1, out, ldo);
#endif
}

// Outputs at least this wide (a vocabulary: the output head's logits) are written with streaming
// stores by the AVX-512 kernel. Each tile writes one 64-byte line in each of its rows, every row in
// another page, and such an output is bigger than the caches: every ordinary store would wait for its
// line to be read first, and the store queue fills. SmolLM2's head (bench/qmatmul.py, Zen 4): 1.1-1.2x
// faster at 8 and 64 rows, the same at 1; into a fresh output each call, as the engine's, up to 1.8x.
// The logits are read once, by sampling, after the call.
constexpr int64_t kStreamColumns = 16384;

// The next weight tile, into L2, on the first pass over the rows of a tile at a time. In the engine the
// weights come from memory (a step reads more than the caches hold), and the per-tile work of a
// many-row call leaves the hardware prefetcher too far behind: the 64-sequence decode step ran 44-46 ms
// without this, 42.7-43.7 with it (bench/profile_step.py --batch 64, Zen 4; the output head alone 8.0
// -> 7.5 ms). On AVX-512 only where the kernel decodes each tile first (the K-quants at many rows):
// its other kernels ask for their blocks ahead themselves (qmatmul_avx512.h, tile_group_avx512). On
// the other variants only from kPrefetchTileRows rows: below, their kernels run one long stream per
// tile that the hardware prefetcher follows, and the bursts of requests only got in its way (AVX2 on
// the 2-core Sapphire Rapids box, 1 thread, alternated builds: SmolLM2's head at 3 / 4 rows 3.5 / 4.1
// -> 2.9-3.0 / 3.6-3.7 ms, its decode step of 3 / 4 sequences 22.0-22.5 / 23.6 -> 20.1-20.3 / 21.0-21.8
// ms; 8 and 32 sequences within the noise).
constexpr int64_t kPrefetchTileRows = 16;

static inline void prefetch_tile(const Weight& w, int64_t tile) {
#if defined(__x86_64__)
    const char* qs = reinterpret_cast<const char*>(w.qs_at(tile, 0));
    const char* sc = reinterpret_cast<const char*>(w.sc_at(tile, 0));
    const int64_t nq = w.blocks() * qs_bytes(w.type), ns = w.blocks() * sc_bytes(w.type);
    for (int64_t i = 0; i < nq; i += 64) asm volatile("prefetcht1 %0" : : "m"(qs[i]));
    for (int64_t i = 0; i < ns; i += 64) asm volatile("prefetcht1 %0" : : "m"(sc[i]));
#else
    (void)w, (void)tile;
#endif
}

// Rows per pass over a thread's tiles: their activations stay in L1/L2 while the weight tiles stream.
constexpr int64_t kRowChunk = 64;

#if defined(TM_AMX)
// Tiles per pass of the AMX path: a pass decodes them once (72 KB for SmolLM2's K = 576, into L2), then
// takes each group of 16 rows over all of them, so the group's activations stay in L1 while the
// weight tiles come from L2 (SmolLM2's gate_up at 512 rows 3.6 -> 2.7 ms against a tile at a time over
// 256 rows, bench/qmatmul.py).
constexpr int64_t kAmxTileChunk = 8;

// Tiles [t0, t1) of a thread: whole groups of 16 rows on AMX, the other rows on the AVX-512 kernels
// (the same bits either way).
template <int T>
static void tiles_amx(const Weight& w, const Acts& a, int64_t M, int64_t t0, int64_t t1, float* out, int64_t ldo) {
    count_amx_pass();
    amx_configure();
    const int64_t whole = M / kAmxRows * kAmxRows, per_tile = w.blocks() * kDecodedBlock;
    for (int64_t tc = t0; tc < t1; tc += kAmxTileChunk) {
        const int64_t n = std::min(kAmxTileChunk, t1 - tc);
        for (int64_t t = tc + n; t < std::min(tc + 2 * n, t1); ++t) prefetch_tile(w, t);
        const uint8_t* v = amx_values<T>(w, tc, n);
        for (int64_t m = 0; m < whole; m += kAmxRows)
            for (int64_t i = 0; i < n; ++i) tile_amx<T>(w, tc + i, a, v + i * per_tile, m, out + (tc + i) * kTile, ldo);
        for (int64_t i = 0; whole < M && i < n; ++i) rows_avx512<T>(w, tc + i, a, whole, M, out + (tc + i) * kTile, ldo);
    }
    _tile_release();
}
#endif

// Tiles [t0, t1) of a call: what one thread runs of it. X: see rows().
template <int T>
static void tile_range(const Weight& w, const Acts& a, int64_t M, [[maybe_unused]] const int16_t* X, int64_t t0,
                       int64_t t1, float* out, int64_t ldo) {
#if defined(TM_AMX)
    if constexpr (kAmxType<T>) {
        if (M >= amx_min_rows(w) && amx_enabled()) {
            tiles_amx<T>(w, a, M, t0, t1, out, ldo);
            if (w.stream_out) _mm_sfence();
            return;
        }
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
        const int64_t m1 = std::min(M, m0 + kRowChunk);
        for (int64_t t = t0; t < t1;) {
#if defined(TM_AVX512)
            if constexpr (kGrouped<T>) {
                if (takes_group(w, t, t1, m1 - m0)) {  // it prefetches its tiles itself
                    const int64_t next = takes_group(w, t + kGroupTiles, t1, m1 - m0) ? t + kGroupTiles : -1;
                    rows_group_avx512<T>(w, t, a, m0, m1, out + t * kTile, ldo, next);
                    t += kGroupTiles;
                    continue;
                }
            }
#endif
#if defined(TM_AVX512)
            const bool prefetch_next = prefetches_next_tile<T>(m1 - m0);
#else
            const bool prefetch_next = M >= kPrefetchTileRows;
#endif
            if (m0 == 0 && t + 1 < t1 && prefetch_next) prefetch_tile(w, t + 1);
            rows<T>(w, t, a, X == nullptr ? nullptr : X + m0 * w.K, m0, m1, out + t * kTile, ldo);
            ++t;
        }
    }
#if defined(TM_AVX512)
    if (w.stream_out) _mm_sfence();  // streaming stores are weakly ordered: visible before the join
#endif
}

static void tile_range_of(const Weight& w, const Acts& a, int64_t M, const int16_t* X, int64_t t0, int64_t t1,
                          float* out, int64_t ldo) {
    switch (w.type) {
        case Q4_0: tile_range<Q4_0>(w, a, M, X, t0, t1, out, ldo); break;
        case Q4_1: tile_range<Q4_1>(w, a, M, X, t0, t1, out, ldo); break;
        case Q5_0: tile_range<Q5_0>(w, a, M, X, t0, t1, out, ldo); break;
        case Q8_0: tile_range<Q8_0>(w, a, M, X, t0, t1, out, ldo); break;
        case Q4_K: tile_range<Q4_K>(w, a, M, X, t0, t1, out, ldo); break;
        case Q6_K: tile_range<Q6_K>(w, a, M, X, t0, t1, out, ldo); break;
        default: break;  // Python only passes SUPPORTED_TYPES
    }
}

// Tiles per part of a region: enough work that a small GEMV is not all synchronisation, and a matrix
// is cut into no more pieces than its work can feed. The split never changes results.
static int64_t tile_grain(int64_t M, int64_t K) {
    const int64_t work_per_tile = M * K * kTile;
    return work_per_tile >= (1 << 16) ? 1 : (1 << 16) / work_per_tile;
}

// The AVX2 Q8_0 kernel's joined activations (joined_rows), in the calling thread's buffer, grown to
// the largest call and reused; null on the other variants. Worker threads get its address: naming a
// thread_local inside the parallel region would give them their own.
static const int16_t* joined_activations([[maybe_unused]] const Acts& a, [[maybe_unused]] int64_t M) {
#if defined(TM_AVX2)
    thread_local std::vector<int16_t> joined;
    if (joined.size() < size_t(M * a.K)) joined.resize(size_t(M * a.K));
    int16_t* dst = joined.data();
    parallel_for(M, 16, [&](int64_t m0, int64_t m1) { joined_rows(a, m0, m1, dst + m0 * a.K); });
    return dst;
#else
    return nullptr;
#endif
}

// One weight's tiles, or several weights' (the parts of one projection, each with its own output
// columns) in one region: a range of the concatenated tiles runs each part's share of it.
static void run_parts(const Weight* w, float* const* out, int n, const Acts& a, int64_t M, int64_t ldo) {
    const int16_t* X = nullptr;
    int64_t total = 0;
    for (int p = 0; p < n; ++p) {
        total += w[p].tiles();
        if (w[p].type == Q8_0 && X == nullptr) X = joined_activations(a, M);
    }
    parallel_for(total, tile_grain(M, a.K), [&](int64_t b, int64_t e) {
        int64_t first = 0;
        for (int p = 0; p < n && first < e; first += w[p].tiles(), ++p) {
            const int64_t t0 = std::max(b, first) - first, t1 = std::min(e, first + w[p].tiles()) - first;
            if (t0 < t1) tile_range_of(w[p], a, M, w[p].type == Q8_0 ? X : nullptr, t0, t1, out[p], ldo);
        }
    });
}

static void qmatmul(int type, uintptr_t acts, int64_t M, int64_t K, uintptr_t qs, uintptr_t sc, uintptr_t sup,
                    int64_t N, uintptr_t out, int64_t ldo) {
    const Acts a{ptr<const uint8_t>(acts), K};
    const Weight w{type, ptr<const uint8_t>(qs), ptr<const uint8_t>(sc), ptr<const uint8_t>(sup), N, K,
                   N >= kStreamColumns};
    float* y = ptr<float>(out);
    run_parts(&w, &y, 1, a, M, ldo);
}

}  // namespace tmk::qmm

namespace tmk::entry {
int64_t act_row_bytes(int64_t K) { return qmm::Acts::row_bytes(K); }
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, uint8_t* out) {
    qmm::quantize_rows(x, M, K, ldx, out);
}
void quantize_row_range(const float* x, int64_t K, int64_t ldx, uint8_t* out, int64_t m0, int64_t m1) {
    qmm::quantize_row_range(x, K, ldx, out, m0, m1);
}
int64_t quantize_grain() { return qmm::kQuantizeGrain; }
void qmatmul(int type, const uint8_t* acts, int64_t M, int64_t K, const uint8_t* qs, const uint8_t* sc,
             const uint8_t* sup, int64_t N, float* out, int64_t ldo) {
    qmm::qmatmul(type, uintptr_t(acts), M, K, uintptr_t(qs), uintptr_t(sc), uintptr_t(sup), N, uintptr_t(out), ldo);
}
void qmatmul_parts(const MatmulPart* parts, int n, const uint8_t* acts, int64_t M, int64_t K, int64_t ldo) {
    constexpr int kMaxParts = 8;
    if (n > kMaxParts) {  // never for a projection's parts (q, k, v or gate, up), but stay correct
        for (int p = 0; p < n; ++p)
            qmatmul(parts[p].type, acts, M, K, parts[p].qs, parts[p].sc, parts[p].sup, parts[p].N, parts[p].out, ldo);
        return;
    }
    qmm::Weight w[kMaxParts];
    float* out[kMaxParts];
    for (int p = 0; p < n; ++p) {
        const MatmulPart& q = parts[p];
        w[p] = qmm::Weight{q.type, q.qs, q.sc, q.sup, q.N, K, q.N >= qmm::kStreamColumns};
        out[p] = q.out;
    }
    qmm::run_parts(w, out, n, qmm::Acts{acts, K}, M, ldo);
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
