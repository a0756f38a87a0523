// A whole decoder step in one call: every layer of a Llama, Qwen2/3 or Gemma 3 model, chained from the same
// kernels the per-op path calls (kernels.h), over scratch buffers this object keeps between steps.
// At one sequence a layer's kernels take ~10 us each but each Python-side call costs as much again,
// which was half of a decode step; here Python makes one call per step.
//
// The arithmetic is the per-op path's, kernel for kernel and in the same order, so the hidden states
// are bitwise the same (tests/kernels/test_decoder_step.py holds it to that), and so is batch
// invariance: every kernel's per-row result depends only on that row.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "qmatmul_layout.h"

namespace py = pybind11;

namespace tmk {
namespace {

struct QuantizedPart {  // rows [col, col + N) of a projection's output, one GGUF type
    int type;
    const uint8_t *qs, *sc, *sup;
    int64_t N, col;
};

constexpr int kMaxParts = 8;  // a projection's GGUF parts (q, k, v or gate, up: at most 3 in practice)

struct Projection {
    std::vector<QuantizedPart> parts;
    int64_t N = 0, K = 0;
};

struct Layer {
    const float *attn_norm, *ffn_norm;
    const float *post_attn_norm, *post_ffn_norm;  // Gemma 3 only (nullptr otherwise)
    const float *q_norm, *k_norm;                 // Gemma 3 and Qwen3 only
    const float* qkv_bias;                        // Qwen2 only: added to the qkv projection's rows
    Projection qkv, o, gate_up, down;
    const float *cos, *sin;
    int64_t rope_rows, rope_stride, rope_dim;
    int window;
    float softcap;  // Gemma 2's attention score cap (0: none)
    void *k_cache = nullptr, *v_cache = nullptr;
    float *k_scale = nullptr, *v_scale = nullptr;
};

// What a step's time goes to, when profiling is on (bench/profile_step.py prints it). The norms and
// the activation include quantizing the next matmul's input; o_proj includes quantizing attention's.
enum Phase { NORMS, QKV, ROPE_KV_WRITE, ATTENTION, O_PROJ, GATE_UP, ACTIVATION, DOWN, NUM_PHASES };
constexpr const char* kPhaseNames[NUM_PHASES] = {"norms", "qkv", "rope+kv_write", "attention",
                                                 "o_proj", "gate_up", "activation", "down"};

// Per part: (ggml type, qs address, sc address, sup address, rows, columns).
using PartSpec = std::tuple<int, uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t>;

class DecoderStep {
public:
    DecoderStep(int64_t dim, int n_heads, int n_kv_heads, int head_dim, int64_t ffn_dim, double eps, int activation,
                double scale, int cache_type, int64_t num_slots)
        : dim_(dim), H_(n_heads), Hkv_(n_kv_heads), D_(head_dim), ffn_(ffn_dim), eps_(float(eps)),
          activation_(activation), scale_(float(scale)), cache_type_(cache_type), num_slots_(num_slots) {}

    void add_layer(uintptr_t attn_norm, uintptr_t ffn_norm, uintptr_t post_attn_norm, uintptr_t post_ffn_norm,
                   uintptr_t q_norm, uintptr_t k_norm, uintptr_t qkv_bias, const std::vector<PartSpec>& qkv, const std::vector<PartSpec>& o,
                   const std::vector<PartSpec>& gate_up, const std::vector<PartSpec>& down, uintptr_t cos,
                   uintptr_t sin, int64_t rope_rows, int64_t rope_stride, int64_t rope_dim, int window, double softcap) {
        Layer l{};
        l.attn_norm = ptr<const float>(attn_norm);
        l.ffn_norm = ptr<const float>(ffn_norm);
        l.post_attn_norm = ptr<const float>(post_attn_norm);
        l.post_ffn_norm = ptr<const float>(post_ffn_norm);
        l.q_norm = ptr<const float>(q_norm);
        l.k_norm = ptr<const float>(k_norm);
        l.qkv_bias = ptr<const float>(qkv_bias);
        if ((l.post_attn_norm == nullptr) != (l.post_ffn_norm == nullptr) || (l.q_norm == nullptr) != (l.k_norm == nullptr))
            throw std::invalid_argument("post norms and q/k norms come in pairs");
        l.qkv = projection(qkv, (H_ + 2 * Hkv_) * int64_t(D_), dim_, "qkv");
        l.o = projection(o, dim_, int64_t(H_) * D_, "o");
        l.gate_up = projection(gate_up, 2 * ffn_, dim_, "gate_up");
        l.down = projection(down, dim_, ffn_, "down");
        l.cos = ptr<const float>(cos);
        l.sin = ptr<const float>(sin);
        l.rope_rows = rope_rows;
        l.rope_stride = rope_stride;
        l.rope_dim = rope_dim;
        l.window = window;
        l.softcap = float(softcap);
        layers_.push_back(l);
    }

