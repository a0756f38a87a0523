"""Greedy rows' tokens straight from a Q8_0 output head (csrc/head_argmax.cpp): the argmax of
qmatmul(x, head), the same index torch.max picks from the full logits, with about half of the head's
integer work per row. The activations' first plane bounds every column's logit; only the columns that
bound cannot rule out are computed exactly, by the qmatmul kernel itself.

A greedy row that needs nothing else from its logits (no logprobs, penalties, bias or grammar) is the
case: speculative decoding's verification rows, and batched greedy decoding; a row that suppresses its
end tokens (ignore_eos, below min_tokens) too, those columns excluded. Where the compiled kernel
is missing (not the avx512 variant, or not a Q8_0 head) GreedyHead computes the logits and takes their
argmax, so callers need not ask.

A row alone (greedy decoding of one stream) is bound by reading the head from memory, and a head that is
most of a model's bytes (Gemma 3's: 178 MB of ~250 a token) gets a 6-bit copy for it (0.7x its bytes
again, counted in the model's memory; `TOKENMILL_COARSE_HEAD=0` goes without): the coarse pass reads that
instead, with a bound per column, and the candidates are again computed exactly from the Q8_0 head."""
from __future__ import annotations

import os

import torch
from torch import Tensor

from tokenmill.kernels import huge_pages, native
from tokenmill.kernels.argmax import excluding
from tokenmill.kernels.qmatmul import Q, QuantizedActivations, QuantizedWeight, qmatmul, quantize_activations

__all__ = ["GreedyHead", "coarse_copy_bytes", "head_argmax_reference"]

_ENABLED = os.environ.get("TOKENMILL_GREEDY_HEAD", "1").strip().lower() not in ("0", "false", "off", "no")
_COARSE = os.environ.get("TOKENMILL_COARSE_HEAD", "1").strip().lower() not in ("0", "false", "off", "no")
# A call of one row scans the head's 6-bit copy (when it has one) rather than its Q8_0 bytes: it is
# bound by reading the head from memory. At two rows and more the copy's decoding and second plane cost
# what its fewer bytes save (Gemma 3's head, 2 threads: 2 rows 6.8-8.7 ms against 5.5-8.3).
COARSE_ROWS = 1
# The copy is kept for a head that is at least this share of the model's weight bytes: Gemma 3's (178 of
# ~250 MB) decodes 1.06x faster with it (greedy, one stream, 2 threads), SmolLM2's (30 of ~140 MB)
# 1.01x, not worth its 23 MB.
COARSE_HEAD_SHARE = 0.5
COARSE_BLOCK_BYTES = 384  # the copy's bytes per block of 32 inputs and 16 columns (csrc/head_argmax.cpp)


def coarse_copy_bytes(head_type: int, out_features: int, in_features: int, head_bytes: int,
                      weight_bytes: int) -> int:
    """Bytes of the 6-bit copy a model with this head would keep (0: none): a Q8_0 head of at least
    COARSE_HEAD_SHARE of the weights, unless TOKENMILL_COARSE_HEAD=0 or greedy heads are off. Counted in
    a model's memory whether or not this machine's kernels build it."""
    if not (_ENABLED and _COARSE) or head_type != Q.Q8_0 or head_bytes < COARSE_HEAD_SHARE * weight_bytes:
        return 0
    return _copy_bytes(out_features, in_features)


def _copy_bytes(out_features: int, in_features: int) -> int:
    return -(-out_features // 16) * (in_features // 32) * COARSE_BLOCK_BYTES


def head_argmax_reference(x: Tensor | QuantizedActivations, w: QuantizedWeight,
                          exclude: tuple[int, ...] = ()) -> Tensor:
    """int64 [rows]: the first index of each row's largest logit, from the full qmatmul; with `exclude`
    (suppressed ids) those columns -inf first, as the sampler's suppression makes them."""
    return excluding(qmatmul(x, w), exclude).max(dim=-1).indices


class GreedyHead:
    """One head weight, with the per-block column norms the kernel's bound needs (computed once), and
    with coarse=True its 6-bit copy for calls of one row (0.7x the head's bytes again)."""

    def __init__(self, w: QuantizedWeight, coarse: bool = False):
        self.weight = w
        mod = native.module()
        self._native = mod if (_ENABLED and mod is not None and w.ggml_type == Q.Q8_0 and hasattr(mod, "head_argmax")
                               and w.qs.device.type == "cpu") else None
        self.norms: Tensor | None = None
        if self._native is not None:
            self.norms = torch.empty(w.in_features // 32, dtype=torch.float32)
            self._native.head_block_norms(w.qs.data_ptr(), w.sc.data_ptr(), w.out_features, w.in_features,
                                          self.norms.data_ptr())
        self.coarse: Tensor | None = None
        if self._native is not None and coarse and hasattr(mod, "head_coarse_pack"):
            nbytes = _copy_bytes(w.out_features, w.in_features)
            # In huge pages where the system gives them, as the weights are: it is read as a stream.
            self.coarse = (huge_pages.HugePageArena(nbytes).take(nbytes) if huge_pages.wanted()
                           else torch.empty(nbytes, dtype=torch.uint8))
            mod.head_coarse_pack(w.qs.data_ptr(), w.sc.data_ptr(), w.out_features, w.in_features,
                                 self.coarse.data_ptr())

    @property
    def nbytes(self) -> int:
        """What it holds besides the head itself (the 6-bit copy)."""
        return 0 if self.coarse is None else self.coarse.numel()

    @property
    def native(self) -> bool:
        """Whether the bounded kernel runs (else the full logits' argmax)."""
        return self._native is not None

    def kernel_inputs(self, rows: int) -> tuple[int, int]:
        """(block norms, 6-bit copy or 0): the addresses the native kernel reads besides the head and the
        activations, for a call of `rows` rows (native must hold). For callers that run the kernel
        themselves on activations they quantized (the native step's greedy, model/native_step.py)."""
        six = self.coarse is not None and rows <= COARSE_ROWS
        return self.norms.data_ptr(), self.coarse.data_ptr() if six else 0

    def __call__(self, x: Tensor | QuantizedActivations, exclude: tuple[int, ...] = ()) -> Tensor:
        """int64 [rows]: each row's token, head_argmax_reference's bitwise; exclude: ids no row may take
        (those a row suppresses: its end tokens under ignore_eos), in range."""
        if self._native is None:
            return head_argmax_reference(x, self.weight, exclude)
        a = x if isinstance(x, QuantizedActivations) else quantize_activations(x)
        m, k = a.shape
        w = self.weight
        if k != w.in_features:
            raise ValueError(f"activations have K={k}, the head {w.in_features}")
        out = torch.empty(m, dtype=torch.int64)
        if m > 0:
            norms, coarse = self.kernel_inputs(m)
            ids = torch.tensor(exclude, dtype=torch.int64) if exclude else None
            self._native.head_argmax(a.data.data_ptr(), m, k, w.qs.data_ptr(), w.sc.data_ptr(), w.out_features,
                                     norms, out.data_ptr(), coarse, ids.data_ptr() if ids is not None else 0,
                                     len(exclude))
        return out
