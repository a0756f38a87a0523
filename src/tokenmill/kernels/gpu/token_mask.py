"""Grammar token masks on the GPU as a Triton kernel: logits [B, V] (float) get -inf wherever the row's
bitmask (int32 [B, words], bit t of word t // 32 set when token t is allowed: llguidance's and
xgrammar's layout) has a clear bit; tokens past the mask's words are not allowed. In place, writing
only the forbidden logits. One program per (row, BLOCK_V tokens)."""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

BLOCK_V = 1024


@triton.jit
def _token_bitmask_kernel(logits_ptr, mask_ptr, stride_lb, stride_mb, vocab, words, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    word = tokens // 32
    bits = tl.load(mask_ptr + b * stride_mb + word, mask=(tokens < vocab) & (word < words), other=0)
    allowed = ((bits >> (tokens % 32)) & 1) != 0
    forbidden = (tokens < vocab) & ~allowed
    tl.store(logits_ptr + b * stride_lb + tokens, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty),
             mask=forbidden)


def apply_token_bitmask_triton(logits: Tensor, bitmask: Tensor) -> None:
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return
    _token_bitmask_kernel[(rows, triton.cdiv(vocab, BLOCK_V))](
        logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, bitmask.shape[1], BLOCK=BLOCK_V)