    void set_cache(int layer, uintptr_t k, uintptr_t v, uintptr_t k_scale, uintptr_t v_scale) {
        Layer& l = layers_.at(size_t(layer));
        l.k_cache = ptr<void>(k);
        l.v_cache = ptr<void>(v);
        l.k_scale = ptr<float>(k_scale);
        l.v_scale = ptr<float>(v_scale);
    }

    int num_layers() const { return int(layers_.size()); }

    // x [T, dim] fp32 (contiguous) is the residual stream: embeddings in, the last layer's output
    // (before the final norm) out. The batch arguments are PagedBatch's tensors (model/paged_batch.py).
    //
    // Synchronisations: each matmul (all of a projection's parts together) and the attention is one
    // parallel region; the row-wise kernels between them are chained inside one region per gap (a
    // norm and the quantization of the next matmul's input; the rotation and the KV write; the
    // activation and its quantization), each row's arithmetic as the kernels run it alone. At one row
    // the row-wise regions run inline: a decode step of one sequence synchronises at its five (or
    // four) matmuls and attentions per layer.
    void forward(uintptr_t x_addr, int64_t T, uintptr_t positions, uintptr_t slot_mapping, uintptr_t cu_rows,
                 uintptr_t start_pos, int S, uintptr_t block_tables, int64_t table_width, int block_size) {
        if (T <= 0) return;
        for (const Layer& l : layers_)
            if (l.k_cache == nullptr || l.v_cache == nullptr) throw std::logic_error("set_cache before forward");
        const int64_t* slots = ptr<const int64_t>(slot_mapping);
        entry::check_kv_write(T, cache_type_, num_slots_, slots);  // what throws, before any region runs
        for (const Layer& l : layers_) entry::check_rope_positions(rope_of(l, positions), T);
        reserve(T);
        float* x = ptr<float>(x_addr);
        const int64_t n_qkv = (H_ + 2 * Hkv_) * int64_t(D_);
        float *h = h_.data(), *qkv = qkv_.data(), *att = att_.data(), *o = o_.data(), *gu = gu_.data(),
              *act = act_.data();
        uint8_t* acts = acts_.data();  // the next matmul's quantized input (reserve() sized it)
        const int64_t norm_grain = std::min(entry::row_grain(dim_), entry::quantize_grain());
        const int64_t act_grain = std::min(entry::row_grain(ffn_), entry::quantize_grain());
        const int64_t rope_grain = std::min(entry::row_grain((H_ + Hkv_) * int64_t(D_)), entry::kv_write_grain(Hkv_));
        Clock clock(profiling_ ? &seconds_ : nullptr);
        parallel_for(T, norm_grain, [&](int64_t b, int64_t e) {
            entry::rms_norm_rows(x, dim_, layers_[0].attn_norm, h, dim_, dim_, eps_, b, e);
            entry::quantize_row_range(h, dim_, dim_, acts, b, e);
        });
        clock.lap(NORMS);
        for (size_t i = 0; i < layers_.size(); ++i) {
            const Layer& l = layers_[i];
            matmul(l.qkv, acts, T, qkv);
            clock.lap(QKV);
            const entry::Heads qk{qkv, n_qkv, D_, T, H_ + Hkv_, D_};
            const entry::RopeTable rope = rope_of(l, positions);
            const float* k = qkv + int64_t(H_) * D_;
            const float* v = k + int64_t(Hkv_) * D_;
            parallel_for(T, rope_grain, [&](int64_t b, int64_t e) {
                if (l.qkv_bias != nullptr)  // the per-op path's `y + bias`: one float add an element
                    for (int64_t r = b; r < e; ++r)
                        for (int64_t j = 0; j < n_qkv; ++j) qkv[r * n_qkv + j] += l.qkv_bias[j];
                if (l.q_norm != nullptr)
                    entry::head_rms_norm_rope_rows(qk, H_, l.q_norm, l.k_norm, eps_, rope, b, e);
                else
                    entry::rope_rows(qk, rope, b, e);
                entry::write_kv_tokens(k, n_qkv, D_, v, n_qkv, D_, Hkv_, D_, l.k_cache, l.v_cache, l.k_scale,
                                       l.v_scale, cache_type_, num_slots_, slots, b, e);
            });
            clock.lap(ROPE_KV_WRITE);
            entry::paged_attention(qkv, n_qkv, D_, att, T, H_, D_, l.k_cache, l.v_cache, l.k_scale, l.v_scale,
                                   cache_type_, Hkv_, num_slots_, ptr<const int32_t>(cu_rows),
                                   ptr<const int32_t>(start_pos), S, ptr<const int32_t>(block_tables), table_width,
                                   block_size, scale_, l.window, l.softcap);
            clock.lap(ATTENTION);
            entry::quantize_rows(att, T, l.o.K, l.o.K, acts);
            matmul(l.o, acts, T, o);
            clock.lap(O_PROJ);
            parallel_for(T, norm_grain, [&](int64_t b, int64_t e) {
                if (l.post_attn_norm != nullptr) entry::rms_norm_rows(o, dim_, l.post_attn_norm, o, dim_, dim_, eps_, b, e);
                scale_residual(o, b, e);
                entry::add_rms_norm_rows(o, dim_, x, dim_, l.ffn_norm, h, dim_, dim_, eps_, b, e);
                entry::quantize_row_range(h, dim_, dim_, acts, b, e);
            });
            clock.lap(NORMS);
            matmul(l.gate_up, acts, T, gu);
            clock.lap(GATE_UP);
            parallel_for(T, act_grain, [&](int64_t b, int64_t e) {
                entry::gated_rows(activation_, gu, 2 * ffn_, act, ffn_, ffn_, b, e);
                entry::quantize_row_range(act, ffn_, ffn_, acts, b, e);
            });
            clock.lap(ACTIVATION);
            matmul(l.down, acts, T, o);
            clock.lap(DOWN);
            const Layer* next = i + 1 < layers_.size() ? &layers_[i + 1] : nullptr;
            parallel_for(T, norm_grain, [&](int64_t b, int64_t e) {
                if (l.post_ffn_norm != nullptr) entry::rms_norm_rows(o, dim_, l.post_ffn_norm, o, dim_, dim_, eps_, b, e);
                scale_residual(o, b, e);
                if (next != nullptr) {
                    entry::add_rms_norm_rows(o, dim_, x, dim_, next->attn_norm, h, dim_, dim_, eps_, b, e);
                    entry::quantize_row_range(h, dim_, dim_, acts, b, e);
                } else {
                    for (int64_t j = b * dim_; j < e * dim_; ++j) x[j] += o[j];
                }
            });
            clock.lap(NORMS);
        }
    }

