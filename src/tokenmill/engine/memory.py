"""How much memory an engine holds, and a KV cache sized to fit a budget: what the server's model
scheduler needs to keep several models within the machine's RAM."""
from __future__ import annotations

import os
from dataclasses import replace

from tokenmill.engine.config import ConfigError, EngineConfig
from tokenmill.engine.engine import LLMEngine, kv_cache_dtype
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import LoadedModel

# Fewer KV tokens than this and a model cannot serve even a short conversation: refuse to load.
MIN_KV_TOKENS = 256


def kv_bytes_per_token(cfg: EngineConfig, loaded: LoadedModel, draft: LoadedModel | None = None) -> int:
    """A token slot's K/V bytes: the model's, plus a draft model's (speculative/build.py gives the draft
    as many slots as the target, in the target's KV dtype)."""
    dtype = kv_cache_dtype(cfg, loaded)
    return sum(KVStorage.bytes_per_token(m.config.n_layers, m.config.n_kv_heads, m.config.head_dim, dtype)
               for m in (loaded, draft) if m is not None)


def weights_bytes(loaded: LoadedModel) -> int:
    """GGUF weights are used as the file holds them; dense modes hold their own (larger) copies."""
    seen, dense = set(), 0
    for t in [*loaded.model.parameters(), *loaded.model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            dense += t.untyped_storage().nbytes()
    try:
        file_bytes = os.path.getsize(loaded.gguf.path)
    except OSError:  # the file went away after loading: the dense count is what is left to go on
        file_bytes = 0
    return max(dense, file_bytes) + kept_bytes(loaded)


def kept_bytes(loaded: LoadedModel) -> int:
    """What the model keeps beside its weights as loaded (a greedy head's 6-bit copy, made at its first
    greedy step): taken from the KV cache's share of a memory budget."""
    head_bytes = getattr(loaded.model, "greedy_head_bytes", None)
    return head_bytes() if head_bytes is not None else 0


def fit_kv_cache(cfg: EngineConfig, loaded: LoadedModel, max_kv_bytes: int | None,
                 draft: LoadedModel | None = None) -> EngineConfig:
    """cfg with max_total_tokens lowered so the KV cache (and a draft model's, slot for slot) takes at
    most max_kv_bytes (None: as is)."""
    if max_kv_bytes is None:
        return cfg
    max_kv_bytes -= kept_bytes(loaded)
    per_token = kv_bytes_per_token(cfg, loaded, draft)
    tokens = min(cfg.max_total_tokens, max_kv_bytes // per_token) // cfg.block_size * cfg.block_size
    if tokens < min(MIN_KV_TOKENS, cfg.max_total_tokens):
        raise ConfigError(f"not enough memory for a KV cache: {max_kv_bytes / 2**20:.0f} MiB left in the budget, "
                          f"{MIN_KV_TOKENS} tokens need {MIN_KV_TOKENS * per_token / 2**20:.0f} MiB")
    return cfg if tokens == cfg.max_total_tokens else replace(cfg, max_total_tokens=tokens)


def engine_bytes(engine: LLMEngine) -> int:
    """Weights plus the whole KV cache (allocated lazily, so RSS grows toward this as it fills), and a
    draft model's own weights and cache when it speculates with one."""
    speculator = engine.scheduler.speculator
    return weights_bytes(engine.loaded) + engine.kv.nbytes + (speculator.nbytes if speculator is not None else 0)


def gpu_bytes(engine: LLMEngine) -> int:
    """What the engine holds in GPU memory (Ollama's size_vram): its bf16 weights and its KV cache,
    both allocated at load; 0 for a model on the CPU."""
    if engine.loaded.device.type == "cpu":
        return 0
    return engine_bytes(engine)
