"""Logprobs for the rows that ask for them (OpenAI's logprobs / top_logprobs): the sampled token's
logprob and the k most likely tokens with theirs.

A logprob is a logit minus its row's log-sum-exp (csrc/logsumexp.cpp: the row's max, then exp(x - max)
summed in float64), and the top k come from the top-k kernel (kernels/topk.py) on the logits
themselves, since subtracting one number per row keeps their order. The reference is torch's
log_softmax, gather and topk: on 64 x 49,152 logits it took 1.2 ms for the sampled tokens and 3.3-3.8
ms with top_logprobs=5 (2 threads).

Approximation: the kernel's exp is within ~1 ulp of torch's and its sum runs in float64, in another
order, so a logprob differs from log_softmax's by rounding only (a few float32 ulps of the row's
log-sum-exp). Among tokens with equal logits the lower id comes first, as kernels/topk.py orders them."""
from __future__ import annotations

import torch
from torch import Tensor

from tokenmill.kernels import native
from tokenmill.kernels.topk import topk_rows

__all__ = ["logsumexp_rows", "logsumexp_rows_reference", "row_logprobs", "row_logprobs_reference"]


def logsumexp_rows_reference(logits: Tensor) -> Tensor:
    """float32 [rows]: torch.logsumexp over each row."""
    return torch.logsumexp(logits.float(), dim=-1)


def logsumexp_rows(logits: Tensor) -> Tensor:
    """As the reference; the compiled kernel for float32 [rows, vocab] with a unit inner stride."""
    m = native.for_rows(logits)
    if m is None:
        return logsumexp_rows_reference(logits)
    out = torch.empty(logits.shape[0], dtype=torch.float32)
    m.logsumexp_rows_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr())
    return out


def row_logprobs_reference(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(chosen [rows], top values [rows, k], top ids [rows, k]): each row's log_softmax at tokens[row]
    and its k largest entries (k = 0: empty)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1)).view(-1)
    if not k:
        return chosen, logp[:, :0], torch.empty(logp.shape[0], 0, dtype=torch.int64)
    values, ids = logp.topk(min(k, logp.shape[1]), dim=-1)
    return chosen, values, ids


def row_logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """As the reference, through the log-sum-exp and top-k kernels."""
    logits = logits.float()
    lse = logsumexp_rows(logits)
    chosen = logits.gather(1, tokens.view(-1, 1)).view(-1) - lse
    if not k:
        return chosen, logits[:, :0], torch.empty(logits.shape[0], 0, dtype=torch.int64)
    values, ids = topk_rows(logits, min(k, logits.shape[1]))
    return chosen, values - lse[:, None], ids
