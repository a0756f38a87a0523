"""Turns a scheduled batch into flat tensors and runs the model on it, in micro-batches of at most
`n_ubatch` tokens. Only rows that sample get logits."""
from __future__ import annotations

import torch

from tokenmill.engine.scheduler import ScheduledBatch, ScheduledChunk
from tokenmill.kvcache import BlockManager
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import AttentionMetadata, ChunkSpec


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
    def __init__(self, model: torch.nn.Module, kv: KVStorage, blocks: BlockManager, n_ubatch: int):
        self.model = model
        self.kv = kv
        self.blocks = blocks
        self.n_ubatch = n_ubatch

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
            meta = AttentionMetadata.build(specs, bs)
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv)
            if sample_rows:
                logits.append(self.model.logits(hidden, torch.tensor(sample_rows)))
        return torch.cat(logits) if logits else None
