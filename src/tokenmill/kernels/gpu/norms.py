"""RMSNorm as one Triton kernel per call, with a decoder block's residual step folded in: a step of
SmolLM2 on the GPU otherwise spends ~7 small kernels on each norm (cast, square, mean, add, rsqrt,
two multiplies), ~1,000 kernel nodes in a decode graph whose launch and GPU time grow with them.

One program per row (a row never depends on the batch). The arithmetic follows the PyTorch path in
the activations' dtype: the normalised row in float32, then either rounded to the dtype and
multiplied by the weight (Llama's RMSNorm), or multiplied by the weight in float32 and rounded once
(`weight_f32`, Gemma's); the residual sum is rounded to the dtype as `x + a` rounds it.

    out = post(residual += pre(a))     pre, post: optional norms; residual updated in place"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _normed(x, w_ptr, cols, mask, dim, eps, WEIGHT_F32: tl.constexpr, DTYPE: tl.constexpr):
    """x (float32, zeros past dim) normalised and weighted, rounded to DTYPE, returned as float32."""
    inv = tl.rsqrt(tl.sum(x * x, 0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * inv
    if WEIGHT_F32:
        return (y * w).to(DTYPE).to(tl.float32)
    return (y.to(DTYPE).to(tl.float32) * w).to(DTYPE).to(tl.float32)


@triton.jit
def _residual_norm_kernel(a_ptr, res_ptr, out_ptr, pre_w_ptr, post_w_ptr, stride_a, stride_r, stride_o, dim,
                          pre_eps, post_eps, PRE: tl.constexpr, PRE_F32: tl.constexpr, RESIDUAL: tl.constexpr,
                          POST: tl.constexpr, POST_F32: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = a_ptr.dtype.element_ty
    x = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    if PRE:
        x = _normed(x, pre_w_ptr, cols, mask, dim, pre_eps, PRE_F32, dtype)
    if RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (r + x).to(dtype).to(tl.float32)
        tl.store(res_ptr + row * stride_r + cols, x.to(dtype), mask=mask)
    if POST:
        y = _normed(x, post_w_ptr, cols, mask, dim, post_eps, POST_F32, dtype)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def residual_norm_triton(a: Tensor, residual: Tensor | None, out: Tensor | None, pre: tuple | None,
                         post: tuple | None) -> None:
    """a, residual, out: [rows, dim] with unit inner stride; pre/post: (weight, eps, weight_f32) or None."""
    rows, dim = a.shape
    if rows == 0:
        return
    dummy = a
    pre_w, pre_eps, pre_f32 = pre if pre is not None else (dummy, 0.0, False)
    post_w, post_eps, post_f32 = post if post is not None else (dummy, 0.0, False)
    res = residual if residual is not None else a
    dst = out if out is not None else a
    block = triton.next_power_of_2(dim)
    _residual_norm_kernel[(rows,)](
        a, res, dst, pre_w, post_w, a.stride(0), res.stride(0), dst.stride(0), dim, float(pre_eps), float(post_eps),
        PRE=pre is not None, PRE_F32=bool(pre_f32), RESIDUAL=residual is not None, POST=post is not None,
        POST_F32=bool(post_f32), BLOCK=block, num_warps=4 if block <= 2048 else 8)
