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


@torch.inference_mode()
def paged_steps(model, prompts: list[list[int]], block: int = BLOCK) -> list[torch.Tensor]:
    """Two prompts prefilled together in one step over a paged cache (scattered blocks), then three
    decode steps of both: each step's hidden states and logits, for comparing two paths bitwise."""
    cfg = model.config
    kv = KVStorage(cfg.n_layers, 8, block, cfg.n_kv_heads, cfg.head_dim, torch.float16)
    tables = [[7, 5, 3, 1], [6, 4, 2, 0]]
    tokens = [p + [7, 9, 11] for p in prompts]
    steps = [[(0, 0, len(prompts[0])), (1, 0, len(prompts[1]))]]
    steps += [[(0, len(prompts[0]) + i, 1), (1, len(prompts[1]) + i, 1)] for i in range(3)]
    out = []
    for step in steps:
        ids = [t for s, start, n in step for t in tokens[s][start:start + n]]
        positions = [p for _, start, n in step for p in range(start, start + n)]
        meta = PagedBatch.build([ChunkSpec(tables[s], start, n) for s, start, n in step], block)
        hidden = model(torch.tensor(ids), torch.tensor(positions), meta, kv)
        out += [hidden.clone(), model.logits(hidden)]
    return out


def assert_native_step_is_the_per_op_path(path, variant: str) -> None:
    """A gguf-mode model of this file on this variant: the native step takes it, and two prompts'
    prefill and decode steps (paged_steps) give bitwise the per-op path's hidden states and logits."""
    from tokenmill.kernels import use_variant
    from tokenmill.model import load_model, native_step

    prompts = [torch.randint(6, 260, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 29)]
    with use_variant(variant):
        model = load_model(path, "gguf").model
        cfg = model.config
        kv = KVStorage(cfg.n_layers, 8, BLOCK, cfg.n_kv_heads, cfg.head_dim, torch.float16)
        assert model.native_steps.get(model, PagedBatch.build([ChunkSpec([0], 0, 1)], BLOCK), kv,
                                      torch.zeros(1)) is not None  # the native step takes this model
        got = paged_steps(model, prompts)
        with native_step.disabled():
            want = paged_steps(model, prompts)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"output {i}: max |diff| {float((g - w).abs().max())}"
