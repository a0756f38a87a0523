"""A linear layer that keeps two forms of its weight and picks one per call by batch size.

Dense bf16 wins from ~8 rows up (compute bound); at a few rows the product is memory bound and
int4 weight-only (`_weight_int4pack_mm_for_cpu`) reads 4x fewer bytes. GGUF Q4_0/Q4_1 blocks convert
to that int4 format without requantizing: a 32-value group with scale d and offset m becomes
w = (q - 8) * d + (m + 8d). The scales are held in bf16, which rounds them like the dense bf16 copy."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gguf

Q = gguf.GGMLQuantizationType
INT4_GROUP = 32
# Rows at or below which the int4 form is used (measured crossover on AVX-512 CPUs is ~4-8 rows).
INT4_MAX_ROWS = 4


class Int4Weight:
    """Packed int4 weight with per-32 group scales and zeros, plus the integer values it came from
    (kept only until packing, so fused layers can concatenate before packing)."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
        self.values = values  # int32 [N, K], 0..15
        self.scales = scales  # float32 [N, K/32]
        self.zeros = zeros    # float32 [N, K/32]: w = values * scale + zero
        self.packed: torch.Tensor | None = None
        self.scales_and_zeros: torch.Tensor | None = None

    @classmethod
    def from_gguf(cls, data: np.ndarray, ggml_type: Q, shape: tuple[int, int]) -> "Int4Weight | None":
        if ggml_type not in (Q.Q4_0, Q.Q4_1):
            return None
        n, k = shape
        block_bytes = 18 if ggml_type == Q.Q4_0 else 20
        blocks = torch.from_numpy(np.array(data, copy=True)).view(n, k // 32, block_bytes)
        d = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
        if ggml_type == Q.Q4_0:  # w = d * (q - 8)
            m, nibbles = -8 * d, blocks[..., 2:]
        else:                    # w = d * q + m
            m, nibbles = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1), blocks[..., 4:]
        nibbles = nibbles.to(torch.int32)
        values = torch.cat([nibbles & 0xF, nibbles >> 4], -1).view(n, k)  # low nibbles hold the first 16
        return cls(values, d, m)

    @staticmethod
    def concat(parts: list["Int4Weight"]) -> "Int4Weight":
        return Int4Weight(torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.zeros for p in parts]))

    def permute_rows(self, order: torch.Tensor) -> "Int4Weight":
        return Int4Weight(self.values[order], self.scales[order], self.zeros[order])

    def pack(self) -> None:
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.values, 1)
        sz = torch.stack([self.scales, self.zeros + 8 * self.scales], -1)  # the kernel computes (q-8)*s+z
        self.scales_and_zeros = sz.transpose(0, 1).contiguous().to(torch.bfloat16)
        self.values = self.scales = self.zeros = None  # type: ignore[assignment]

    def dequantize(self) -> torch.Tensor:
        n, k = self.values.shape
        w = self.values.view(n, k // 32, 32).float() * self.scales[..., None] + self.zeros[..., None]
        return w.view(n, k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)


class Linear(nn.Module):
    """y = x @ W^T with W dense (engine dtype) and, when the GGUF held it as 4-bit blocks and the
    engine runs in bf16, also int4-packed for few-row calls."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.int4: Int4Weight | None = None

    def set_int4(self, w: Int4Weight | None) -> None:
        if w is not None and self.weight.dtype == torch.bfloat16:
            w.pack()
            self.int4 = w
        else:
            self.int4 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None and x.shape[0] <= INT4_MAX_ROWS:
            return self.int4.matmul(x)
        return F.linear(x, self.weight)
