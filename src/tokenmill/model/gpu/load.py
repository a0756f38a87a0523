"""GGUF weights onto a device in bf16: each tensor's bytes are uploaded as the file holds them
(quantized blocks, a fraction of the dense size) and dequantized there with torch ops
(gguf/dequant_torch.py), then rounded once to bf16 — the same bits as the CPU loader's bf16 mode.
No oneDNN packing and no int4 copies: those are the CPU's own layouts.

bf16, not fp16: Gemma 3's activations overflow fp16."""
from __future__ import annotations

import torch

from tokenmill.gguf import dequant_torch
from tokenmill.gguf.reader import GGUFError, TensorInfo
from tokenmill.model.linear import GGUFWeight

DEVICE_DTYPE = torch.bfloat16
# The weight modes (model/registry.py MODES) a device model can be asked for: all mean bf16 there.
DEVICE_MODES = ("auto", "bf16", "bfloat16")


def check_device_mode(dtype: str | torch.dtype) -> None:
    """A device runs bf16 only; asking for another mode is an error rather than a silent change."""
    if dtype == DEVICE_DTYPE or dtype in DEVICE_MODES:
        return
    raise ValueError(f"dtype {dtype!r} is not available on a GPU: weights and activations there are bf16 "
                     "(use dtype auto or bf16)")


def device_weight(info: TensorInfo, device: torch.device) -> GGUFWeight:
    """One GGUF tensor as a dense bf16 weight on `device`, dequantized there."""
    data = dequant_torch.host_tensor(info.data).to(device)
    try:
        dense = dequant_torch.dequantize(data, info.ggml_type, info.shape)
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        raise GGUFError(f"tensor {info.name} ({info.ggml_type.name}, shape {info.shape}) cannot be read: {exc}") from exc
    return GGUFWeight(dense=dense.to(DEVICE_DTYPE))


def finish_on_device(model: torch.nn.Module, device: torch.device) -> None:
    """After every tensor is in: what is not a GGUF weight (the rotary tables, float32) follows them."""
    model.to(device)
