"""Draws from softmax(logits / temperature) with min_p, for the sampler's rows that have no top_k,
top_p or typical_p: OpenAI's default request (temperature 1, nothing else) is one.

The compiled kernel (csrc/categorical.cpp) reads each row twice; the reference below is the same
inverse-CDF draw in torch, five passes over [rows, vocab] and a float64 copy, which took 25 ms of
SmolLM2's 64-sequence decode step at temperature 1 (half the step).

Approximation: the kernel's exp is within ~1 ulp of torch's, weights under float's smallest normal
(exp(d) for d < -87) count as 0, and its float64 sums run in blocks of 64 rather than one by one.
So a draw matches the reference except when u * total lies within rounding (~1e-6 of the total) of
the boundary between two tokens; a token the reference gives weight 0 (below min_p, or -inf) is never
drawn. tests/kernels/test_categorical.py holds it to that."""
from __future__ import annotations

import torch
from torch import Tensor

from tokenmill.kernels import native

__all__ = ["sample_categorical", "sample_categorical_reference"]


def sample_categorical_reference(logits: Tensor, temperature: Tensor, log_min_p: Tensor, uniforms: Tensor) -> Tensor:
    """int64 [rows]. logits [rows, vocab]; temperature (> 0), log_min_p (log(min_p), -inf for none) and
    uniforms (in [0, 1)) are float32 [rows]. Row r's draw is the first token whose running weight
    passes uniforms[r] * the row's total weight, with weight exp(v - max v) for v = logits / temperature,
    0 for v < max v + log_min_p."""
    v = logits.float() / temperature[:, None]
    m = v.max(dim=-1, keepdim=True).values
    v = v.masked_fill(v < m + log_min_p[:, None], float("-inf"))
    cdf = (v - m).exp_().double().cumsum(dim=-1)
    # float32 uniforms stay below 1 - 2^-24, so u * total < total survives the float64 rounding.
    target = uniforms.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def sample_categorical(logits: Tensor, temperature: Tensor, log_min_p: Tensor, uniforms: Tensor) -> Tensor:
    """As the reference; the compiled kernel for float32 [rows, vocab] with a unit inner stride. Rows
    the kernel cannot draw from (a NaN, or all -inf) take the reference."""
    m = native.module()
    if (m is None or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1
            or logits.shape[1] == 0 or logits.device.type != "cpu"):
        return sample_categorical_reference(logits, temperature, log_min_p, uniforms)
    rows = logits.shape[0]
    temperature, log_min_p, uniforms = (t.float().contiguous() for t in (temperature, log_min_p, uniforms))
    out = torch.empty(rows, dtype=torch.int64)
    m.categorical_rows_f32(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), temperature.data_ptr(),
                           log_min_p.data_ptr(), uniforms.data_ptr(), out.data_ptr())
    bad = (out < 0).nonzero().flatten()
    if bad.numel():
        out[bad] = sample_categorical_reference(logits[bad], temperature[bad], log_min_p[bad], uniforms[bad])
    return out
