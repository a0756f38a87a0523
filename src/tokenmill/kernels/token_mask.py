"""Grammar token masks on logits rows (csrc/token_mask.cpp): the sampler's one pass that sends the
tokens a grammar forbids to -inf. At 64 constrained rows of a 49k vocabulary the reference below
(unpack the bits, then masked_fill) costs ~17 ms a step on 2 cores; the kernel writes only the
forbidden logits.

Masks are llguidance's layout: per row, little-endian int32 words, bit t set when token t is allowed.
Logit columns past the mask's words (padding ids of the embedding) are never allowed."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from tokenmill.kernels import native

__all__ = ["apply_token_bitmask", "apply_token_bitmask_on_device", "apply_token_bitmask_reference", "unpack_allowed"]


def unpack_allowed(bits: Tensor, vocab: int) -> Tensor:
    """int32 [n, words] -> bool [n, vocab], True where the token is allowed."""
    unpacked = np.unpackbits(bits.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
    out = torch.from_numpy(unpacked[:, :vocab]).bool()
    if out.shape[1] < vocab:
        out = torch.cat([out, out.new_zeros(out.shape[0], vocab - out.shape[1])], dim=1)
    return out


def apply_token_bitmask_reference(logits: Tensor, rows: list[int], bits: Tensor) -> None:
    """In place: logits[rows[j], t] = -inf where bit t of bits[j] is clear."""
    disallowed = ~unpack_allowed(bits, logits.shape[1])
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(disallowed, float("-inf"))
        return
    idx = torch.tensor(rows, dtype=torch.long)
    picked = logits.index_select(0, idx)
    picked.masked_fill_(disallowed, float("-inf"))
    logits.index_copy_(0, idx, picked)


def apply_token_bitmask_on_device(logits: Tensor, rows: list[int], bits: Tensor) -> None:
    """In place, as the reference, for logits on a GPU: the mask words go up in one copy and the
    device op (kernels/gpu: Triton on CUDA) applies them; the logits never come to the host."""
    from tokenmill.kernels import gpu  # the GPU path only

    if not rows:
        return
    bits = bits.to(device=logits.device, dtype=torch.int32, non_blocking=True)
    if rows == list(range(logits.shape[0])):
        gpu.apply_token_bitmask(logits, bits)
        return
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    picked = logits.index_select(0, index)
    gpu.apply_token_bitmask(picked, bits)
    logits.index_copy_(0, index, picked)


def apply_token_bitmask(logits: Tensor, rows: list[int], bits: Tensor) -> None:
    """In place, as the reference; the compiled kernel for float32 rows with a unit inner stride, the
    device op for logits on a GPU."""
    if logits.device.type != "cpu":
        apply_token_bitmask_on_device(logits, rows, bits)
        return
    m = native.module()
    if (m is None or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1
            or bits.dtype != torch.int32 or bits.shape[0] != len(rows)):
        apply_token_bitmask_reference(logits, rows, bits)
        return
    if not rows:
        return
    if min(rows) < 0 or max(rows) >= logits.shape[0]:
        raise IndexError(f"mask rows {rows} outside {logits.shape[0]} logits rows")
    bits = bits.contiguous()
    index = torch.tensor(rows, dtype=torch.int64)
    m.apply_token_bitmask_f32(logits.data_ptr(), logits.stride(0), logits.shape[1], index.data_ptr(), len(rows),
                              bits.data_ptr(), bits.shape[1])
