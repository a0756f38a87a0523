"""Paged-cache fixtures for the GPU kernel tests: sequences' dense K/V, scattered into a cache through
block tables that skip blocks, run in shuffled order, share blocks between sequences and carry junk
past each sequence's end; and an attention computed from the dense K/V with torch's SDPA, which
shares no code with the references (the oracle's oracle)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

JUNK_BLOCK = 1 << 20  # table entries past a sequence's blocks: reading one would fault or read junk


@dataclass
class PagedCase:
    k_cache: Tensor  # [Hkv, slots, D]
    v_cache: Tensor
    block_tables: Tensor  # int32 [S, width]
    seq_lens: Tensor  # int32 [S]
    keys: list[Tensor]  # per sequence, [seq_len, Hkv, D] float32 (the cache's values)
    values: list[Tensor]
    block_size: int


def make_case(seq_lens: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, *,
              device: str = "cpu", shared_blocks: int = 0, strided: bool = False, extra_width: int = 1,
              seed: int = 0) -> PagedCase:
    """shared_blocks: sequence 1 reads sequence 0's first blocks (its K/V there are sequence 0's).
    strided: the caches are [Hkv, slots, D] views of [slots, Hkv, D] storage."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = 2 * sum(needed) + 3  # room for gaps
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed, default=0) + extra_width
    tables = torch.full((len(seq_lens), width), JUNK_BLOCK, dtype=torch.int32)
    for s, n in enumerate(needed):
        ids = [order.pop() for _ in range(n)]
        order = order[1:]  # leave a gap
        if s == 1 and shared_blocks:
            shared = min(shared_blocks, n, needed[0])
            ids[:shared] = tables[0, :shared].tolist()
        tables[s, :n] = torch.tensor(ids, dtype=torch.int32)

    slots = num_blocks * block_size
    if strided:
        k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype).transpose(0, 1)
        v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype).transpose(0, 1)
    else:
        k_cache = torch.randn(kv_heads, slots, head_dim, generator=gen).to(dtype)
        v_cache = torch.randn(kv_heads, slots, head_dim, generator=gen).to(dtype)
    keys, values = [], []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        if s == 1 and shared_blocks:
            shared = min(shared_blocks * block_size, n, seq_lens[0])
            k[:shared], v[:shared] = keys[0][:shared].to(dtype), values[0][:shared].to(dtype)
        for pos in range(n):
            slot = int(tables[s, pos // block_size]) * block_size + pos % block_size
            k_cache[:, slot] = k[pos]
            v_cache[:, slot] = v[pos]
        keys.append(k.float())
        values.append(v.float())
    move = lambda t: t.to(device)  # noqa: E731
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return PagedCase(move(k_cache), move(v_cache), move(tables), lens, keys, values, block_size)


def dense_attention(q: Tensor, keys: Tensor, values: Tensor, q_positions: list[int], scale: float,
                    window: int = 0) -> Tensor:
    """q [n, H, D] at q_positions over keys/values [L, Hkv, D] -> [n, H, D] float64, by SDPA."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys.double().transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)  # [H, L, D]
    v = values.double().transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    key_pos = torch.arange(keys.shape[0])
    q_pos = torch.tensor(q_positions)[:, None]
    allowed = (key_pos <= q_pos) & ((key_pos > q_pos - window) if window > 0 else True)
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


def packed_queries(q_lens: list[int], heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1,
                   device: str = "cpu") -> tuple[Tensor, Tensor]:
    """(q [sum(q_lens), H, D], cu_q_lens int32 [S+1])."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q.to(device), cu.to(device)
