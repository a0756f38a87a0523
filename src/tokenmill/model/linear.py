"""A linear layer that keeps two forms of its weight and picks one per call by batch size.

Dense bf16 wins from a few rows up (compute bound); at one row the product is memory bound and
int4 weight-only (`_weight_int4pack_mm_for_cpu`) reads 4x fewer bytes. The dense bf16 form is
reordered once into oneDNN's blocked layout (`mkldnn._linear_pointwise`), which measured 1.1x
faster than `F.linear` at 64 rows and 2x at 1-8 rows on AVX-512 BF16 CPUs, because F.linear
re-packs the weight on every call. GGUF Q4_0/Q4_1 blocks convert
to that int4 format without requantizing: a 32-value group with scale d and offset m becomes
w = (q - 8) * d + (m + 8d). The scales are held in bf16, which rounds them like the dense bf16 copy."""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gguf

from tokenmill.model.quantized import QuantizedParts, RawTensor

Q = gguf.GGMLQuantizationType
INT4_GROUP = 32
# Rows at or below which the int4 form is used. Against the oneDNN-packed bf16 form, int4 only wins
# when the weights stream from memory, i.e. a single sequence decoding.
INT4_MAX_ROWS = 1


def onednn_bf16_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


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


@dataclass
class GGUFWeight:
    """One 2-D GGUF tensor as the loader hands it to a layer: dense in the engine dtype (with its
    int4 form, if it has one), or in the gguf weight mode only its raw rows."""
    dense: torch.Tensor | None = None
    int4: Int4Weight | None = None
    raw: RawTensor | None = None

    def permute_rows(self, order: torch.Tensor) -> "GGUFWeight":
        return replace(self, dense=None if self.dense is None else self.dense[order],
                       int4=None if self.int4 is None else self.int4.permute_rows(order),
                       raw=None if self.raw is None else self.raw.permute_rows(order))


class Linear(nn.Module):
    """y = x @ W^T with W in one of two kinds of form. Dense (engine dtype) and, when the GGUF held
    it as 4-bit blocks and the engine runs in bf16, also int4-packed for few-row calls; or, in the
    gguf weight mode, the GGUF blocks themselves through the native kernels (model/quantized.py)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.int4: Int4Weight | None = None
        self.packed: PackedWeight | None = None  # oneDNN-blocked copy of a bf16 weight
        self.quantized: QuantizedParts | None = None
        # Added to the product (Qwen2's q, k and v projections have one); kept in the activations' dtype
        # (float32 in the gguf weight mode), added after the matmul in every form, as one more op.
        self.bias: nn.Parameter | None = None

    def set_bias(self, bias: torch.Tensor) -> None:
        if bias.shape != (self.out_features,):
            raise ValueError(f"a bias of shape {list(bias.shape)} for {self.out_features} outputs")
        self.bias = nn.Parameter(bias.contiguous(), requires_grad=False)

    @property
    def out_features(self) -> int:
        if self.quantized is not None:
            return self.quantized.out_features
        return self.weight.shape[0]

    def pack_dense(self) -> None:
        if self.quantized is None:
            self.packed = pack_bf16(self.weight.data, self)

    def load(self, w: GGUFWeight) -> None:
        self.load_parts([w])

    def load_parts(self, parts: list[GGUFWeight]) -> None:
        """A fused projection's weight from its GGUF parts (e.g. Q, K, V), stacked by rows; int4 only
        if every part has an int4 form."""
        if parts[0].raw is not None:
            self.quantized = QuantizedParts([p.raw for p in parts])
            self.weight.data = torch.empty(0)
            return
        self.weight.data = torch.cat([p.dense for p in parts])
        int4 = [p.int4 for p in parts]
        self.set_int4(None if None in int4 else Int4Weight.concat(int4))

    def set_int4(self, w: Int4Weight | None) -> None:
        if w is not None and self.weight.dtype == torch.bfloat16:
            w.pack()
            self.int4 = w
        else:
            self.int4 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x)
        return y if self.bias is None else y + self.bias

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.matmul(x)
        if self.int4 is not None and x.shape[0] <= INT4_MAX_ROWS:
            return self.int4.matmul(x)
        return dense_linear(x, self.weight, self.packed)


# oneDNN-packed weights live in this registry and graphs name them by handle: a packed (opaque
# layout) tensor cannot be a torch.compile input, and inductor's own packing (freezing) turns off its
# on-disk cache. Handles are handed out in load order, so a process's first model gets the same
# graph key on every start. An entry goes when its owner (a layer, a model) is collected.
_PACKED: dict[int, torch.Tensor] = {}
_handles = itertools.count()


@dataclass(frozen=True)
class PackedWeight:
    handle: int
    out_features: int


def pack_bf16(weight: torch.Tensor, owner: object) -> PackedWeight | None:
    """A bf16 weight reordered for oneDNN once, or None. fp32 stays on F.linear, the path the fp32
    parity tests with transformers were measured on."""
    if weight.dtype != torch.bfloat16 or not onednn_bf16_available():
        return None
    handle = next(_handles)
    _PACKED[handle] = torch.ops.mkldnn._reorder_linear_weight(weight, 64)  # 64: the row count it is tuned for
    weakref.finalize(owner, _PACKED.pop, handle, None)
    return PackedWeight(handle, weight.shape[0])


@torch.library.custom_op("tokenmill::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[handle], None, "none", [], "")


@onednn_linear.register_fake
def _onednn_linear_shape(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


def dense_linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight)
    if torch.compiler.is_compiling():
        return onednn_linear(x, packed.handle, packed.out_features)
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[packed.handle], None, "none", [], "")  # skips custom-op dispatch
