"""Turns a scheduled batch into flat tensors and runs the model on it, in micro-batches of at most
`n_ubatch` tokens. Only rows that sample get logits."""
from __future__ import annotations

import torch

from tokenmill.engine.scheduler import ScheduledBatch, ScheduledChunk
from tokenmill.kvcache import BlockManager
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import AttentionMetadata, ChunkSpec
from tokenmill.model.decode_graph import DecodeGraph


def split_ubatches(chunks: list[ScheduledChunk], n_ubatch: int) -> list[list[tuple[ScheduledChunk, int, int]]]:
    """Cut the step's chunks into micro-batches of <= n_ubatch tokens, splitting long prefill chunks.
    Items are (chunk, start, num_new); later pieces of a chunk see earlier ones through the cache."""
    ubatches: list[list[tuple[ScheduledChunk, int, int]]] = [[]]
    room = n_ubatch
    for chunk in chunks:
        start, left = chunk.start, chunk.num_new
        while left:
            if room == 0:
                ubatches.append([])
                room = n_ubatch
            take = min(left, room)
            ubatches[-1].append((chunk, start, take))
            start, left, room = start + take, left - take, room - take
    return [u for u in ubatches if u]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVStorage, blocks: BlockManager, n_ubatch: int,
                 decode_graph: DecodeGraph | None = None):
        self.model = model
        self.kv = kv
        self.blocks = blocks
        self.n_ubatch = n_ubatch
        self.decode_graph = decode_graph
        self.graph_steps = 0  # micro-batches that ran through the compiled decode graph

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Logits [num sampling chunks, vocab] (float32) in batch order, or None if nobody samples."""
        bs = self.kv.block_size
        logits: list[torch.Tensor] = []
        for ubatch in split_ubatches(batch.chunks, self.n_ubatch):
            ids: list[int] = []
            positions: list[int] = []
            specs: list[ChunkSpec] = []
            sample_rows: list[int] = []
            for chunk, start, num_new in ubatch:
                all_ids = chunk.seq.all_token_ids
                ids.extend(all_ids[start:start + num_new])
                positions.extend(range(start, start + num_new))
                specs.append(ChunkSpec(self.blocks.block_table(chunk.seq.seq_id), start, num_new))
                if chunk.samples and start + num_new == chunk.start + chunk.num_new:
                    sample_rows.append(len(ids) - 1)
            if self._graph_fits(specs, sample_rows):
                logits.append(self._run_graph(ids, positions, specs))
                continue
            meta = AttentionMetadata.build(specs, bs)
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv)
            if sample_rows:
                logits.append(self.model.logits(hidden, torch.tensor(sample_rows)))
        if not logits:
            return None
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _graph_fits(self, specs: list[ChunkSpec], sample_rows: list[int]) -> bool:
        """Decode-only micro-batches where every row samples go through the compiled graph."""
        g = self.decode_graph
        if g is None or not g.ready or len(sample_rows) != len(specs) or any(s.num_new != 1 for s in specs):
            return False
        width = max(-(-(s.num_cached + 1) // self.kv.block_size) for s in specs)
        return g.accepts(len(specs), width)

    def _run_graph(self, ids: list[int], positions: list[int], specs: list[ChunkSpec]) -> torch.Tensor:
        bs = self.kv.block_size
        lens = [s.num_cached + 1 for s in specs]
        width = self.decode_graph.padded_width(max(-(-n // bs) for n in lens))
        tables = [list(s.block_table[:-(-n // bs)]) for s, n in zip(specs, lens)]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        block_ids = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        self.graph_steps += 1
        return self.decode_graph(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), block_ids,
                                 torch.tensor(lens))
