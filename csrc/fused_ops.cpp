// The small fp32 ops a decoder layer runs between its matmuls, each fused into one pass over the
// rows: RMSNorm (plain, after the residual add, and per q/k head followed by rope), the rotary
// embedding of q and k heads together, and the gated activations of the MLP. At one sequence eager
// PyTorch spends more time dispatching these (RMSNorm alone is 5-6 ops) than computing them.
//
// Every kernel is written once against a small vector vocabulary (vf, vload, vfma, ...) that each
// ISA variant defines below, so the three builds share their loop structure. Batch invariance: a
// row's result depends only on that row (its sum of squares is accumulated in an order fixed by the
// row length), never on how many rows there are or how parallel_for splits them.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

// GCC 12 flags the _mm512_undefined_* placeholders inside its own AVX-512 headers (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "common.h"
#include "kernels.h"

namespace py = pybind11;

namespace tmk {
namespace {

#if defined(TM_AVX512)
constexpr int64_t W = 16;
using vf = __m512;
inline __mmask16 first_lanes(int64_t n) { return __mmask16((1u << n) - 1u); }
inline vf vset(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void vstore_n(float* p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
// NaN-preserving clamp (min/max return their second operand when either is NaN).
inline vf vclamp(vf x, float lo, float hi) { return _mm512_max_ps(vset(lo), _mm512_min_ps(vset(hi), x)); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n1 * 2^n2 with n = n1 + n2, each half a normal float even when 2^n itself is not.
inline vf vpow2_split(vf n, vf p) {
    __m512i ni = _mm512_cvtps_epi32(n), n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
    __m512i bias = _mm512_set1_epi32(127);
    vf s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
    vf s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
    return vmul(vmul(p, s1), s2);
}
#elif defined(TM_AVX2)
constexpr int64_t W = 8;
using vf = __m256;
inline __m256i first_lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vset(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload_n(const float* p, int64_t n) { return _mm256_maskload_ps(p, first_lanes(n)); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void vstore_n(float* p, vf v, int64_t n) { _mm256_maskstore_ps(p, first_lanes(n), v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline vf vclamp(vf x, float lo, float hi) { return _mm256_max_ps(vset(lo), _mm256_min_ps(vset(hi), x)); }
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2_split(vf n, vf p) {
    __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    __m256i bias = _mm256_set1_epi32(127);
    vf s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    vf s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return vmul(vmul(p, s1), s2);
}
#else
// Portable: eight independent lanes in an array, so the accumulation order (and the compiler's
// freedom to auto-vectorise) matches the shape of the SIMD paths.
constexpr int64_t W = 8;
struct vf {
    float l[W];
};
template <typename Fn>
inline vf lanewise(Fn&& fn) {
    vf r;
    for (int64_t i = 0; i < W; ++i) r.l[i] = fn(i);
    return r;
}
inline vf vset(float a) { return lanewise([&](int64_t) { return a; }); }
inline vf vload_n(const float* p, int64_t n) { return lanewise([&](int64_t i) { return i < n ? p[i] : 0.0f; }); }
inline vf vload(const float* p) { return lanewise([&](int64_t i) { return p[i]; }); }
inline void vstore_n(float* p, vf v, int64_t n) {
    for (int64_t i = 0; i < n; ++i) p[i] = v.l[i];
}
inline void vstore(float* p, vf v) { vstore_n(p, v, W); }
inline vf vadd(vf a, vf b) { return lanewise([&](int64_t i) { return a.l[i] + b.l[i]; }); }
inline vf vmul(vf a, vf b) { return lanewise([&](int64_t i) { return a.l[i] * b.l[i]; }); }
inline vf vdiv(vf a, vf b) { return lanewise([&](int64_t i) { return a.l[i] / b.l[i]; }); }
// No FMA instruction in the portable build: a software fma would be far slower than two roundings.
inline vf vfma(vf a, vf b, vf c) { return lanewise([&](int64_t i) { return a.l[i] * b.l[i] + c.l[i]; }); }
inline float vsum(vf a) {
    float s = 0.0f;
    for (int64_t i = 0; i < W; ++i) s += a.l[i];
    return s;
}
#endif

// exp(x) = 2^n * e^r with n = round(x / ln2), r = x - n ln2 (Cody-Waite: ln2 in a short high part,
// exact in n * hi, plus a low correction), |r| <= ln2/2, where the degree-7 Taylor polynomial is
// within 1e-8 relative of e^r. The clamp keeps n in [-150, 128]: beyond it exp over/underflows
// anyway, and the split 2^n keeps overflow to inf and gradual underflow to denormals right.
// Max error measured against float64 exp: 1 ulp (tests/kernels/test_fused_ops.py).
inline vf vexp(vf x) {
#if defined(TM_AVX512) || defined(TM_AVX2)
    x = vclamp(x, -104.0f, 89.0f);
    vf n = vround(vmul(x, vset(1.44269504088896341f)));
    vf r = vfma(n, vset(-0.693359375f), x);
    r = vfma(n, vset(2.12194440e-4f), r);
    vf p = vset(1.0f / 5040);
    p = vfma(p, r, vset(1.0f / 720));
    p = vfma(p, r, vset(1.0f / 120));
    p = vfma(p, r, vset(1.0f / 24));
    p = vfma(p, r, vset(1.0f / 6));
    p = vfma(p, r, vset(0.5f));
    p = vfma(p, r, vset(1.0f));
    p = vfma(p, r, vset(1.0f));
    return vpow2_split(n, p);
#else
    return lanewise([&](int64_t i) { return std::exp(x.l[i]); });
#endif
}

inline vf vneg(vf x) { return vmul(x, vset(-1.0f)); }

// ---- RMSNorm -------------------------------------------------------------------------------------

// Four accumulators for throughput; the order they see the row's elements in depends only on n.
inline float sum_squares(const float* x, int64_t n) {
    vf a0 = vset(0.0f), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W) {
        vf v0 = vload(x + i), v1 = vload(x + i + W), v2 = vload(x + i + 2 * W), v3 = vload(x + i + 3 * W);
        a0 = vfma(v0, v0, a0), a1 = vfma(v1, v1, a1), a2 = vfma(v2, v2, a2), a3 = vfma(v3, v3, a3);
    }
    for (; i + W <= n; i += W) {
        vf v = vload(x + i);
        a0 = vfma(v, v, a0);
    }
    if (i < n) {
        vf v = vload_n(x + i, n - i);
        a1 = vfma(v, v, a1);
    }
    return vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
}

// As torch: mean = sum / n, then 1 / sqrt (both correctly rounded).
inline float inv_rms(float sum_sq, int64_t n, float eps) { return 1.0f / std::sqrt(sum_sq / float(n) + eps); }

// y = (x * r) * w, rounded in the same order as the PyTorch RMSNorm. y may be x.
inline void scale_row(const float* x, float r, const float* w, float* y, int64_t n) {
    vf rv = vset(r);
    int64_t i = 0;
    for (; i + W <= n; i += W) vstore(y + i, vmul(vmul(vload(x + i), rv), vload(w + i)));
    if (i < n) vstore_n(y + i, vmul(vmul(vload_n(x + i, n - i), rv), vload_n(w + i, n - i)), n - i);
}

// Rows per parallel chunk: enough elements (~16K) that a thread's share outweighs waking it.
inline int64_t grain_rows(int64_t elements_per_row) {
    int64_t g = 16384 / (elements_per_row > 0 ? elements_per_row : 1);
    return g > 0 ? g : 1;
}

void rms_norm_rows(const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride, int64_t dim, float eps,
                   int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
        const float* xr = x + t * x_stride;
        scale_row(xr, inv_rms(sum_squares(xr, dim), dim, eps), w, y + t * y_stride, dim);
    }
}

void rms_norm(uintptr_t x_addr, int64_t x_stride, uintptr_t w_addr, uintptr_t y_addr, int64_t y_stride,
              int64_t rows, int64_t dim, double eps) {
    const float* x = ptr<const float>(x_addr);
    const float* w = ptr<const float>(w_addr);
    float* y = ptr<float>(y_addr);
    parallel_for(rows, grain_rows(dim),
                 [&](int64_t b, int64_t e) { rms_norm_rows(x, x_stride, w, y, y_stride, dim, float(eps), b, e); });
}

// residual += x, then y = rms_norm(residual): the sum of squares is taken in the same order as
// rms_norm's, so y is bitwise what rms_norm would give on the updated residual.
void add_rms_norm_rows(const float* x, int64_t x_stride, float* res, int64_t res_stride, const float* w, float* y,
                       int64_t y_stride, int64_t dim, float eps, int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
        const float* xr = x + t * x_stride;
        float* rr = res + t * res_stride;
        int64_t i = 0;
        for (; i + W <= dim; i += W) vstore(rr + i, vadd(vload(rr + i), vload(xr + i)));
        if (i < dim) vstore_n(rr + i, vadd(vload_n(rr + i, dim - i), vload_n(xr + i, dim - i)), dim - i);
        scale_row(rr, inv_rms(sum_squares(rr, dim), dim, eps), w, y + t * y_stride, dim);
    }
}

void add_rms_norm(uintptr_t x_addr, int64_t x_stride, uintptr_t res_addr, int64_t res_stride, uintptr_t w_addr,
                  uintptr_t y_addr, int64_t y_stride, int64_t rows, int64_t dim, double eps) {
    const float* x = ptr<const float>(x_addr);
    float* res = ptr<float>(res_addr);
    const float* w = ptr<const float>(w_addr);
    float* y = ptr<float>(y_addr);
    parallel_for(rows, grain_rows(dim), [&](int64_t b, int64_t e) {
        add_rms_norm_rows(x, x_stride, res, res_stride, w, y, y_stride, dim, float(eps), b, e);
    });
}

// ---- rotary embedding ----------------------------------------------------------------------------

// Half-split (NEOX) rotation of h[0, rope_dim) in place, as RotaryEmbedding.apply: sin holds the
// sign, so y1 = x1 c1 + x2 s1 and y2 = x2 c2 + x1 s2. Multiply then add, no FMA, like torch.addcmul.
inline void rotate_head(float* h, const float* c, const float* s, int64_t rope_dim) {
    const int64_t half = rope_dim / 2;
    for (int64_t i = 0; i < half; i += W) {
        const int64_t n = half - i < W ? half - i : W;
        vf x1 = vload_n(h + i, n), x2 = vload_n(h + half + i, n);
        vf y1 = vadd(vmul(x1, vload_n(c + i, n)), vmul(x2, vload_n(s + i, n)));
        vf y2 = vadd(vmul(x2, vload_n(c + half + i, n)), vmul(x1, vload_n(s + half + i, n)));
        vstore_n(h + i, y1, n);
        vstore_n(h + half + i, y2, n);
    }
}

// Before any work (and outside the parallel region, where an exception must not escape).
void check_positions(const int64_t* pos, int64_t n, int64_t table_rows) {
    for (int64_t t = 0; t < n; ++t)
        if (pos[t] < 0 || pos[t] >= table_rows)
            throw std::out_of_range("position " + std::to_string(pos[t]) + " beyond the rotary table (" +
                                    std::to_string(table_rows) + " rows)");
}

struct HeadsView {  // qk [T, heads, head_dim], unit stride along head_dim
    float* base;
    int64_t token_stride, head_stride, tokens, heads, head_dim;
    float* head(int64_t t, int64_t h) const { return base + t * token_stride + h * head_stride; }
};

struct RopeTables {  // cos / sin [table_rows, rope_dim] rows picked by positions [T]
    const int64_t* positions;
    const float* cos;
    const float* sin;
    int64_t stride, rows, rope_dim;
};

void rope_rows(const HeadsView& qk, const RopeTables& rope, int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
        const int64_t row = rope.positions[t] * rope.stride;
        for (int64_t h = 0; h < qk.heads; ++h) rotate_head(qk.head(t, h), rope.cos + row, rope.sin + row, rope.rope_dim);
    }
}

void rope_qk(const HeadsView& qk, const RopeTables& rope) {
    check_positions(rope.positions, qk.tokens, rope.rows);
    parallel_for(qk.tokens, grain_rows(qk.heads * qk.head_dim), [&](int64_t b, int64_t e) { rope_rows(qk, rope, b, e); });
}

// Gemma 3: RMSNorm over each head (q heads with q_weight, k heads with k_weight), written back in
// place, then the rotation, while the head is still in L1.
void head_norm_rope_rows(const HeadsView& qk, int64_t n_q_heads, const float* q_weight, const float* k_weight,
                         float eps, const RopeTables& rope, int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
        const int64_t row = rope.positions[t] * rope.stride;
        for (int64_t h = 0; h < qk.heads; ++h) {
            float* x = qk.head(t, h);
            const float r = inv_rms(sum_squares(x, qk.head_dim), qk.head_dim, eps);
            scale_row(x, r, h < n_q_heads ? q_weight : k_weight, x, qk.head_dim);
            rotate_head(x, rope.cos + row, rope.sin + row, rope.rope_dim);
        }
    }
}

void head_rms_norm_rope(const HeadsView& qk, int64_t n_q_heads, const float* q_weight, const float* k_weight,
                        float eps, const RopeTables& rope) {
    check_positions(rope.positions, qk.tokens, rope.rows);
    parallel_for(qk.tokens, grain_rows(qk.heads * qk.head_dim), [&](int64_t b, int64_t e) {
        head_norm_rope_rows(qk, n_q_heads, q_weight, k_weight, eps, rope, b, e);
    });
}

// ---- gated activations ---------------------------------------------------------------------------

// silu(g) = g / (1 + exp(-g)), as PyTorch's vectorised SiLU rounds it.
struct Silu {
    static vf apply(vf g) { return vdiv(g, vadd(vset(1.0f), vexp(vneg(g)))); }
};

// gelu_tanh(g) = g/2 (1 + tanh(u)) with u = sqrt(2/pi) (g + 0.044715 g^3). Written as
// g / (1 + exp(-2u)) (the same function: 1 + tanh(u) = 2 / (1 + exp(-2u))), which needs no tanh and
// has no cancellation for negative g, where 1 + tanh(u) loses digits.
struct GeluTanh {
    static vf apply(vf g) {
        vf inner = vadd(g, vmul(vset(0.044715f), vmul(vmul(g, g), g)));
        vf minus_two_u = vmul(vset(-2.0f * 0.7978845608028654f), inner);
        return vdiv(g, vadd(vset(1.0f), vexp(minus_two_u)));
    }
};

// out[t, :] = act(gate_up[t, :F]) * gate_up[t, F:2F]
template <typename Act>
void gated_rows(const float* gu, int64_t gu_stride, float* out, int64_t out_stride, int64_t features, int64_t b,
                int64_t e) {
    for (int64_t t = b; t < e; ++t) {
        const float* g = gu + t * gu_stride;
        const float* u = g + features;
        float* o = out + t * out_stride;
        int64_t i = 0;
        for (; i + W <= features; i += W) vstore(o + i, vmul(Act::apply(vload(g + i)), vload(u + i)));
        if (i < features) {
            const int64_t n = features - i;
            vstore_n(o + i, vmul(Act::apply(vload_n(g + i, n)), vload_n(u + i, n)), n);
        }
    }
}

template <typename Act>
void gated(uintptr_t gu_addr, int64_t gu_stride, uintptr_t out_addr, int64_t out_stride, int64_t rows,
           int64_t features) {
    const float* gu = ptr<const float>(gu_addr);
    float* out = ptr<float>(out_addr);
    parallel_for(rows, grain_rows(features),
                 [&](int64_t b, int64_t e) { gated_rows<Act>(gu, gu_stride, out, out_stride, features, b, e); });
}

// The vector exp on its own, so the tests can measure its error.
void exp_f32(uintptr_t x_addr, uintptr_t y_addr, int64_t n) {
    const float* x = ptr<const float>(x_addr);
    float* y = ptr<float>(y_addr);
    int64_t i = 0;
    for (; i + W <= n; i += W) vstore(y + i, vexp(vload(x + i)));
    if (i < n) vstore_n(y + i, vexp(vload_n(x + i, n - i)), n - i);
}

}  // namespace

namespace entry {
int64_t row_grain(int64_t elements_per_row) { return grain_rows(elements_per_row); }
void rms_norm(const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride, int64_t rows,
              int64_t dim, float eps) {
    tmk::rms_norm(uintptr_t(x), x_stride, uintptr_t(w), uintptr_t(y), y_stride, rows, dim, eps);
}
void rms_norm_rows(const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride, int64_t dim,
                   float eps, int64_t b, int64_t e) {
    tmk::rms_norm_rows(x, x_stride, w, y, y_stride, dim, eps, b, e);
}
void add_rms_norm(const float* x, int64_t x_stride, float* residual, int64_t res_stride, const float* w, float* y,
                  int64_t y_stride, int64_t rows, int64_t dim, float eps) {
    tmk::add_rms_norm(uintptr_t(x), x_stride, uintptr_t(residual), res_stride, uintptr_t(w), uintptr_t(y), y_stride,
                      rows, dim, eps);
}
void add_rms_norm_rows(const float* x, int64_t x_stride, float* residual, int64_t res_stride, const float* w, float* y,
                       int64_t y_stride, int64_t dim, float eps, int64_t b, int64_t e) {
    tmk::add_rms_norm_rows(x, x_stride, residual, res_stride, w, y, y_stride, dim, eps, b, e);
}
static HeadsView heads_view(const Heads& h) {
    return {h.base, h.token_stride, h.head_stride, h.tokens, h.heads, h.head_dim};
}
static RopeTables rope_tables(const RopeTable& r) { return {r.positions, r.cos, r.sin, r.stride, r.rows, r.rope_dim}; }
void rope_qk(const Heads& qk, const RopeTable& rope) { tmk::rope_qk(heads_view(qk), rope_tables(rope)); }
void head_rms_norm_rope(const Heads& qk, int64_t n_q_heads, const float* q_weight, const float* k_weight, float eps,
                        const RopeTable& rope) {
    tmk::head_rms_norm_rope(heads_view(qk), n_q_heads, q_weight, k_weight, eps, rope_tables(rope));
}
void check_rope_positions(const RopeTable& rope, int64_t tokens) { check_positions(rope.positions, tokens, rope.rows); }
void rope_rows(const Heads& qk, const RopeTable& rope, int64_t b, int64_t e) {
    tmk::rope_rows(heads_view(qk), rope_tables(rope), b, e);
}
void head_rms_norm_rope_rows(const Heads& qk, int64_t n_q_heads, const float* q_weight, const float* k_weight,
                             float eps, const RopeTable& rope, int64_t b, int64_t e) {
    tmk::head_norm_rope_rows(heads_view(qk), n_q_heads, q_weight, k_weight, eps, rope_tables(rope), b, e);
}
void gated(int activation, const float* gate_up, int64_t gu_stride, float* out, int64_t out_stride, int64_t rows,
           int64_t features) {
    if (activation == SILU) tmk::gated<Silu>(uintptr_t(gate_up), gu_stride, uintptr_t(out), out_stride, rows, features);
    else tmk::gated<GeluTanh>(uintptr_t(gate_up), gu_stride, uintptr_t(out), out_stride, rows, features);
}
void gated_rows(int activation, const float* gate_up, int64_t gu_stride, float* out, int64_t out_stride,
                int64_t features, int64_t b, int64_t e) {
    if (activation == SILU) tmk::gated_rows<Silu>(gate_up, gu_stride, out, out_stride, features, b, e);
    else tmk::gated_rows<GeluTanh>(gate_up, gu_stride, out, out_stride, features, b, e);
}
}  // namespace entry
}  // namespace tmk

void register_fused_ops(py::module_& m) {
    using namespace pybind11::literals;
    auto nogil = py::call_guard<py::gil_scoped_release>();
    m.def("rms_norm_f32", &tmk::rms_norm, nogil, "x"_a, "x_stride"_a, "weight"_a, "out"_a, "out_stride"_a, "rows"_a,
          "dim"_a, "eps"_a, "out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * weight (fp32 rows, unit inner stride)");
    m.def("add_rms_norm_f32", &tmk::add_rms_norm, nogil, "x"_a, "x_stride"_a, "residual"_a, "residual_stride"_a,
          "weight"_a, "out"_a, "out_stride"_a, "rows"_a, "dim"_a, "eps"_a,
          "residual[t] += x[t]; out[t] = rms_norm(residual[t])");
    m.def(
        "rope_qk_f32",
        [](uintptr_t qk, int64_t token_stride, int64_t head_stride, int64_t tokens, int64_t heads, int64_t head_dim,
           uintptr_t positions, uintptr_t cos, uintptr_t sin, int64_t table_stride, int64_t table_rows,
           int64_t rope_dim) {
            tmk::rope_qk({tmk::ptr<float>(qk), token_stride, head_stride, tokens, heads, head_dim},
                         {tmk::ptr<const int64_t>(positions), tmk::ptr<const float>(cos),
                          tmk::ptr<const float>(sin), table_stride, table_rows, rope_dim});
        },
        nogil, "qk"_a, "token_stride"_a, "head_stride"_a, "tokens"_a, "heads"_a, "head_dim"_a, "positions"_a,
        "cos"_a, "sin"_a, "table_stride"_a, "table_rows"_a, "rope_dim"_a,
        "half-split rotary embedding of qk[T, heads, :rope_dim] in place (positions int64 [T])");
    m.def(
        "head_rms_norm_rope_f32",
        [](uintptr_t qk, int64_t token_stride, int64_t head_stride, int64_t tokens, int64_t heads, int64_t head_dim,
           int64_t n_q_heads, uintptr_t q_weight, uintptr_t k_weight, double eps, uintptr_t positions, uintptr_t cos,
           uintptr_t sin, int64_t table_stride, int64_t table_rows, int64_t rope_dim) {
            tmk::head_rms_norm_rope({tmk::ptr<float>(qk), token_stride, head_stride, tokens, heads, head_dim},
                                    n_q_heads, tmk::ptr<const float>(q_weight), tmk::ptr<const float>(k_weight),
                                    float(eps),
                                    {tmk::ptr<const int64_t>(positions), tmk::ptr<const float>(cos),
                                     tmk::ptr<const float>(sin), table_stride, table_rows, rope_dim});
        },
        nogil, "qk"_a, "token_stride"_a, "head_stride"_a, "tokens"_a, "heads"_a, "head_dim"_a, "n_q_heads"_a,
        "q_weight"_a, "k_weight"_a, "eps"_a, "positions"_a, "cos"_a, "sin"_a, "table_stride"_a, "table_rows"_a,
        "rope_dim"_a, "per-head RMSNorm of q and k heads, then the rotary embedding, in place");
    m.def("silu_mul_f32", &tmk::gated<tmk::Silu>, nogil, "gate_up"_a, "gate_up_stride"_a, "out"_a, "out_stride"_a,
          "rows"_a, "features"_a, "out[t] = silu(gate_up[t, :F]) * gate_up[t, F:]");
    m.def("gelu_tanh_mul_f32", &tmk::gated<tmk::GeluTanh>, nogil, "gate_up"_a, "gate_up_stride"_a, "out"_a,
          "out_stride"_a, "rows"_a, "features"_a, "out[t] = gelu_tanh(gate_up[t, :F]) * gate_up[t, F:]");
    m.def("exp_f32", &tmk::exp_f32, nogil, "x"_a, "out"_a, "n"_a, "the kernels' vector exp, for tests");
}
