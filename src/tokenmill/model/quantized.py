"""Weights that stay in their GGUF block formats and run through the native quantized matmuls
(kernels/qmatmul.py): the `gguf` weight mode. Nothing is dequantized at load, so a model loads in
the time it takes to repack its blocks and holds about the file's size in memory.

A fused projection (QKV, gate+up) is a list of parts, one per run of same-typed GGUF tensors
(Gemma 3 keeps Q and K as Q5_0 but V as Q8_0): each part writes its own columns of the output, and
all parts share one quantization of the input."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import quants

from tokenmill.kernels import qmatmul as qk
from tokenmill.kernels.embedding import dequantize_q8_0, embed_rows_q8_0

Q = gguf.GGMLQuantizationType


@dataclass
class RawTensor:
    """A 2-D GGUF tensor's rows as stored: uint8 [N, row_bytes] (often a read-only memmap)."""
    data: np.ndarray
    ggml_type: Q
    shape: tuple[int, int]

    def permute_rows(self, order: torch.Tensor) -> "RawTensor":
        return RawTensor(self.data[order.numpy()], self.ggml_type, self.shape)

    def dequantize(self) -> torch.Tensor:
        arr = np.asarray(self.data)
        if self.ggml_type == Q.Q8_0:  # gguf's arithmetic without its generic machinery (~0.1 ms a call)
            arr = dequantize_q8_0(arr)
        elif self.ggml_type not in (Q.F32, Q.F16):
            arr = quants.dequantize(arr, self.ggml_type)
        return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(self.shape)  # a copy: the map is read-only


def concat_rows(parts: list[RawTensor]) -> RawTensor:
    n = sum(p.shape[0] for p in parts)
    return RawTensor(np.concatenate([np.asarray(p.data) for p in parts]), parts[0].ggml_type, (n, parts[0].shape[1]))


# Where QuantizedParts made on this thread wait to be packed (packed_together), or None: packed at once.
_waiting = threading.local()


@contextlib.contextmanager
def packed_together() -> Iterator[list["QuantizedParts"]]:
    """QuantizedParts made inside (on this thread) are not packed yet: they are listed in the yielded
    list for pack_all, which repacks them in parallel. A model's load makes them one at a time."""
    queue: list[QuantizedParts] = []
    saved, _waiting.queue = getattr(_waiting, "queue", None), queue
    try:
        yield queue
    finally:
        _waiting.queue = saved


def pack_all(queue: list["QuantizedParts"], workers: int,
             place: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Pack every waiting QuantizedParts, `workers` at a time (the repacking is numpy copies, which
    run without the GIL), each weight straight into `place`'s memory when given (a huge-page arena)."""
    with ThreadPoolExecutor(max(1, workers)) as pool:
        list(pool.map(lambda q: q.pack(place), queue))


class QuantizedParts:
    """y = x @ W^T for W given as GGUF parts stacked by rows. Types the kernels do not take
    (F32/F16/BF16, Q5_1, Q5_K) are dequantized to fp32 once and run through F.linear."""

    def __init__(self, parts: list[RawTensor]):
        runs: list[list[RawTensor]] = []
        for p in parts:
            if runs and runs[-1][0].ggml_type == p.ggml_type:
                runs[-1].append(p)
            else:
                runs.append([p])
        self._raw: list[tuple[RawTensor, int, int]] = []  # each run of parts, until pack()
        start = 0
        for run in runs:
            raw = concat_rows(run) if len(run) > 1 else run[0]
            self._raw.append((raw, start, start + raw.shape[0]))
            start += raw.shape[0]
        self.out_features = start
        self.parts: list[tuple[qk.QuantizedWeight | torch.Tensor, int, int]] = []
        queue = getattr(_waiting, "queue", None)
        if queue is None:
            self.pack()
        else:
            queue.append(self)

    def pack(self, place: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Each run repacked for the kernels (or dequantized), its blocks moved by `place` if given."""
        for raw, start, end in self._raw:
            if raw.ggml_type in qk.SUPPORTED_TYPES:
                w: qk.QuantizedWeight | torch.Tensor = qk.QuantizedWeight.from_gguf(raw.data, raw.ggml_type, raw.shape)
                if place is not None:
                    w = w.moved(place)
            else:
                w = raw.dequantize()
            self.parts.append((w, start, end))
        self._raw = []

    def move_blocks(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Every part kept in blocks moves to copies that place makes (a huge-page arena)."""
        self.parts = [(w.moved(place) if isinstance(w, qk.QuantizedWeight) else w, s, e) for w, s, e in self.parts]

    @property
    def is_blocks(self) -> bool:
        """Every part stayed in its GGUF blocks (none was dequantized to run through F.linear)."""
        return all(isinstance(w, qk.QuantizedWeight) for w, _, _ in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes if isinstance(w, qk.QuantizedWeight) else w.numel() * 4 for w, _, _ in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            w = self.parts[0][0]
            return qk.qmatmul(x, w) if isinstance(w, qk.QuantizedWeight) else F.linear(x, w)
        out = torch.empty(x.shape[0], self.out_features)
        xq = qk.quantize_activations(x) if any(isinstance(w, qk.QuantizedWeight) for w, _, _ in self.parts) else None
        for w, s, e in self.parts:
            if isinstance(w, qk.QuantizedWeight):
                qk.qmatmul(xq, w, out=out[:, s:e])
            else:
                out[:, s:e] = F.linear(x, w)
        return out


class EmbeddingRows:
    """Token embeddings looked up straight from the GGUF rows: only the rows a step needs are
    dequantized (the table itself stays the file's memory map, so it costs no resident memory
    beyond the pages read)."""

    def __init__(self, raw: RawTensor):
        self.raw = raw

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.raw.ggml_type == Q.Q8_0:  # both real models' token_embd: one native call (kernels/embedding.py)
            return embed_rows_q8_0(self.raw.data, ids, self.raw.shape[1])
        rows = RawTensor(np.asarray(self.raw.data)[ids.numpy()], self.raw.ggml_type, (ids.numel(), self.raw.shape[1]))
        return rows.dequantize()
