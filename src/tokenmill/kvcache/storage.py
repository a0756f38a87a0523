"""The K/V tensors behind the block manager: one K and one V buffer per layer, head-major
[kv_heads, slots, head_dim], addressed by slot (block_id * block_size + offset). Head-major so that
gathering whole blocks gives attention contiguous per-head keys; one buffer per layer, not one
stacked tensor, so writing a layer's slots never touches (or makes a compiled graph copy) the rest.

The buffers are anonymous memory mappings: zeros that the OS backs with pages only when a slot is
first written, so the default 64k-token budget (about 1.4 GB for SmolLM2) costs resident memory only
as far as it is used. Zeros matter: attention reads the padding slots of a partly filled block and
weights them by 0, and 0 x NaN of uninitialised memory would be NaN."""
from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages are committed on first write (the tensor keeps the mapping alive)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class KVStorage:
    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        num_slots = num_blocks * block_size
        shape = (n_kv_heads, num_slots, head_dim)
        self.k = [lazy_zeros(shape, dtype) for _ in range(n_layers)]
        self.v = [lazy_zeros(shape, dtype) for _ in range(n_layers)]

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
