"""Tiny LoRA adapters in llama.cpp's GGUF form, for a tiny base model (tiny_model.py), and the base's
weights with the adapter's update added in numpy: the reference a merged model is held to."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tokenmill.gguf.lora import MergedTensor, write_adapter
from tokenmill.gguf.reader import open_gguf
from tokenmill.gguf.rewrite import write_replaced

Q = gguf.GGMLQuantizationType
TARGETS = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.1.attn_output.weight", "blk.1.ffn_down.weight",
           "blk.0.ffn_up.weight")


def write_lora(path: Path | str, base: Path | str, targets=TARGETS, *, rank: int = 4, alpha: float | None = 8.0,
               seed: int = 0, size: float = 0.5, arch: str | None = None, dtype=np.float32,
               extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write a random adapter of `targets` (tensors of `base`) at `path`; returns each target's update
    (alpha / rank * B @ A, float64). `extra`: more tensors, written as they are (broken adapters)."""
    g = open_gguf(base)
    rng = np.random.default_rng(seed)
    pairs, updates = {}, {}
    for name in targets:
        outputs, inputs = g.tensors[name].shape
        a = rng.normal(0, size, (rank, inputs)).astype(dtype)
        b = rng.normal(0, size, (outputs, rank)).astype(dtype)
        pairs[name] = (a, b)
        scale = alpha / rank if alpha else 1.0
        updates[name] = scale * (b.astype(np.float64) @ a.astype(np.float64))
    write_adapter(path, arch or g.architecture, pairs, alpha, extra)
    return updates


def write_updated(path: Path | str, base: Path | str, updates: dict[str, np.ndarray]) -> Path:
    """`base` with each update added to its (dequantized) weight, stored as F32: the reference."""
    from tokenmill.gguf.weights import dequantize
    import torch

    g = open_gguf(base)
    replaced = {}
    for name, u in updates.items():
        w = (dequantize(g.tensors[name], torch.float64).numpy() + u).astype(np.float32)
        replaced[name] = MergedTensor(Q.F32, w.shape, lambda w=w: w)
    with open(path, "wb") as f:
        write_replaced(g, replaced, f.write)
    return Path(path)
