"""The small fp32 ops of a decoder layer, each one fused pass (csrc/fused_ops.cpp): RMSNorm, the
pre-norm block's residual add + RMSNorm, rotary embedding of the q and k heads, Gemma 3's per-head
RMSNorm + rotary embedding, and the gated MLP activations (SwiGLU, GeGLU with tanh GELU).

Each public function calls the compiled kernel directly in eager mode (a custom-op dispatch would
cost more than the kernel at one sequence) and the `tokenmill::` custom op while torch.compile
traces. Inputs the kernels do not take (another dtype, a non-unit inner stride, no extension) run the
PyTorch reference of the same signature, which is also the tests' oracle.

Numerics: fp32 throughout; each row's sum of squares is accumulated in an order fixed by the row
length, so a row's result never depends on the batch size or the thread count. The SIMD exp is
within 1 ulp of float64 exp; GELU is computed as g / (1 + exp(-2u)), the same function as
g/2 (1 + tanh(u)) without its cancellation for negative g."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenmill.kernels import native

__all__ = ["add_rms_norm", "gelu_tanh_mul", "head_rms_norm_rope", "rms_norm", "rope_qk", "silu_mul"]


# ---- PyTorch references: the oracle, and the path when the kernels cannot run --------------------

def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if out is None else out.copy_(y)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    residual.add_(x)
    return rms_norm_reference(residual, weight, eps)


def rope_qk_reference(qk: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> None:
    rope_dim = cos.shape[-1]
    part = qk[..., :rope_dim]
    c, s = cos[positions].to(qk.dtype).unsqueeze(1), sin[positions].to(qk.dtype).unsqueeze(1)
    x1, x2 = part.chunk(2, dim=-1)
    part.copy_(torch.addcmul(part * c, torch.cat((x2, x1), dim=-1), s))


def head_rms_norm_rope_reference(qk: Tensor, n_q_heads: int, q_weight: Tensor, k_weight: Tensor, eps: float,
                                 positions: Tensor, cos: Tensor, sin: Tensor) -> None:
    qk[:, :n_q_heads] = rms_norm_reference(qk[:, :n_q_heads], q_weight, eps)
    qk[:, n_q_heads:] = rms_norm_reference(qk[:, n_q_heads:], k_weight, eps)
    rope_qk_reference(qk, positions, cos, sin)


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul_reference(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# ---- what the kernels can read in place ----------------------------------------------------------

def _rows(t: Tensor) -> Tensor | None:
    """t as fp32 rows [n, t.shape[-1]] with unit inner stride and disjoint rows, sharing t's memory;
    None when the kernels cannot address it that way. (Cheap attribute reads only: this runs on every
    eager call, where a microsecond is a sizeable share of the op.)"""
    if t.dtype is not torch.float32 or not t.is_cpu:
        return None
    shape = t.shape
    if len(shape) == 2:
        stride = t.stride()
        return t if stride[1] == 1 and (stride[0] >= shape[1] or shape[0] <= 1) else None
    return t.view(-1, shape[-1]) if len(shape) and t.is_contiguous() else None


def _vector(w: Tensor, n: int) -> bool:
    return w.dtype is torch.float32 and w.is_cpu and w.shape == (n,) and w.is_contiguous()


def _heads(qk: Tensor) -> bool:
    """qk [T, heads, head_dim] fp32 with unit inner stride and heads that do not overlap."""
    if qk.dtype is not torch.float32 or not qk.is_cpu or qk.dim() != 3:
        return False
    (tokens, heads, head_dim), (st, sh, sd) = qk.shape, qk.stride()
    return sd == 1 and sh >= head_dim and (tokens <= 1 or st >= heads * sh)


def _tables(qk: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> bool:
    rope_dim = cos.shape[-1]
    return positions.dtype is torch.int64 and positions.shape == qk.shape[:1] and positions.is_contiguous() \
        and cos.dtype is torch.float32 and sin.dtype is torch.float32 and cos.dim() == 2 and cos.stride()[1] == 1 \
        and sin.shape == cos.shape and sin.stride() == cos.stride() and rope_dim % 2 == 0 and rope_dim <= qk.shape[2]


# ---- eager implementations: the kernel when it applies, else the reference -----------------------

def _rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None) -> Tensor:
    m = native.module()
    xr = _rows(x) if m is not None else None
    if xr is None or not _vector(weight, x.shape[-1]):
        return rms_norm_reference(x, weight, eps, out)
    rows, dim = xr.shape
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32)
        y_stride = dim
    else:
        yr = _rows(out) if out.shape == x.shape else None
        if yr is None:
            return rms_norm_reference(x, weight, eps, out)
        y_stride = yr.stride()[0]
    m.rms_norm_f32(xr.data_ptr(), xr.stride()[0], weight.data_ptr(), out.data_ptr(), y_stride, rows, dim, eps)
    return out


def _add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    m = native.module()
    xr = _rows(x) if m is not None and x.shape == residual.shape else None
    rr = _rows(residual) if xr is not None else None
    if rr is None or not _vector(weight, x.shape[-1]):
        return add_rms_norm_reference(x, residual, weight, eps)
    rows, dim = rr.shape
    out = torch.empty(x.shape, dtype=torch.float32)
    m.add_rms_norm_f32(xr.data_ptr(), xr.stride()[0], rr.data_ptr(), rr.stride()[0], weight.data_ptr(),
                       out.data_ptr(), dim, rows, dim, eps)
    return out


def _rope_qk(qk: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> None:
    m = native.module()
    if m is None or not _heads(qk) or not _tables(qk, positions, cos, sin):
        return rope_qk_reference(qk, positions, cos, sin)
    (tokens, heads, head_dim), (st, sh, _), (table_rows, rope_dim) = qk.shape, qk.stride(), cos.shape
    m.rope_qk_f32(qk.data_ptr(), st, sh, tokens, heads, head_dim, positions.data_ptr(), cos.data_ptr(),
                  sin.data_ptr(), cos.stride()[0], table_rows, rope_dim)


def _head_rms_norm_rope(qk: Tensor, n_q_heads: int, q_weight: Tensor, k_weight: Tensor, eps: float,
                        positions: Tensor, cos: Tensor, sin: Tensor) -> None:
    m = native.module()
    if m is None or not _heads(qk) or not _tables(qk, positions, cos, sin) or not _vector(q_weight, qk.shape[2]) \
            or not _vector(k_weight, qk.shape[2]) or not 0 <= n_q_heads <= qk.shape[1]:
        return head_rms_norm_rope_reference(qk, n_q_heads, q_weight, k_weight, eps, positions, cos, sin)
    (tokens, heads, head_dim), (st, sh, _), (table_rows, rope_dim) = qk.shape, qk.stride(), cos.shape
    m.head_rms_norm_rope_f32(qk.data_ptr(), st, sh, tokens, heads, head_dim, n_q_heads, q_weight.data_ptr(),
                             k_weight.data_ptr(), eps, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                             cos.stride()[0], table_rows, rope_dim)


def _gated(gate_up: Tensor, kernel: str, reference) -> Tensor:
    m = native.module()
    gu = _rows(gate_up) if m is not None and gate_up.shape[-1] % 2 == 0 else None
    if gu is None:
        return reference(gate_up)
    rows, width = gu.shape
    features = width // 2
    out = torch.empty((*gate_up.shape[:-1], features), dtype=torch.float32)
    getattr(m, kernel)(gu.data_ptr(), gu.stride()[0], out.data_ptr(), features, rows, features)
    return out


# ---- custom ops: what torch.compile traces ------------------------------------------------------

@torch.library.custom_op("tokenmill::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _rms_norm(x, weight, eps, None)


@rms_norm_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tokenmill::rms_norm_out", mutates_args=("out",))
def rms_norm_out_op(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    _rms_norm(x, weight, eps, out)


@rms_norm_out_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    return None


@torch.library.custom_op("tokenmill::add_rms_norm", mutates_args=("residual",))
def add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _add_rms_norm(x, residual, weight, eps)


@add_rms_norm_op.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@torch.library.custom_op("tokenmill::rope_qk", mutates_args=("qk",))
def rope_qk_op(qk: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> None:
    _rope_qk(qk, positions, cos, sin)


@rope_qk_op.register_fake
def _(qk: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> None:
    return None


@torch.library.custom_op("tokenmill::head_rms_norm_rope", mutates_args=("qk",))
def head_rms_norm_rope_op(qk: Tensor, n_q_heads: int, q_weight: Tensor, k_weight: Tensor, eps: float,
                          positions: Tensor, cos: Tensor, sin: Tensor) -> None:
    _head_rms_norm_rope(qk, n_q_heads, q_weight, k_weight, eps, positions, cos, sin)


@head_rms_norm_rope_op.register_fake
def _(qk: Tensor, n_q_heads: int, q_weight: Tensor, k_weight: Tensor, eps: float, positions: Tensor, cos: Tensor,
      sin: Tensor) -> None:
    return None


@torch.library.custom_op("tokenmill::silu_mul", mutates_args=())
def silu_mul_op(gate_up: Tensor) -> Tensor:
    return _gated(gate_up, "silu_mul_f32", silu_mul_reference)


@torch.library.custom_op("tokenmill::gelu_tanh_mul", mutates_args=())
def gelu_tanh_mul_op(gate_up: Tensor) -> Tensor:
    return _gated(gate_up, "gelu_tanh_mul_f32", gelu_tanh_mul_reference)


@silu_mul_op.register_fake
@gelu_tanh_mul_op.register_fake
def _(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


# ---- public functions --------------------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """y = x * rsqrt(mean(x^2, -1) + eps) * weight per row, into `out` when given."""
    if torch.compiler.is_compiling():
        if out is None:
            return rms_norm_op(x, weight, eps)
        rms_norm_out_op(x, weight, eps, out)
        return out
    return _rms_norm(x, weight, eps, out)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """residual += x in place; returns rms_norm(residual) (a pre-norm block's `x = x + attn; h = norm(x)`)."""
    if torch.compiler.is_compiling():
        return add_rms_norm_op(x, residual, weight, eps)
    return _add_rms_norm(x, residual, weight, eps)


def rope_qk(qk: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotary embedding in place on qk [T, heads, head_dim] (q and k heads together), half-split as
    RotaryEmbedding.apply, over the first rope_dim = cos.shape[-1] dims; cos/sin are the tables
    [max_positions, rope_dim] (sin signed), positions int64 [T]."""
    if torch.compiler.is_compiling():
        return rope_qk_op(qk, positions, cos, sin)
    _rope_qk(qk, positions, cos, sin)


def head_rms_norm_rope(qk: Tensor, n_q_heads: int, q_weight: Tensor, k_weight: Tensor, eps: float,
                       positions: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Gemma 3: RMSNorm of each q head (q_weight) and k head (k_weight), then rope_qk, in place."""
    if torch.compiler.is_compiling():
        return head_rms_norm_rope_op(qk, n_q_heads, q_weight, k_weight, eps, positions, cos, sin)
    _head_rms_norm_rope(qk, n_q_heads, q_weight, k_weight, eps, positions, cos, sin)


def silu_mul(gate_up: Tensor) -> Tensor:
    """[..., 2F] -> silu(gate) * up, [..., F] (SwiGLU)."""
    if torch.compiler.is_compiling():
        return silu_mul_op(gate_up)
    return _gated(gate_up, "silu_mul_f32", silu_mul_reference)


def gelu_tanh_mul(gate_up: Tensor) -> Tensor:
    """[..., 2F] -> gelu_tanh(gate) * up, [..., F] (GeGLU)."""
    if torch.compiler.is_compiling():
        return gelu_tanh_mul_op(gate_up)
    return _gated(gate_up, "gelu_tanh_mul_f32", gelu_tanh_mul_reference)


def native_exp(x: Tensor) -> Tensor:
    """The kernels' vector exp on a contiguous fp32 tensor (for tests measuring its error)."""
    m = native.module()
    if m is None:
        return torch.exp(x)
    x = x.contiguous()
    out = torch.empty_like(x)
    m.exp_f32(x.data_ptr(), out.data_ptr(), x.numel())
    return out
