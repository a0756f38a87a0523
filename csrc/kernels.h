// The kernel entry points that other translation units call (decoder_step.cpp chains them into a
// whole decoder step). Each is defined at the end of its kernel family's file, over raw pointers,
// and is exactly what that family's Python binding runs, so a chained step is bitwise the same as
// the per-op path.
#pragma once

#include <cstdint>

namespace tmk::entry {

// qmatmul.cpp: activations fp32 [M, K] -> int8 rows (Acts layout), and y [M, N] = acts @ W^T.
int64_t act_row_bytes(int64_t K);
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, uint8_t* out);
void qmatmul(int type, const uint8_t* acts, int64_t M, int64_t K, const uint8_t* qs, const uint8_t* sc,
             const uint8_t* sup, int64_t N, float* out, int64_t ldo);

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
void rms_norm(const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride, int64_t rows,
              int64_t dim, float eps);
void add_rms_norm(const float* x, int64_t x_stride, float* residual, int64_t res_stride, const float* w, float* y,
                  int64_t y_stride, int64_t rows, int64_t dim, float eps);
void rope_qk(const Heads& qk, const RopeTable& rope);
void head_rms_norm_rope(const Heads& qk, int64_t n_q_heads, const float* q_weight, const float* k_weight, float eps,
                        const RopeTable& rope);
enum Activation : int { SILU = 0, GELU_TANH = 1 };
void gated(int activation, const float* gate_up, int64_t gu_stride, float* out, int64_t out_stride, int64_t rows,
           int64_t features);

// kv_write.cpp: fp32 K/V rows [T, Hkv, D] into their cache slots (cache_type 0 fp32, 1 bf16, 2 int8, 3 fp16).
void write_kv(const float* k, int64_t k_row_stride, int64_t k_head_stride, const float* v, int64_t v_row_stride,
              int64_t v_head_stride, int64_t T, int Hkv, int D, void* k_cache, void* v_cache, float* k_scale,
              float* v_scale, int cache_type, int64_t num_slots, const int64_t* slot_mapping);

// paged_attention.cpp: out [T, H, D] = attention of q rows over the paged cache.
void paged_attention(const float* q, int64_t q_row_stride, int64_t q_head_stride, float* out, int64_t T, int H, int D,
                     const void* k_cache, const void* v_cache, const float* k_scale, const float* v_scale,
                     int cache_type, int Hkv, int64_t num_slots, const int32_t* cu_rows, const int32_t* start_pos,
                     int S, const int32_t* block_tables, int64_t table_width, int block_size, float scale, int window);

}  // namespace tmk::entry
