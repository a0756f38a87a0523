"""The gated MLP's activation as one Triton kernel: [T, 2F] -> act(gate) * up, [T, F], for SwiGLU
(silu) and GeGLU (tanh GELU). The PyTorch path is a split, the activation and a multiply; each
result is rounded to the activations' dtype as that path rounds it (the activation, then the
product). GELU is computed as g / (1 + exp(-2u)), the same function as g/2 (1 + tanh(u))."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024


@triton.jit
def _gated_kernel(gu_ptr, out_ptr, stride_gu, stride_out, features, GELU: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = f < features
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + t * stride_gu + f, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + features + f, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * inner))
    else:
        a = g / (1.0 + tl.exp(-g))
    a = a.to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_out + f, (a * u).to(dtype), mask=mask)


def gated_triton(gate_up: Tensor, gelu: bool) -> Tensor:
    tokens, width = gate_up.shape
    features = width // 2
    out = torch.empty(tokens, features, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _gated_kernel[(tokens, triton.cdiv(features, BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), features, GELU=gelu, BLOCK=BLOCK, num_warps=4)
    return out