    // Granite's residual multiplier: each block's output times it before it joins the residual stream
    // (the per-op path's `a * scale`, one rounding, as here).
    void set_residual_scale(double scale) { residual_scale_ = float(scale); }

    // The final norm and the output head (the model's logits), when both can run natively.
    void set_head(uintptr_t norm, const std::vector<PartSpec>& parts) {
        int64_t n = 0;
        for (const auto& part : parts) n += std::get<4>(part);
        head_ = projection(parts, n, dim_, "head");
        head_norm_ = ptr<const float>(norm);
    }

    bool has_head() const { return head_norm_ != nullptr; }
    int64_t vocab() const { return head_.N; }

    // out [n_rows, vocab] fp32 = head(final_norm(x[rows])): the logits of the rows that sample, from
    // the residual stream forward() left in x ([T, dim]); rows == 0 means all T. The per-op path's
    // kernels (rms_norm, quantize_activations, qmatmul) row for row, so the logits are bitwise its;
    // one call instead of several from Python between a step's layers and its sampler.
    void logits(uintptr_t x_addr, int64_t T, uintptr_t rows_addr, int64_t n_rows, uintptr_t out_addr) {
        const uint8_t* acts = head_input(x_addr, T, rows_addr, n_rows);
        if (acts != nullptr) matmul(head_, acts, n_rows, ptr<float>(out_addr));
    }

