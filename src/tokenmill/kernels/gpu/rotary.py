"""Rotary embedding of a step's q and k heads in place, as one Triton kernel (the PyTorch path is a
gather, two casts, a multiply, a concatenation and an addcmul per layer), optionally after Gemma 3's
RMSNorm of each head (q heads with q_weight, k heads with k_weight), which it folds in too.

One program per (token, head). Half-split layout over the first rope_dim dims: dim i pairs with
i + rope_dim/2; cos/sin are the float32 tables [max_positions, rope_dim] (sin signed, as
RotaryEmbedding keeps them), rounded to the activations' dtype as the PyTorch path rounds them, and
out = round(round(x cos) + x_partner sin) as its `addcmul(x * cos, rotate(x), sin)` computes."""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rope_kernel(qk_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, stride_t, stride_h, stride_table,
                 head_dim, rope_dim, n_q_heads, eps, HEAD_NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dtype = qk_ptr.dtype.element_ty
    base = qk_ptr + t * stride_t + h.to(tl.int64) * stride_h
    d = tl.arange(0, BLOCK_D)
    in_head = d < head_dim
    half = rope_dim // 2
    partner = tl.where(d < half, d + half, d - half)
    rotated = d < rope_dim
    x = tl.load(base + d, mask=in_head, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=rotated, other=0.0).to(tl.float32)
    if HEAD_NORM:
        inv = tl.rsqrt(tl.sum(x * x, 0) / head_dim + eps)
        if h < n_q_heads:
            w = tl.load(q_w_ptr + d, mask=in_head, other=0.0).to(tl.float32)
            wp = tl.load(q_w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        else:
            w = tl.load(k_w_ptr + d, mask=in_head, other=0.0).to(tl.float32)
            wp = tl.load(k_w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        x = (x * inv * w).to(dtype).to(tl.float32)
        xp = (xp * inv * wp).to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_table + d, mask=rotated, other=1.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_table + d, mask=rotated, other=0.0).to(dtype).to(tl.float32)
    xc = (x * c).to(dtype).to(tl.float32)
    out = tl.where(rotated, xc + xp * s, x)
    tl.store(base + d, out.to(dtype), mask=in_head)


def rope_triton(qk: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, head_norm: tuple | None = None) -> None:
    """qk [T, heads, head_dim] (unit stride along head_dim) in place; head_norm: (n_q_heads, q_weight,
    k_weight, eps) for Gemma 3's per-head RMSNorm first."""
    tokens, heads, head_dim = qk.shape
    if tokens == 0 or heads == 0:
        return
    n_q, q_w, k_w, eps = head_norm if head_norm is not None else (0, cos, cos, 0.0)
    _rope_kernel[(tokens, heads)](
        qk, positions, cos, sin, q_w, k_w, qk.stride(0), qk.stride(1), cos.stride(0), head_dim, cos.shape[-1],
        n_q, float(eps), HEAD_NORM=head_norm is not None, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1)
