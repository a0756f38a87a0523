// The kernel entry points that other translation units call (decoder_step.cpp chains them into a
// whole decoder step). Each is defined at the end of its kernel family's file, over raw pointers,
// and is exactly what that family's Python binding runs, so a chained step is bitwise the same as
// the per-op path.
#pragma once

#include <cstdint>

namespace tmk::entry {

// A family's `*_rows` / `*_range` function runs rows [b, e) of its kernel on the calling thread, and
// `*_grain` is the kernel's own parallel_for grain (rows): decoder_step.cpp chains row-wise kernels
// inside one region with them.

// qmatmul.cpp: activations fp32 [M, K] -> int8 rows (Acts layout), and y [M, N] = acts @ W^T.
int64_t act_row_bytes(int64_t K);
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, uint8_t* out);
void quantize_row_range(const float* x, int64_t K, int64_t ldx, uint8_t* out, int64_t m0, int64_t m1);
int64_t quantize_grain();
void qmatmul(int type, const uint8_t* acts, int64_t M, int64_t K, const uint8_t* qs, const uint8_t* sc,
             const uint8_t* sup, int64_t N, float* out, int64_t ldo);
struct MatmulPart {  // one GGUF type's rows of a projection, written to out (row stride: qmatmul_parts' ldo)
    int type;
    const uint8_t *qs, *sc, *sup;
    int64_t N;
    float* out;
};
// Every part's y = acts @ W^T in one region (each part's tiles exactly as qmatmul would run them).
void qmatmul_parts(const MatmulPart* parts, int n, const uint8_t* acts, int64_t M, int64_t K, int64_t ldo);

// head_argmax.cpp: tokens [M] = the argmax of acts [M, K] @ a repacked Q8_0 head [N, K]^T (torch.max's
// index; norms, coarse, excluded as the binding takes them). The AVX-512 build only: elsewhere it
// returns false and writes nothing.
bool head_argmax(const uint8_t* acts, int64_t M, int64_t K, const uint8_t* qs, const uint8_t* sc, int64_t N,
                 const float* norms, int64_t* tokens, const uint8_t* coarse, const int64_t* excluded,
                 int64_t num_excluded);

// fused_ops.cpp
struct Heads {  // [tokens, heads, head_dim] fp32, unit stride along head_dim
    float* base;
    int64_t token_stride, head_stride, tokens, heads, head_dim;
};
struct RopeTable {  // cos / sin [rows, rope_dim] (row stride `stride`), indexed by positions [tokens]
    const int64_t* positions;
    const float* cos;
    const float* sin;
    int64_t stride, rows, rope_dim;
};
int64_t row_grain(int64_t elements_per_row);  // the fused ops' grain for rows of that many floats
void rms_norm(const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride, int64_t rows,
              int64_t dim, float eps);
void rms_norm_rows(const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride, int64_t dim,
                   float eps, int64_t b, int64_t e);
void add_rms_norm(const float* x, int64_t x_stride, float* residual, int64_t res_stride, const float* w, float* y,
                  int64_t y_stride, int64_t rows, int64_t dim, float eps);
void add_rms_norm_rows(const float* x, int64_t x_stride, float* residual, int64_t res_stride, const float* w, float* y,
                       int64_t y_stride, int64_t dim, float eps, int64_t b, int64_t e);
void rope_qk(const Heads& qk, const RopeTable& rope);
void head_rms_norm_rope(const Heads& qk, int64_t n_q_heads, const float* q_weight, const float* k_weight, float eps,
                        const RopeTable& rope);
void check_rope_positions(const RopeTable& rope, int64_t tokens);  // throws; the *_rows below do not check
void rope_rows(const Heads& qk, const RopeTable& rope, int64_t b, int64_t e);
void head_rms_norm_rope_rows(const Heads& qk, int64_t n_q_heads, const float* q_weight, const float* k_weight,
                             float eps, const RopeTable& rope, int64_t b, int64_t e);
enum Activation : int { SILU = 0, GELU_TANH = 1 };
void gated(int activation, const float* gate_up, int64_t gu_stride, float* out, int64_t out_stride, int64_t rows,
           int64_t features);
void gated_rows(int activation, const float* gate_up, int64_t gu_stride, float* out, int64_t out_stride,
                int64_t features, int64_t b, int64_t e);

// kv_write.cpp: fp32 K/V rows [T, Hkv, D] into their cache slots (cache_type 0 fp32, 1 bf16, 2 int8, 3 fp16).
void write_kv(const float* k, int64_t k_row_stride, int64_t k_head_stride, const float* v, int64_t v_row_stride,
              int64_t v_head_stride, int64_t T, int Hkv, int D, void* k_cache, void* v_cache, float* k_scale,
              float* v_scale, int cache_type, int64_t num_slots, const int64_t* slot_mapping);
// The same split in two: the checks (throwing), then tokens [b, e) on the calling thread.
void check_kv_write(int64_t T, int cache_type, int64_t num_slots, const int64_t* slot_mapping);
void write_kv_tokens(const float* k, int64_t k_row_stride, int64_t k_head_stride, const float* v, int64_t v_row_stride,
                     int64_t v_head_stride, int Hkv, int D, void* k_cache, void* v_cache, float* k_scale,
                     float* v_scale, int cache_type, int64_t num_slots, const int64_t* slot_mapping, int64_t b,
                     int64_t e);
int64_t kv_write_grain(int Hkv);  // tokens

// paged_attention.cpp: out [T, H, D] = attention of q rows over the paged cache.
void paged_attention(const float* q, int64_t q_row_stride, int64_t q_head_stride, float* out, int64_t T, int H, int D,
                     const void* k_cache, const void* v_cache, const float* k_scale, const float* v_scale,
                     int cache_type, int Hkv, int64_t num_slots, const int32_t* cu_rows, const int32_t* start_pos,
                     int S, const int32_t* block_tables, int64_t table_width, int block_size, float scale, int window,
                     float softcap);

}  // namespace tmk::entry
