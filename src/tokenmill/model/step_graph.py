"""Prefill and mixed steps through a torch.compile'd forward.

Between its matmuls and attention, an eager prefill step spends about a fifth of its time in
elementwise kernels (norms, rotary, SiLU, residual adds), each a separate pass over [T, dim] or
[T, ffn] activations. Compiled, inductor fuses them. Attention stays eager, as an opaque custom op
(attention.paged_attention_op) that finds the step's metadata by a key, so one graph with a dynamic
token count serves every batch shape: any mix of prompt chunks and decode rows, 2..max_tokens tokens.
Decode-only steps have their own graphs (model/decode_graph.py)."""
from __future__ import annotations

import itertools
import logging
import time

import torch
from torch import nn

from tokenmill.model.attention import (AttentionMetadata, ChunkSpec, GraphStepMeta, register_step_meta,
                                       unregister_step_meta)
from tokenmill.model.decode_graph import compile_private

log = logging.getLogger(__name__)

MIN_TOKENS = 2  # a one-token step that is not a decode runs eagerly rather than specialise the graph
WARMUP_CHUNKS = 4
_keys = itertools.count()


class _Step(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, key, k_caches, v_caches):
        return self.model(ids, positions, GraphStepMeta(key), k_caches=k_caches, v_caches=v_caches)


class StepGraph:
    """Callable on any batch of MIN_TOKENS..max_tokens tokens: (ids, positions, AttentionMetadata)
    -> hidden states [T, dim], writing the new K/V into the caches."""

    def __init__(self, model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 block_size: int, max_tokens: int):
        self.k_caches, self.v_caches = k_caches, v_caches
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.num_blocks = k_caches[0].shape[1] // block_size
        self.context_length = model.config.context_length
        self._step = compile_private(_Step(model), "mixed_step")
        self.ready = False

    def accepts(self, num_tokens: int) -> bool:
        return self.ready and MIN_TOKENS <= num_tokens <= self.max_tokens

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        key = next(_keys)
        register_step_meta(key, meta)
        try:
            for t in (ids, positions):
                torch._dynamo.mark_dynamic(t, 0, min=MIN_TOKENS, max=self.max_tokens)
            return self._step(ids, positions, torch.tensor([key]), self.k_caches, self.v_caches)
        finally:
            unregister_step_meta(key)

    @torch.inference_mode()
    def warmup(self) -> float:
        """Compile on a dummy batch of max_tokens tokens in a few prompt chunks (the size hint
        inductor tunes its loops for). Like DecodeGraph.warmup, it writes K/V into the first blocks,
        so it runs before any sequence owns one. Returns the seconds it took."""
        start = time.perf_counter()
        n = min(self.max_tokens, self.num_blocks * self.block_size)
        if n < MIN_TOKENS:  # a cache too small for any batch the graph would take
            return 0.0
        chunks = max(1, min(WARMUP_CHUNKS, n // MIN_TOKENS))
        sizes = [n // chunks + (i < n % chunks) for i in range(chunks)]
        table = list(range(self.num_blocks))
        specs = [ChunkSpec(table, 0, size) for size in sizes]
        # Dummy positions, kept inside the rotary table: an index error inside a compiled kernel aborts.
        positions = torch.cat([torch.arange(size) for size in sizes]) % self.context_length
        self(torch.zeros(n, dtype=torch.long), positions, AttentionMetadata.build(specs, self.block_size))
        self.ready = True
        seconds = time.perf_counter() - start
        log.info("prefill/mixed step graph compiled in %.1f s", seconds)
        return seconds
