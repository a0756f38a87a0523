"""The K/V tensors behind the block manager: one K and one V buffer per layer, head-major
[kv_heads, slots, head_dim], addressed by slot (block_id * block_size + offset). Head-major so that
gathering whole blocks gives attention contiguous per-head keys; one buffer per layer, not one
stacked tensor, so writing a layer's slots never touches (or makes a compiled graph copy) the rest.

An int8 cache (kv_dtype "int8", as llama.cpp's q8_0 cache types) also keeps one float32 scale per
token and head. A lazy cache (the native attention path, which never reads a slot before it is
written) is allocated uninitialised, so the memory a process holds grows with what is used.

On a GPU (`device`) the same layout holds bf16 keys and values, which the device kernels
(kernels/gpu) address by the same slots and block tables."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerKV:
    """One layer's view of the cache, as attention takes it."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [kv_heads, slots] float32, int8 caches only
    v_scale: torch.Tensor | None = None


class KVStorage:
    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, *, lazy: bool = False, device: torch.device | str = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        num_slots = num_blocks * block_size
        alloc = torch.empty if lazy else torch.zeros
        self.k = [alloc(n_kv_heads, num_slots, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [alloc(n_kv_heads, num_slots, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        scaled = dtype == torch.int8
        self.k_scale = [alloc(n_kv_heads, num_slots, device=device) for _ in range(n_layers)] if scaled else []
        self.v_scale = [alloc(n_kv_heads, num_slots, device=device) for _ in range(n_layers)] if scaled else []

    def layer(self, i: int) -> LayerKV:
        if self.k_scale:
            return LayerKV(self.k[i], self.v[i], self.k_scale[i], self.v_scale[i])
        return LayerKV(self.k[i], self.v[i])

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        per_value = torch.empty(0, dtype=dtype).element_size()
        scales = 4 * 2 * n_layers * n_kv_heads if dtype == torch.int8 else 0
        return 2 * n_layers * n_kv_heads * head_dim * per_value + scales

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.k_scale + self.v_scale)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of shared blocks)."""
        if not pairs:
            return
        src = torch.as_tensor([s for s, _ in pairs], device=self.device)
        dst = torch.as_tensor([d for _, d in pairs], device=self.device)
        for buf in self.k + self.v + self.k_scale + self.v_scale:
            blocks = buf.view(buf.shape[0], self.num_blocks, -1)
            blocks.index_copy_(1, dst, blocks.index_select(1, src))
