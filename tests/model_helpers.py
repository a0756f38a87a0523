"""Drive a loaded model directly over a KV cache (no engine): prefill then greedy decode."""
from __future__ import annotations

import torch

from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import AttentionMetadata, ChunkSpec
from tokenmill.model.paged_batch import PagedBatch

BLOCK = 16


def new_cache(cfg, num_tokens: int, dtype) -> tuple[KVStorage, list[int]]:
    num_blocks = (num_tokens + BLOCK - 1) // BLOCK
    kv = KVStorage(cfg.n_layers, num_blocks, BLOCK, cfg.n_kv_heads, cfg.head_dim, dtype)
    # A scrambled block table, so tests do not pass by accident on contiguous slots.
    return kv, list(reversed(range(num_blocks)))


@torch.inference_mode()
def prefill_logits(model, ids: list[int], *, chunk: int | None = None, paged: bool = False,
                   kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Last-position logits after feeding `ids`, optionally in chunks of `chunk` tokens; `paged`
    attends through the native kernel's metadata (model/paged_batch.py) instead of PyTorch's."""
    cfg = model.config
    kv, table = new_cache(cfg, len(ids), kv_dtype or model.embed.dtype)
    step = chunk or len(ids)
    h = None
    build = PagedBatch.build if paged else AttentionMetadata.build
    for start in range(0, len(ids), step):
        part = ids[start:start + step]
        meta = build([ChunkSpec(table, start, len(part))], BLOCK)
        h = model(torch.tensor(part), torch.arange(start, start + len(part)), meta, kv)
    return model.logits(h, torch.tensor([h.shape[0] - 1]))[0]


@torch.inference_mode()
def greedy(model, ids: list[int], n: int) -> list[int]:
    cfg = model.config
    kv, table = new_cache(cfg, len(ids) + n, model.embed.dtype)
    meta = AttentionMetadata.build([ChunkSpec(table, 0, len(ids))], BLOCK)
    h = model(torch.tensor(ids), torch.arange(len(ids)), meta, kv)
    tok = int(model.logits(h, torch.tensor([len(ids) - 1]))[0].argmax())
    out = [tok]
    pos = len(ids)
    while len(out) < n:
        meta = AttentionMetadata.build([ChunkSpec(table, pos, 1)], BLOCK)
        h = model(torch.tensor([tok]), torch.tensor([pos]), meta, kv)
        tok = int(model.logits(h)[0].argmax())
        out.append(tok)
        pos += 1
    return out


def hf_model(path, dtype=torch.float32, **config):
    """transformers' model from the same GGUF file; `config` sets what its GGUF mapping leaves at the
    architecture's defaults (Qwen3's head_dim: it does not read attention.key_length)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype, **config).eval()
