"""Draws from softmax(logits / temperature) for the sampler's rows without typical_p:
`sample_categorical` for rows with min_p at most (OpenAI's default request, temperature 1, is one),
`sample_nucleus` for rows with top_p (then min_p), `sample_top_k` among the top_k candidates
kernels/topk.py picked (then top_p, then min_p: Ollama's default request).

The compiled kernels (csrc/categorical.cpp, csrc/nucleus.cpp, csrc/topk_draw.cpp) read a row two or
three times and sort only the nucleus's candidates; the references below are the same inverse-CDF draws
in torch. In the sampler's torch path they added 18-19 ms (temperature 1) and 19-22 ms (top_p 0.95) to
a 51 ms SmolLM2 64-sequence decode step; with the kernels, 1-4 ms (bench/sampling.py, 2 threads). The
top_k draw's torch path was ~30 small operations on 40 values, most of a sampler that took ~13% of a
single-stream step with Ollama's defaults.

Approximation: the kernels' exp is within ~1 ulp of torch's, weights under float's smallest normal
(exp(d) for d < -87) count as 0, and their float64 sums run in another order. So a draw matches the
reference except when u * total lies within rounding (~1e-6 of the total) of the boundary between two
tokens, or, for top_p, when the nucleus's running probability lies within rounding of top_p (the
reference sums it in float32): the nucleus may then end one token apart (the top_k draw's too). A token
the reference gives weight 0 (below min_p, outside the nucleus by more than rounding, or -inf) is never
drawn. tests/kernels/test_categorical.py and test_topk_draw.py hold the kernels to that."""
from __future__ import annotations

import torch
from torch import Tensor

from tokenmill.kernels import native

__all__ = ["sample_categorical", "sample_categorical_reference", "sample_nucleus", "sample_nucleus_reference",
           "sample_top_k", "sample_top_k_reference"]


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
    return _first_past(cdf, target)


def sample_categorical(logits: Tensor, temperature: Tensor, log_min_p: Tensor, uniforms: Tensor) -> Tensor:
    """As the reference; the compiled kernel for float32 [rows, vocab] with a unit inner stride. Rows
    the kernel cannot draw from (a NaN, or all -inf) take the reference."""
    return _draw("categorical_rows_f32", sample_categorical_reference, logits, temperature, log_min_p, uniforms)


def sample_nucleus_reference(logits: Tensor, temperature: Tensor, top_p: Tensor, log_min_p: Tensor,
                             uniforms: Tensor) -> Tensor:
    """int64 [rows]; top_p is float32 [rows] in [0, 1), the rest as sample_categorical_reference's. The
    row's values v = logits / temperature sorted descending (stable); the shortest prefix whose
    probability reaches top_p; of it, the values >= max v + log_min_p; a draw among those."""
    vals, ids = (logits.float() / temperature[:, None]).sort(dim=-1, descending=True, stable=True)
    cum = (vals - vals.logsumexp(dim=-1, keepdim=True)).exp().cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    # before == 0 exactly for the top token, so it is always kept, even at top_p = 0.
    vals = vals.masked_fill((before >= top_p[:, None]) & (before > 0), float("-inf"))
    m = vals[:, :1]
    vals = vals.masked_fill(vals < m + log_min_p[:, None], float("-inf"))
    cdf = (vals - m).exp_().double().cumsum(dim=-1)
    target = uniforms.double()[:, None] * cdf[:, -1:]
    return ids.gather(1, _first_past(cdf, target)[:, None]).squeeze(1)


def sample_nucleus(logits: Tensor, temperature: Tensor, top_p: Tensor, log_min_p: Tensor, uniforms: Tensor) -> Tensor:
    """As the reference; the compiled kernel for float32 [rows, vocab] with a unit inner stride. Rows
    the kernel cannot draw from (a NaN, or all -inf) take the reference."""
    return _draw("nucleus_rows_f32", sample_nucleus_reference, logits, temperature, top_p, log_min_p, uniforms)


def sample_top_k_reference(values: Tensor, ids: Tensor, k: Tensor, temperature: Tensor, top_p: Tensor,
                           log_min_p: Tensor, uniforms: Tensor) -> Tensor:
    """int64 [rows]. values float32 [rows, K]: each row's K largest logits, descending, with their
    vocabulary ids (int64 [rows, K]); k int64 [rows] in [1, K]: how many of them the row keeps. Of
    v = values[:, :k] / temperature, the shortest prefix whose probability (over the k) reaches top_p
    (all of them for top_p >= 1); of it, the values >= max v + log_min_p; a draw among those, as
    sample_categorical_reference's. The other arguments as there."""
    v = values.float() / temperature[:, None]
    pos = torch.arange(v.shape[1], device=v.device)
    v = v.masked_fill(pos[None, :] >= k[:, None], float("-inf"))
    cum = (v - v.logsumexp(dim=-1, keepdim=True)).exp().cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    # before == 0 exactly for the top candidate, so it is always kept, even at top_p = 0.
    v = v.masked_fill((before >= top_p[:, None]) & (before > 0) & (top_p[:, None] < 1.0), float("-inf"))
    m = v[:, :1]
    v = v.masked_fill(v < m + log_min_p[:, None], float("-inf"))
    cdf = (v - m).exp_().double().cumsum(dim=-1)
    target = uniforms.double()[:, None] * cdf[:, -1:]
    return ids.gather(1, _first_past(cdf, target)[:, None]).squeeze(1)


def sample_top_k(values: Tensor, ids: Tensor, k: Tensor, temperature: Tensor, top_p: Tensor, log_min_p: Tensor,
                 uniforms: Tensor) -> Tensor:
    """As the reference; the compiled kernel for float32 values on the CPU. Rows it cannot draw from
    (a NaN, no candidate with any weight) take the reference."""
    m = native.for_rows(values, max_cols=2**31)
    if m is None:
        return sample_top_k_reference(values, ids, k, temperature, top_p, log_min_p, uniforms)
    values, ids, k = values.contiguous(), ids.to(torch.int64).contiguous(), k.to(torch.int64).contiguous()
    per_row = tuple(t.float().contiguous() for t in (temperature, top_p, log_min_p, uniforms))
    out = torch.empty(values.shape[0], dtype=torch.int64)
    if m.top_k_draw_rows_f32(values.data_ptr(), ids.data_ptr(), values.shape[0], values.shape[1], k.data_ptr(),
                             *(t.data_ptr() for t in per_row), out.data_ptr()):
        bad = (out < 0).nonzero().flatten()
        out[bad] = sample_top_k_reference(values[bad], ids[bad], k[bad], *(t[bad] for t in per_row))
    return out


def _draw(kernel: str, reference, logits: Tensor, *per_row: Tensor) -> Tensor:
    """One of the draw kernels over logits, with its per-row float32 arguments in the kernel's order;
    the reference where the kernel does not apply, and for the rows it leaves (index -1)."""
    m = native.for_rows(logits, max_cols=2**31)
    if m is None:
        return reference(logits, *per_row)
    per_row = tuple(t.float().contiguous() for t in per_row)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    getattr(m, kernel)(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                       *(t.data_ptr() for t in per_row), out.data_ptr())
    bad = (out < 0).nonzero().flatten()
    if bad.numel():
        out[bad] = reference(logits[bad], *(t[bad] for t in per_row))
    return out


def _first_past(cdf: Tensor, target: Tensor) -> Tensor:
    """Each row's first index whose running sum passes its target. A row with a NaN (a model gone
    wrong) passes nowhere: its last index then, so a bad row cannot index past the vocabulary."""
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
