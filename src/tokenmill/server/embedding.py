"""Embeddings: one forward pass over a temporary sequence, mean-pooled and L2-normalised (what
Ollama returns for a model without its own pooling). Runs on the engine thread between steps, via
AsyncEngine.call, because only that thread may touch the KV cache."""
from __future__ import annotations

import asyncio
import itertools

import torch

from tokenmill.engine import LLMEngine
from tokenmill.model import AttentionMetadata, ChunkSpec
from tokenmill.server.admission import RETRY_AFTER_SECONDS
from tokenmill.server.errors import APIError
from tokenmill.server.model_host import ServedModel

# Far above any id the engine hands out, so a temporary sequence never collides with a real one.
_seq_ids = itertools.count(10**9)


class CacheFullError(Exception):
    pass


def embed_on_engine(eng: LLMEngine, ids: list[int]) -> list[float]:
    seq_id = next(_seq_ids)
    n = len(ids)
    if not eng.blocks.can_allocate(seq_id, n):
        raise CacheFullError(f"no room in the KV cache for {n} tokens right now")
    eng.blocks.allocate(seq_id, n)
    try:
        table = eng.blocks.block_table(seq_id)
        model = eng.loaded.model
        total = None
        with torch.inference_mode():
            # In micro-batches like the runner, so a long input never builds one huge attention.
            for start in range(0, n, eng.cfg.n_ubatch):
                end = min(n, start + eng.cfg.n_ubatch)
                meta = AttentionMetadata.build([ChunkSpec(table, start, end - start)], eng.cfg.block_size)
                hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), meta, eng.kv)
                part = model.final_hidden(hidden).float().sum(dim=0)
                total = part if total is None else total + part
        pooled = total / n
        return torch.nn.functional.normalize(pooled, dim=0).tolist()
    finally:
        eng.blocks.free(seq_id)


async def embed(served: ServedModel, ids: list[int]) -> list[float]:
    try:
        return await asyncio.wrap_future(served.aengine.call(lambda eng: embed_on_engine(eng, ids)))
    except CacheFullError as exc:
        raise APIError(503, str(exc), code="cache_full", retry_after=RETRY_AFTER_SECONDS) from None


def fit_to_context(ids: list[int], limit: int, truncate: bool, field: str) -> list[int]:
    """Keep the head of an over-long input when truncation is allowed (Ollama's truncate), else 400."""
    if not ids:
        raise APIError(400, f"{field} is empty", param=field)
    if len(ids) <= limit:
        return ids
    if truncate:
        return ids[:limit]
    raise APIError(400, f"the input length exceeds the context length: {len(ids)} tokens, limit {limit}",
                   param=field, code="context_length_exceeded")


def embedding_limit(served: ServedModel) -> int:
    eng = served.engine
    return min(eng.max_model_len, eng.cfg.num_blocks * eng.cfg.block_size)
