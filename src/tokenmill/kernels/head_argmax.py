"""Greedy rows' tokens straight from a Q8_0 output head (csrc/head_argmax.cpp): the argmax of
qmatmul(x, head), the same index torch.max picks from the full logits, with about half of the head's
integer work per row. The activations' first plane bounds every column's logit; only the columns that
bound cannot rule out are computed exactly, by the qmatmul kernel itself.

A greedy row that needs nothing else from its logits (no logprobs, penalties, bias or grammar) is the
case: speculative decoding's verification rows, and batched greedy decoding. Where the compiled kernel
is missing (not the avx512 variant, or not a Q8_0 head) GreedyHead computes the logits and takes their
argmax, so callers need not ask."""
from __future__ import annotations

import os

import torch
from torch import Tensor

from tokenmill.kernels import native
from tokenmill.kernels.qmatmul import Q, QuantizedActivations, QuantizedWeight, qmatmul, quantize_activations

__all__ = ["GreedyHead", "head_argmax_reference"]

_ENABLED = os.environ.get("TOKENMILL_GREEDY_HEAD", "1").strip().lower() not in ("0", "false", "off", "no")


def head_argmax_reference(x: Tensor | QuantizedActivations, w: QuantizedWeight) -> Tensor:
    """int64 [rows]: the first index of each row's largest logit, from the full qmatmul."""
    return qmatmul(x, w).max(dim=-1).indices


class GreedyHead:
    """One head weight, with the per-block column norms the kernel's bound needs (computed once)."""

    def __init__(self, w: QuantizedWeight):
        self.weight = w
        mod = native.module()
        self._native = mod if (_ENABLED and mod is not None and w.ggml_type == Q.Q8_0 and hasattr(mod, "head_argmax")
                               and w.qs.device.type == "cpu") else None
        self.norms: Tensor | None = None
        if self._native is not None:
            self.norms = torch.empty(w.in_features // 32, dtype=torch.float32)
            self._native.head_block_norms(w.qs.data_ptr(), w.sc.data_ptr(), w.out_features, w.in_features,
                                          self.norms.data_ptr())

    @property
    def native(self) -> bool:
        """Whether the bounded kernel runs (else the full logits' argmax)."""
        return self._native is not None

    def __call__(self, x: Tensor | QuantizedActivations) -> Tensor:
        """int64 [rows]: each row's token, head_argmax_reference's bitwise."""
        if self._native is None:
            return head_argmax_reference(x, self.weight)
        a = x if isinstance(x, QuantizedActivations) else quantize_activations(x)
        m, k = a.shape
        w = self.weight
        if k != w.in_features:
            raise ValueError(f"activations have K={k}, the head {w.in_features}")
        out = torch.empty(m, dtype=torch.int64)
        if m > 0:
            self._native.head_argmax(a.data.data_ptr(), m, k, w.qs.data_ptr(), w.sc.data_ptr(), w.out_features,
                                     self.norms.data_ptr(), out.data_ptr())
        return out