    // tokens [n_rows] int64 = each row's greedy token, the argmax of logits(): the bounded head kernel
    // (head_argmax.cpp) on the same normed, quantized rows, so bitwise what the per-op path's
    // final_hidden and GreedyHead give. norms, coarse: the GreedyHead's block norms and 6-bit copy (0
    // for none) of this step's head, which must be one Q8_0 part (qs: its blocks, checked); excluded:
    // int64 [num_excluded] ids no row may take. Saves a single-stream step the Python between the two
    // calls (~0.1 ms of 3 on a 2-core box: its final norm, quantization and checks, run cold).
    void greedy(uintptr_t x_addr, int64_t T, uintptr_t rows_addr, int64_t n_rows, uintptr_t qs, uintptr_t norms,
                uintptr_t coarse, uintptr_t excluded, int64_t num_excluded, uintptr_t out_addr) {
        if (head_norm_ == nullptr) throw std::logic_error("set_head before greedy");
        if (head_.parts.size() != 1 || head_.parts[0].type != qmm::Q8_0 || head_.parts[0].qs != ptr<const uint8_t>(qs))
            throw std::invalid_argument("greedy: the head is not that one Q8_0 weight");
        const uint8_t* acts = head_input(x_addr, T, rows_addr, n_rows);
        if (acts == nullptr) return;
        const QuantizedPart& w = head_.parts[0];
        if (!entry::head_argmax(acts, n_rows, dim_, w.qs, w.sc, w.N, ptr<const float>(norms), ptr<int64_t>(out_addr),
                                ptr<const uint8_t>(coarse), ptr<const int64_t>(excluded), num_excluded))
            throw std::logic_error("greedy: this build has no head_argmax kernel");
    }

    void set_profiling(bool on) { profiling_ = on; }

    // Seconds per phase since the last call (and resets them).
    std::map<std::string, double> take_profile() {
        std::map<std::string, double> out;
        for (int p = 0; p < NUM_PHASES; ++p) out[kPhaseNames[p]] = seconds_[p];
        seconds_.fill(0.0);
        return out;
    }

private:
    // The head's input: rows `rows` of x (0: all T) through the final norm, quantized as
    // quantize_activations does; nullptr when there are no rows. Checks the rows first.
    const uint8_t* head_input(uintptr_t x_addr, int64_t T, uintptr_t rows_addr, int64_t n_rows) {
        if (head_norm_ == nullptr) throw std::logic_error("set_head before logits");
        const int64_t* rows = ptr<const int64_t>(rows_addr);
        if (rows != nullptr) {
            for (int64_t r = 0; r < n_rows; ++r)
                if (rows[r] < 0 || rows[r] >= T) throw std::out_of_range("a sampled row is outside the step");
        } else if (n_rows != T) {
            throw std::invalid_argument("without rows, every row of the step samples");
        }
        if (n_rows <= 0) return nullptr;
        reserve(n_rows);
        const float* x = ptr<const float>(x_addr);
        float* h = h_.data();
        uint8_t* acts = acts_.data();
        const int64_t norm_grain = std::min(entry::row_grain(dim_), entry::quantize_grain());
        parallel_for(n_rows, norm_grain, [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) {
                const float* row = x + (rows != nullptr ? rows[r] : r) * dim_;
                entry::rms_norm_rows(row, dim_, head_norm_, h + r * dim_, dim_, dim_, eps_, 0, 1);
            }
            entry::quantize_row_range(h, dim_, dim_, acts, b, e);
        });
        return acts;
    }

    struct Clock {
        std::array<double, NUM_PHASES>* totals;
        std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
        explicit Clock(std::array<double, NUM_PHASES>* t) : totals(t) {}
        void lap(Phase p) {
            if (totals == nullptr) return;
            const auto now = std::chrono::steady_clock::now();
            (*totals)[p] += std::chrono::duration<double>(now - last).count();
            last = now;
        }
    };

    Projection projection(const std::vector<PartSpec>& specs, int64_t N, int64_t K, const char* name) {
        Projection p;
        p.K = K;
        for (const auto& [type, qs, sc, sup, n, k] : specs) {
            if (k != K) throw std::invalid_argument(std::string(name) + ": a part's K differs from the layer's");
            p.parts.push_back({type, ptr<const uint8_t>(qs), ptr<const uint8_t>(sc), ptr<const uint8_t>(sup), n, p.N});
            p.N += n;
        }
        if (p.parts.empty() || p.parts.size() > size_t(kMaxParts))
            throw std::invalid_argument(std::string(name) + ": a projection needs 1 to " + std::to_string(kMaxParts) +
                                        " parts");
        if (p.N != N) throw std::invalid_argument(std::string(name) + ": parts have " + std::to_string(p.N) +
                                                  " rows, the layer needs " + std::to_string(N));
        return p;
    }

    // y = acts @ W^T for every part of a projection, in one region. One quantization of the input
    // serves every part (model/quantized.py QuantizedParts.matmul).
    void matmul(const Projection& p, const uint8_t* acts, int64_t T, float* out) {
        entry::MatmulPart parts[kMaxParts];
        for (size_t i = 0; i < p.parts.size(); ++i) {
            const QuantizedPart& q = p.parts[i];
            parts[i] = {q.type, q.qs, q.sc, q.sup, q.N, out + q.col};
        }
        entry::qmatmul_parts(parts, int(p.parts.size()), acts, T, p.K, p.N);
    }

