"""The K/V tensors behind the block manager: one K and one V buffer per layer, head-major
[kv_heads, slots, head_dim], addressed by slot (block_id * block_size + offset). Head-major so that
gathering whole blocks gives attention contiguous per-head keys; one buffer per layer, not one
stacked tensor, so writing a layer's slots never touches (or makes a compiled graph copy) the rest."""
from __future__ import annotations

import torch


class KVStorage:
    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        num_slots = num_blocks * block_size
        self.k = [torch.zeros(n_kv_heads, num_slots, head_dim, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(n_kv_heads, num_slots, head_dim, dtype=dtype) for _ in range(n_layers)]

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * n_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of shared blocks)."""
        if not pairs:
            return
        src = torch.as_tensor([s for s, _ in pairs])
        dst = torch.as_tensor([d for _, d in pairs])
        for buf in self.k + self.v:
            blocks = buf.view(buf.shape[0], self.num_blocks, -1)
            blocks.index_copy_(1, dst, blocks.index_select(1, src))
