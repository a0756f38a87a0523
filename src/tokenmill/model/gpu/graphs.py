"""Decode steps as CUDA graphs, one per batch-size bucket (buckets.py), captured once after the KV
cache is allocated; prefill and mixed steps stay eager. A captured step is the layer stack only
(embeddings to the last layer's hidden states): the final norm and the head run eagerly on the rows
that sample, so no bucket holds its own [bucket, vocab] output.

The graphs read the static buffers of a DecodeBuffers and write the KV cache in place; a replay
computes what the eager step would on the same rows (tests/model/gpu/test_graphs_cuda.py). CUDA only."""
from __future__ import annotations

import logging

import torch

from tokenmill.kvcache.storage import KVStorage
from tokenmill.model.gpu.buckets import DecodeBuffers, DecodeRows

log = logging.getLogger("tokenmill.model.gpu")


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv: KVStorage, buffers: DecodeBuffers):
        if buffers.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {buffers.device}")
        self.model = model
        self.kv = kv
        self.buffers = buffers
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}

    @property
    def buckets(self) -> list[int]:
        return sorted(self._graphs)

    def accepts(self, num_rows: int, num_blocks: int) -> bool:
        return bool(self._graphs) and self.buffers.accepts(num_rows, num_blocks)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, the largest first so that the smaller ones reuse its memory pool.
        The buffers hold padding only (slot -1, length 0) meanwhile: the warm-up runs write nothing."""
        b = self.buffers
        b.fill(DecodeRows([0], [0], [-1], [[]], [0]))  # one padding row; the rest are padding already
        pool = None
        for bucket in reversed(b.buckets):
            ids, positions, meta = b.input_ids[:bucket], b.positions[:bucket], b.batch(bucket)
            self.model(ids, positions, meta, self.kv)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(b.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, meta, self.kv)
            pool = graph.pool() if pool is None else pool
            self._graphs[bucket], self._hidden[bucket] = graph, hidden
        torch.cuda.synchronize(b.device)
        log.info("captured decode graphs for batch sizes %s", ", ".join(map(str, b.buckets)))

    def replay(self, bucket: int) -> None:
        """Replays a bucket's graph on whatever the buffers hold (the profile's GPU-only time)."""
        self._graphs[bucket].replay()

    def run(self, rows: DecodeRows, input_ids: torch.Tensor | None = None, steps_ahead: int = 0) -> torch.Tensor:
        """The last layer's hidden states of rows ([len(rows), dim], a view of the bucket's output,
        valid until the next replay). input_ids: the rows' ids as a device tensor, in place of
        rows.input_ids (the previous step's sampled tokens, which the host has not seen).
        steps_ahead: how many run_next() steps will follow on these rows."""
        bucket = self.buffers.fill(rows, steps_ahead)
        if input_ids is not None:  # queued after fill's upload, so it overwrites the host's ids
            self.buffers.input_ids[:len(input_ids)].copy_(input_ids)
        self._graphs[bucket].replay()
        return self._hidden[bucket][:len(rows.input_ids)]

    def run_next(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The next decode step of the last run's rows, each one position further (DecodeBuffers.advance),
        their input ids the device tensor given (the tokens the step before sampled)."""
        bucket = self.buffers.advance()
        self.buffers.input_ids[:len(input_ids)].copy_(input_ids)
        self._graphs[bucket].replay()
        return self._hidden[bucket][:len(input_ids)]
