"""Decode-only steps through a torch.compile'd forward.

Eager PyTorch pays a few microseconds per op and a decode step runs ~1,400 of them; at one sequence
that overhead is most of the step, and at 64 sequences the eager attention copies every sequence's
K/V out of the paged cache. Compiled, inductor fuses the norms, rotary, activations and the paged
gather into the attention reductions, leaving the matmuls as the only library calls.

Two graphs cover every decode batch: one sequence (static shape, where the int4 weights are used)
and 2..MAX_BATCH sequences with the batch and the block-table width dynamic, so neither the number of
sequences nor their context lengths ever recompile. Inductor's on-disk cache (kept under
~/.cache/tokenmill/inductor) turns the first compile (about a minute per graph on 2 cores) into
seconds on later starts. Compilation happens in `warmup()`, before the engine takes requests."""
from __future__ import annotations

import itertools
import logging
import os
import time
import types
from pathlib import Path

import torch
from torch import nn

from tokenmill.model.attention import GraphDecodeMeta

log = logging.getLogger(__name__)

MAX_BATCH = 512
MAX_BLOCKS = 256   # most block-table width the dynamic graph is guarded for; wider tables run eagerly
MIN_BLOCKS = 2     # tables are padded to at least this, so width 1 never specialises the graph
WARMUP_BATCH, WARMUP_BLOCKS = 64, 16
_graph_ids = itertools.count()


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "inductor"


def compile_private(step: nn.Module, name: str):
    """torch.compile of step.forward under a code object of its own. Dynamo keys compiled code by
    code object; one per graph keeps the graphs of different engines (a model switch, tests) apart,
    which makes it safe to drop the guards on the modules' attributes (about 1 ms per call): the
    weights never change."""
    fn = type(step).forward
    code = fn.__code__.replace(co_name=f"{name}_{next(_graph_ids)}")
    forward = types.MethodType(types.FunctionType(code, fn.__globals__, code.co_name), step)
    return torch.compile(forward, dynamic=False, fullgraph=True,
                         options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})


class _DecodeStep(nn.Module):
    def __init__(self, model: nn.Module, block_size: int):
        super().__init__()
        self.model = model
        self.block_size = block_size

    def forward(self, ids, positions, slot_mapping, block_ids, lens, k_caches, v_caches):
        meta = GraphDecodeMeta.build(slot_mapping, block_ids, lens, self.block_size)
        hidden = self.model(ids, positions, meta, k_caches=k_caches, v_caches=v_caches)
        return self.model.logits(hidden)


class DecodeGraph:
    """Callable on a decode-only batch: (ids, positions, slot_mapping, block_ids [B, W], lens) ->
    logits [B, vocab] in the model's dtype, writing the new K/V into the caches."""

    def __init__(self, model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 block_size: int, cache_dir: Path | None = None):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir or default_cache_dir()))
        self.k_caches, self.v_caches = k_caches, v_caches
        self.block_size = block_size
        self.num_blocks = k_caches[0].shape[1] // block_size
        self.context_length = model.config.context_length
        # Declare only the widths a table can have (the context's blocks): with 64-token blocks a
        # declared 256 failed the compile (dynamo derived a smaller bound: ConstraintViolationError).
        self.max_blocks = max(MIN_BLOCKS, min(MAX_BLOCKS, -(-self.context_length // block_size)))
        self._step = compile_private(_DecodeStep(model, block_size), "decode_step")
        self.ready = False

    def accepts(self, batch_size: int, table_width: int) -> bool:
        return self.ready and 1 <= batch_size <= MAX_BATCH and table_width <= self.max_blocks

    def padded_width(self, table_width: int) -> int:
        return max(MIN_BLOCKS, table_width)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        inputs = (ids, positions, slot_mapping, block_ids, lens)
        if ids.shape[0] > 1:
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0, min=2, max=MAX_BATCH)
        torch._dynamo.mark_dynamic(block_ids, 1, min=MIN_BLOCKS, max=self.max_blocks)
        return self._step(*inputs, self.k_caches, self.v_caches)

    @torch.inference_mode()
    def warmup(self) -> float:
        """Compile both graphs on dummy batches. Must run before any sequence owns a block: the
        dummy tokens write K/V into the first blocks. The dummy sizes are the size hints inductor
        tunes loops for (with hints of 2 rows it ran the softmax on one thread), so they are a
        typical serving batch: 64 sequences (and one) of 256 tokens. Returns the seconds it took."""
        start = time.perf_counter()
        slots_total = self.num_blocks * self.block_size
        width = max(MIN_BLOCKS, min(WARMUP_BLOCKS, self.num_blocks, self.max_blocks))
        keys = width * self.block_size
        for batch in (1, WARMUP_BATCH):
            rows = torch.arange(batch)
            block_ids = torch.arange(width).remainder(self.num_blocks).repeat(batch, 1)
            # Positions stay inside the rotary table: an index error inside a compiled kernel aborts.
            positions = rows % min(keys, self.context_length)
            self(torch.zeros(batch, dtype=torch.long), positions, rows % slots_total, block_ids,
                 torch.full((batch,), keys))
        self.ready = True
        seconds = time.perf_counter() - start
        log.info("decode graphs compiled in %.1f s", seconds)
        return seconds
