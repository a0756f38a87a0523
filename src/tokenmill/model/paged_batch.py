"""A step's batch as the native paged-attention kernel reads it (kernels/attention.py): every row,
prompt or decode, attends over the cache by its sequence's block table and its own position, with
the same arithmetic however the rows are grouped into steps and chunks. That is what makes greedy
output independent of batching and of where a prompt was cut."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tokenmill.kernels import attention as native_attention
from tokenmill.kvcache.storage import LayerKV
from tokenmill.model.attention import ChunkSpec
from tokenmill.model.host_tensors import host_tensor


@dataclass
class PagedBatch:
    slot_mapping: torch.Tensor  # int64 [T]: cache slot each new token's K/V goes to
    cu_rows: torch.Tensor       # int32 [S+1]: sequence s owns rows cu_rows[s]..cu_rows[s+1]-1
    start_pos: torch.Tensor     # int32 [S]: position of each sequence's first row
    block_tables: torch.Tensor  # int32 [S, W]: each sequence's blocks, padded
    block_size: int

    @classmethod
    def build(cls, chunks: Sequence[ChunkSpec], block_size: int) -> "PagedBatch":
        slots: list[int] = []
        cu = [0]
        tables: list[list[int]] = []
        for c in chunks:
            total = c.num_cached + c.num_new
            num_blocks = -(-total // block_size)
            if len(c.block_table) < num_blocks:
                raise ValueError(f"block table covers {len(c.block_table) * block_size} tokens, chunk needs {total}")
            table = list(c.block_table[:num_blocks])
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c.num_cached, total))
            cu.append(cu[-1] + c.num_new)
            tables.append(table)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return cls(host_tensor(slots, torch.int64), host_tensor(cu, torch.int32),
                   host_tensor([c.num_cached for c in chunks], torch.int32), host_tensor(padded, torch.int32), block_size)


def write_and_attend_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, batch: PagedBatch,
                            scale: float, window: int, softcap: float = 0.0) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] (fp32): write this step's K/V, then attend. Returns [T, H, D]."""
    empty = torch.empty(0)
    k_scale = cache.k_scale if cache.k_scale is not None else empty
    v_scale = cache.v_scale if cache.v_scale is not None else empty
    native_attention.write_kv(k, v, cache.k, cache.v, k_scale, v_scale, batch.slot_mapping)
    return native_attention.paged_attention(q, cache.k, cache.v, k_scale, v_scale, batch.cu_rows, batch.start_pos,
                                            batch.block_tables, batch.block_size, scale, window, softcap)
