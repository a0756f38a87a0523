"""The repetition penalties (llama.cpp's penalties sampler) applied in place to rows of logits, each
row over its own window of recent token ids: a token seen in the window has its logit divided by
`repeat` (multiplied when negative), less count * `frequency`, less `presence`. csrc/penalties.cpp
does it with the reference's float32 operations (the same bits); in Python the windows were counted
with a Counter per row and the logits copied whole: 3-6 ms of a 64-sequence SmolLM2 decode step at
Ollama's defaults (repeat_penalty 1.1 over the last 64 tokens; bench/sampling.py, 2 threads)."""
from __future__ import annotations

import torch
from torch import Tensor

from tokenmill.kernels import native

__all__ = ["apply_penalties_rows", "apply_penalties_reference"]


def apply_penalties_reference(logits: Tensor, ids: Tensor, offsets: Tensor, repeat: Tensor, frequency: Tensor,
                              presence: Tensor) -> None:
    """In place. logits float [rows, vocab]; ids int64, the rows' windows one after another, row r's
    at ids[offsets[r]:offsets[r + 1]] (ids outside the vocabulary are ignored); repeat, frequency and
    presence float32 [rows]."""
    rows, vocab = logits.shape
    row_of = torch.repeat_interleave(torch.arange(rows, device=logits.device), offsets.diff())
    inside = (ids >= 0) & (ids < vocab)
    keys, counts = torch.unique(row_of[inside] * vocab + ids[inside], return_counts=True)
    if keys.numel() == 0:
        return
    r, t = keys // vocab, keys % vocab
    finfo = torch.finfo(logits.dtype)
    v = logits[r, t]
    # A penalty below the smallest normal would round to 0 and turn logits into inf and NaN.
    rep = repeat.to(logits.dtype)[r].clamp_(min=finfo.tiny)
    # Dividing a negative logit would make the token *more* likely, so negatives are multiplied.
    v = torch.where(v > 0, v / rep, v * rep).clamp_(max=finfo.max)
    v = v - counts.to(logits.dtype) * frequency.to(logits.dtype)[r]
    logits[r, t] = v - presence.to(logits.dtype)[r]


def apply_penalties_rows(logits: Tensor, ids: Tensor, offsets: Tensor, repeat: Tensor, frequency: Tensor,
                         presence: Tensor) -> None:
    """As the reference; the compiled kernel for float32 rows with a unit inner stride."""
    m = native.for_rows(logits)
    if m is None:
        apply_penalties_reference(logits, ids, offsets, repeat, frequency, presence)
        return
    ids, offsets = ids.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous()
    repeat, frequency, presence = (t.float().contiguous() for t in (repeat, frequency, presence))
    m.apply_penalties_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), ids.data_ptr(),
                          offsets.data_ptr(), repeat.data_ptr(), frequency.data_ptr(), presence.data_ptr())
