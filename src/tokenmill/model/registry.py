"""general.architecture -> model class, and the one function that turns a GGUF path into a ready model."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.gguf.config import ModelConfig
from tokenmill.gguf.reader import GGUFError, GGUFFile, open_gguf
from tokenmill.gguf.weights import check_supported, iter_dequantized
from tokenmill.model.linear import Int4Weight
from tokenmill.model.gemma3 import Gemma3Model
from tokenmill.model.llama import LlamaModel

ARCHITECTURES: dict[str, type] = {"llama": LlamaModel, "gemma3": Gemma3Model}

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


class ModelLoadError(Exception):
    """The model cannot be loaded; the message names the problem."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    gguf: GGUFFile
    dtype: torch.dtype
    load_seconds: float


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})") from None


def load_model(path: str | Path, dtype: str | torch.dtype = torch.bfloat16, *, progress: bool = False,
               int4: bool = True) -> LoadedModel:
    """Load a GGUF model. With `int4` (and bf16), 4-bit GGUF weights are also kept int4-packed for
    few-row steps (see model/linear.py)."""
    start = time.perf_counter()
    dtype = resolve_dtype(dtype)
    try:
        g = open_gguf(path)
        arch = g.architecture
        if arch not in ARCHITECTURES:
            raise ModelLoadError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
        check_supported(g)
        cfg = ModelConfig.from_gguf(g)
        with torch.device("cpu"):
            model = ARCHITECTURES[arch](cfg)
        pending: dict = {}
        for name, tensor in iter_dequantized(g, model.gguf_tensor_names(), dtype, progress=progress):
            info = g.tensors[name]
            packed = Int4Weight.from_gguf(info.data, info.ggml_type, info.shape) if int4 and len(info.shape) == 2 else None
            model.load_tensor(name, tensor, packed, pending)
        if pending:
            raise ModelLoadError(f"{path}: tensors without their fused siblings: {sorted(pending)[:4]}")
        model.rope.to(torch.float32)
        model.pack_weights()
        model.eval()
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from exc
    return LoadedModel(model, cfg, g, dtype, time.perf_counter() - start)
