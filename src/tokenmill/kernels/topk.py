"""Sampling's top_k (csrc/topk.cpp): each row's k largest logits, in descending order, and their ids.
Inside a 64-sequence SmolLM2 decode step torch.topk over the head's 64 x 49,152 float32 logits (k=40,
Ollama's default) took ~5-6 ms on 2 threads. bench/topk.py (AVX-512, 2 threads, random logits):
64 x 49,152 k=40 2.4 ms -> 0.61 ms (~4x), 1 x 49,152 89 -> 12 us, Gemma 3's 1 x 262,144 760 -> 52 us.

Values are exactly torch.topk's. The order among equal values is not: torch leaves it unspecified,
the kernel puts the lower index first, so its answer does not depend on the thread count or batch.
A row holding a NaN sends the whole call to torch.topk, as do k above MAX_K and inputs the kernel
does not take (not float32, not 2-D on the CPU with unit inner stride)."""
from __future__ import annotations

import torch
from torch import Tensor

from tokenmill.kernels import native

__all__ = ["MAX_K", "topk_rows", "topk_rows_reference"]

# Above it torch is used. The kernel's lead shrinks as k grows (bench/topk.py --max-k, 2 threads):
# 64 x 49,152 was 3.5x faster at k=256, 2.2x at 1024, 1.6x at 2048; 1 x 49,152 3.4x at 1024, 1.8x at 2048.
MAX_K = 1024


def topk_rows_reference(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, ids) [rows, k]: torch.topk(logits, k, dim=-1, sorted=True)."""
    values, ids = torch.topk(logits, k, dim=-1, sorted=True)
    return values, ids


def topk_rows(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """As the reference (ties by ascending index); the compiled kernel for float32 [rows, vocab] with a
    unit inner stride and 1 <= k <= min(MAX_K, vocab)."""
    m = native.for_rows(logits, max_cols=1 << 32)
    if m is None or not 1 <= k <= min(MAX_K, logits.shape[1]):
        return topk_rows_reference(logits, k)
    rows = logits.shape[0]
    values = torch.empty(rows, k, dtype=torch.float32)
    ids = torch.empty(rows, k, dtype=torch.int64)
    nan_rows = m.topk_rows_f32(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), k, values.data_ptr(),
                               ids.data_ptr())
    if nan_rows:
        return topk_rows_reference(logits, k)
    return values, ids
