"""Dequantize GGUF tensors into torch tensors of the engine dtype."""
from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import quants

from tokenmill.gguf.reader import GGUFError, GGUFFile, TensorInfo

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K,
})


def check_supported(g: GGUFFile) -> None:
    for t in g.tensors.values():
        if t.ggml_type not in SUPPORTED_TYPES:
            names = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            raise GGUFError(f"{g.path}: tensor {t.name} has unsupported type {t.ggml_type.name} (supported: {names})")


def dequantize(t: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
    try:
        if t.ggml_type == Q.F32:
            arr = np.array(t.data, dtype=np.float32)  # copy: the memmap is read-only
        elif t.ggml_type == Q.F16:
            arr = np.asarray(t.data).astype(np.float32)
        else:
            arr = quants.dequantize(t.data, t.ggml_type)
        out = torch.from_numpy(np.ascontiguousarray(arr)).reshape(t.shape)
    except (ValueError, IndexError, NotImplementedError) as exc:
        raise GGUFError(f"tensor {t.name} ({t.ggml_type.name}, shape {t.shape}) cannot be read: {exc}") from exc
    return out.to(dtype)
