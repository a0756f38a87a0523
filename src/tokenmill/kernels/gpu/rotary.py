"""Rotary embedding of a step's q and k heads in place, as one Triton kernel (the PyTorch path is a
gather, two casts, a multiply, a concatenation and an addcmul per layer), optionally after Gemma 3's
RMSNorm of each head (q heads with q_weight, k heads with k_weight), which it folds in too; and
optionally the KV write (cache_write.py's) of the rotated k heads and the v heads that follow them in
the projection, so a decode layer spends one kernel on all of it.

One program per (token, head). Half-split layout over the first rope_dim dims: dim i pairs with
i + rope_dim/2; cos/sin are the float32 tables [max_positions, rope_dim] (sin signed, as
RotaryEmbedding keeps them), rounded to the activations' dtype as the PyTorch path rounds them, and
out = round(round(x cos) + x_partner sin) as its `addcmul(x * cos, rotate(x), sin)` computes."""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rope_head(base, d, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, t, h, stride_table, head_dim, rope_dim,
               n_q_heads, eps, HEAD_NORM: tl.constexpr):
    """One q or k head at base, rotated in place (after its RMSNorm with HEAD_NORM); returns the row."""
    dtype = base.dtype.element_ty
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
    out = tl.where(rotated, xc + xp * s, x).to(dtype)
    tl.store(base + d, out, mask=in_head)
    return out


@triton.jit
def _rope_kernel(qk_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                 stride_t, stride_h, stride_table, stride_kch, stride_kcs, stride_vch, stride_vcs, head_dim, rope_dim,
                 n_q_heads, n_kv_heads,
                 eps, HEAD_NORM: tl.constexpr, WRITE_KV: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = qk_ptr + t * stride_t + h.to(tl.int64) * stride_h
    d = tl.arange(0, BLOCK_D)
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        keep = (d < head_dim) & (slot >= 0)
        if h >= n_q_heads + n_kv_heads:  # a v head: into the cache as it is
            v = tl.load(base + d, mask=keep, other=0.0)
            kv_head = (h - n_q_heads - n_kv_heads).to(tl.int64)
            tl.store(v_cache_ptr + kv_head * stride_vch + slot * stride_vcs + d, v.to(v_cache_ptr.dtype.element_ty),
                     mask=keep)
        else:
            out = _rope_head(base, d, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, t, h, stride_table, head_dim,
                             rope_dim, n_q_heads, eps, HEAD_NORM)
            if h >= n_q_heads:  # a k head, rotated: into the cache too
                kv_head = (h - n_q_heads).to(tl.int64)
                tl.store(k_cache_ptr + kv_head * stride_kch + slot * stride_kcs + d,
                         out.to(k_cache_ptr.dtype.element_ty), mask=keep)
    else:
        _rope_head(base, d, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, t, h, stride_table, head_dim, rope_dim,
                   n_q_heads, eps, HEAD_NORM)


def rope_triton(qk: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, head_norm: tuple | None = None,
                kv_write: tuple | None = None) -> None:
    """qk [T, heads, head_dim] (unit stride along head_dim) in place; head_norm: (n_q_heads, q_weight,
    k_weight, eps) for Gemma 3's per-head RMSNorm first. kv_write: (n_q_heads, n_kv_heads, k_cache,
    v_cache, slot_mapping), with qk then holding the v heads too ([T, n_q + 2 n_kv, D]): the k heads
    (rotated) and v heads go to their slots of the caches [Hkv, slots, D] (slot < 0: nowhere)."""
    tokens, heads, head_dim = qk.shape
    if tokens == 0 or heads == 0:
        return
    n_q, q_w, k_w, eps = head_norm if head_norm is not None else (0, cos, cos, 0.0)
    if kv_write is not None:
        n_q, n_kv, k_cache, v_cache, slots = kv_write
        cache_strides = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    else:
        n_kv, k_cache, v_cache, slots, cache_strides = 0, qk, qk, positions, (0, 0, 0, 0)
    _rope_kernel[(tokens, heads)](
        qk, positions, cos, sin, q_w, k_w, k_cache, v_cache, slots, qk.stride(0), qk.stride(1), cos.stride(0),
        *cache_strides, head_dim, cos.shape[-1], n_q, n_kv, float(eps), HEAD_NORM=head_norm is not None,
        WRITE_KV=kv_write is not None, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1)