    entry::RopeTable rope_of(const Layer& l, uintptr_t positions) const {
        return {ptr<const int64_t>(positions), l.cos, l.sin, l.rope_stride, l.rope_rows, l.rope_dim};
    }

    void reserve(int64_t T) {
        if (T <= rows_) return;
        const int64_t n_qkv = (H_ + 2 * Hkv_) * int64_t(D_), widest = std::max({dim_, ffn_, int64_t(H_) * D_});
        h_.assign(size_t(T * dim_), 0.f);
        qkv_.assign(size_t(T * n_qkv), 0.f);
        att_.assign(size_t(T * H_ * D_), 0.f);
        o_.assign(size_t(T * dim_), 0.f);
        gu_.assign(size_t(T * 2 * ffn_), 0.f);
        act_.assign(size_t(T * ffn_), 0.f);
        acts_.get(size_t(T * entry::act_row_bytes(widest)));
        rows_ = T;
    }

    int64_t dim_;
    int H_, Hkv_, D_;
    int64_t ffn_;
    float eps_;
    int activation_;
    float scale_;
    float residual_scale_ = 1.0f;

    void scale_residual(float* o, int64_t b, int64_t e) const {
        if (residual_scale_ != 1.0f)
            for (int64_t j = b * dim_; j < e * dim_; ++j) o[j] *= residual_scale_;
    }
    int cache_type_;
    int64_t num_slots_;
    std::vector<Layer> layers_;
    Projection head_;
    const float* head_norm_ = nullptr;
    int64_t rows_ = 0;
    std::vector<float> h_, qkv_, att_, o_, gu_, act_;
    LineBuffer<uint8_t> acts_;  // on a line: AMX loads 32-byte halves of its rows, which must not straddle two
    bool profiling_ = false;
    std::array<double, NUM_PHASES> seconds_{};
};

}  // namespace
}  // namespace tmk

void register_decoder_step(py::module_& m) {
    using namespace pybind11::literals;
    using tmk::DecoderStep;
    auto nogil = py::call_guard<py::gil_scoped_release>();
    py::class_<DecoderStep>(m, "DecoderStep", "every layer of a decoder step in one call (model/native_step.py)")
        .def(py::init<int64_t, int, int, int, int64_t, double, int, double, int, int64_t>(), "dim"_a, "n_heads"_a,
             "n_kv_heads"_a, "head_dim"_a, "ffn_dim"_a, "eps"_a, "activation"_a, "scale"_a, "cache_type"_a,
             "num_slots"_a)
        .def("add_layer", &DecoderStep::add_layer, "attn_norm"_a, "ffn_norm"_a, "post_attn_norm"_a,
             "post_ffn_norm"_a, "q_norm"_a, "k_norm"_a, "qkv_bias"_a, "qkv"_a, "o"_a, "gate_up"_a, "down"_a, "cos"_a, "sin"_a,
             "rope_rows"_a, "rope_stride"_a, "rope_dim"_a, "window"_a, "softcap"_a = 0.0)
        .def("set_cache", &DecoderStep::set_cache, "layer"_a, "k"_a, "v"_a, "k_scale"_a, "v_scale"_a)
        .def("set_residual_scale", &DecoderStep::set_residual_scale, "scale"_a)
        .def_property_readonly("num_layers", &DecoderStep::num_layers)
        .def("set_head", &DecoderStep::set_head, "norm"_a, "parts"_a)
        .def_property_readonly("has_head", &DecoderStep::has_head)
        .def_property_readonly("vocab", &DecoderStep::vocab)
        .def("logits", &DecoderStep::logits, nogil, "x"_a, "T"_a, "rows"_a, "n_rows"_a, "out"_a)
        .def("greedy", &DecoderStep::greedy, nogil, "x"_a, "T"_a, "rows"_a, "n_rows"_a, "qs"_a, "norms"_a, "coarse"_a,
             "excluded"_a, "num_excluded"_a, "out"_a)
        .def("set_profiling", &DecoderStep::set_profiling, "on"_a, "time each phase of the following steps")
        .def("take_profile", &DecoderStep::take_profile, "seconds per phase since the last call")
        .def("forward", &DecoderStep::forward, nogil, "x"_a, "T"_a, "positions"_a, "slot_mapping"_a, "cu_rows"_a,
             "start_pos"_a, "S"_a, "block_tables"_a, "table_width"_a, "block_size"_a);
}
