"""Token embedding rows looked up from a Q8_0 table as the GGUF file stores it (csrc/embedding.cpp):
model/quantized.py's EmbeddingRows takes it for the Q8_0 token_embd of both real models. The reference
is gguf's own arithmetic (float(q) * float(scale) per block of 32), which the kernel matches bit for bit."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from tokenmill.kernels import native

__all__ = ["Q8_0_BLOCK_BYTES", "dequantize_q8_0", "embed_rows_q8_0", "embed_rows_q8_0_reference"]

Q8_0_BLOCK_BYTES = 34  # an fp16 scale, then 32 int8


def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (uint8, any shape holding whole blocks) -> float32 [blocks, 32]: gguf's own
    arithmetic, float(q) * float(scale), without its generic per-type machinery."""
    blocks = np.asarray(data).reshape(-1, Q8_0_BLOCK_BYTES)
    return blocks[:, 2:].view(np.int8).astype(np.float32) * blocks[:, :2].view(np.float16).astype(np.float32)


def embed_rows_q8_0_reference(table: np.ndarray, ids: Tensor, dim: int) -> Tensor:
    """fp32 [len(ids), dim]: rows `ids` of table (uint8 [vocab, dim / 32 * 34]), dequantized."""
    rows = dequantize_q8_0(np.asarray(table)[ids.numpy()])
    return torch.from_numpy(np.array(rows, dtype=np.float32)).reshape(ids.numel(), dim)  # a copy: the map is read-only


def embed_rows_q8_0(table: np.ndarray, ids: Tensor, dim: int) -> Tensor:
    """As the reference; the compiled kernel when it is built and the table is C-contiguous rows."""
    m = native.module()
    if m is None or not table.flags.c_contiguous or table.ndim != 2 or dim % 32:
        return embed_rows_q8_0_reference(table, ids, dim)
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), dim), dtype=torch.float32)
    m.embed_rows_q8_0(table.ctypes.data, table.shape[0], dim, ids.data_ptr(), ids.numel(), out.data_ptr())
    return out
