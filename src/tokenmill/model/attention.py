"""Attention over the paged KV cache, and the metadata that describes one step's batch to it.

A batch is a flat run of tokens from many sequences. Each sequence contributes a contiguous chunk of
`num_new` query tokens whose keys are its first `num_cached + num_new` positions, stored in the slots
its block table names. Chunks of one token (decodes) are attended in one batched call over a padded
gather of their slots; longer chunks (prefill) get one call each with an offset causal mask."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ChunkSpec:
    """What the batch builder says about one sequence's share of a step."""
    block_table: Sequence[int]
    num_cached: int  # tokens already in the cache before this step (the chunk's first position)
    num_new: int     # query tokens this step


@dataclass
class DecodeGroup:
    rows: torch.Tensor | slice  # rows of the flat batch holding single-token chunks
    kv_slots: torch.Tensor      # [B, L] cache slots to attend (padding points at slot 0)
    mask: torch.Tensor | None   # [B, 1, 1, L] True = attend; None when every row uses all L slots


@dataclass
class PrefillChunk:
    start: int
    end: int
    kv_slots: torch.Tensor      # [L]
    mask: torch.Tensor | None   # [q, L] offset-causal; None means plain causal (no earlier context)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]

    @classmethod
    def build(cls, chunks: Sequence[ChunkSpec], block_size: int) -> "AttentionMetadata":
        slot_mapping: list[int] = []
        decode_rows: list[int] = []
        decode_slots: list[list[int]] = []
        prefills: list[PrefillChunk] = []
        row = 0
        for c in chunks:
            table = torch.as_tensor(list(c.block_table), dtype=torch.long)
            total = c.num_cached + c.num_new
            if len(c.block_table) * block_size < total:
                raise ValueError(f"block table covers {len(c.block_table) * block_size} tokens, chunk needs {total}")
            pos = torch.arange(total)
            slots = table[pos // block_size] * block_size + pos % block_size
            slot_mapping.extend(slots[c.num_cached:].tolist())
            if c.num_new == 1:
                decode_rows.append(row)
                decode_slots.append(slots.tolist())
            else:
                mask = None
                if c.num_cached:
                    q_pos = torch.arange(c.num_cached, total).unsqueeze(1)
                    mask = pos.unsqueeze(0) <= q_pos
                prefills.append(PrefillChunk(row, row + c.num_new, slots, mask))
            row += c.num_new
        decode = None
        if decode_rows:
            lens = [len(s) for s in decode_slots]
            width = max(lens)
            kv = torch.zeros(len(decode_slots), width, dtype=torch.long)
            for i, s in enumerate(decode_slots):
                kv[i, : len(s)] = torch.as_tensor(s)
            mask = None
            if min(lens) != width:
                mask = (torch.arange(width).unsqueeze(0) < torch.as_tensor(lens).unsqueeze(1))[:, None, None, :]
            n = len(decode_rows)
            rows: torch.Tensor | slice
            rows = slice(decode_rows[0], decode_rows[0] + n) if decode_rows == list(range(decode_rows[0], decode_rows[0] + n)) \
                else torch.as_tensor(decode_rows)
            decode = DecodeGroup(rows, kv, mask)
        return cls(torch.as_tensor(slot_mapping, dtype=torch.long), decode, prefills)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float | None = None) -> torch.Tensor:
    """q: [T, H, D]; caches: [slots, Hkv, D] with this step's K/V already written. Returns [T, H, D]."""
    out = torch.empty_like(q)
    d = meta.decode
    if d is not None:
        qd = q[d.rows].unsqueeze(2)                    # [B, H, 1, D]
        kd = k_cache[d.kv_slots].transpose(1, 2)        # [B, Hkv, L, D]
        vd = v_cache[d.kv_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=scale, enable_gqa=True)
        out[d.rows] = od.squeeze(2)
    for p in meta.prefills:
        qp = q[p.start:p.end].transpose(0, 1)          # [H, q, D]
        kp = k_cache[p.kv_slots].transpose(0, 1)        # [Hkv, L, D]
        vp = v_cache[p.kv_slots].transpose(0, 1)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None,
                                            scale=scale, enable_gqa=True)
        out[p.start:p.end] = op.transpose(0, 1)
    return out
