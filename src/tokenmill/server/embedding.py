"""Embeddings over HTTP: LLMEngine.embed run on the engine thread between steps (via AsyncEngine.call,
because only that thread may touch the KV cache), and fitting inputs to the context."""
from __future__ import annotations

import asyncio

from tokenmill.engine import EngineDeadError
from tokenmill.engine.engine import CacheFullError
from tokenmill.server.admission import RETRY_AFTER_SECONDS
from tokenmill.server.errors import APIError
from tokenmill.server.model_host import ServedModel
from tokenmill.server.validation import get_int


async def embed(served: ServedModel, ids: list[int]) -> list[float]:
    try:
        return await asyncio.wrap_future(served.aengine.call(lambda eng: eng.embed(ids)))
    except CacheFullError as exc:
        raise APIError(503, str(exc), code="cache_full", retry_after=RETRY_AFTER_SECONDS) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from None


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


def requested_dimensions(body: dict, served: ServedModel) -> int | None:
    """The request's `dimensions`: between 1 and the model's embedding size (more than it has is
    a 400 naming the maximum, not all of them quietly)."""
    return get_int(body, "dimensions", lo=1, hi=served.engine.loaded.config.dim)
