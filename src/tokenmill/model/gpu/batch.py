"""A step's batch as the device attention kernels (tokenmill.kernels.gpu) read it, and the attention
that runs on it: write this step's K/V into the paged cache, then attend by block tables and
sequence lengths. The layout is the CPU's (kvcache/storage.py: [Hkv, slots, D], slot = block_id *
block_size + offset), so the block manager, prefix sharing and copy-on-write are the same.

Single-token chunks (decodes) go through the split-KV decode kernel, whose rows depend neither on
each other nor on the batch, also in a step that holds prefill chunks: the scheduler puts them first
(the batch's leading `num_decodes` sequences), and the rest go through the prefill kernel, causal per
sequence. So a decoding sequence's attention is computed the same way in every step.

The metadata is built on the host (HostBatch: plain lists, tested on CPU) and moved to the device in
one copy of one packed int64 tensor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tokenmill.kernels import gpu as gpu_kernels
from tokenmill.kvcache.storage import LayerKV
from tokenmill.model.attention import ChunkSpec


@dataclass
class DeviceBatch:
    slot_mapping: torch.Tensor   # int64 [T]: each new row's cache slot; < 0 writes nothing (padding)
    block_tables: torch.Tensor   # int32 [S, W]: each sequence's blocks, padded with 0
    seq_lens: torch.Tensor       # int32 [S]: keys each sequence attends, this step's included (0: padding)
    # The first num_decodes sequences have one new row each (rows 0..num_decodes-1); the others' rows
    # follow, prefill sequence p owning rows num_decodes + cu[p] .. num_decodes + cu[p+1] - 1 (int32
    # [S - num_decodes + 1]; None when every sequence decodes).
    prefill_cu_q_lens: torch.Tensor | None
    num_decodes: int
    block_size: int

    @property
    def is_decode(self) -> bool:
        """One new row per sequence, all through the decode kernel."""
        return self.prefill_cu_q_lens is None


@dataclass
class HostBatch:
    """The same metadata as host lists, before the upload."""
    slot_mapping: list[int]
    block_tables: list[list[int]]  # padded to one width
    seq_lens: list[int]
    num_decodes: int               # leading single-token chunks
    prefill_cu_q_lens: list[int]   # the other chunks' row offsets, from 0 after the decode rows

    @property
    def is_decode(self) -> bool:
        return self.num_decodes == len(self.seq_lens)

    @classmethod
    def build(cls, chunks: Sequence[ChunkSpec], block_size: int) -> "HostBatch":
        slots: list[int] = []
        tables: list[list[int]] = []
        lens: list[int] = []
        num_decodes = 0
        while num_decodes < len(chunks) and chunks[num_decodes].num_new == 1:
            num_decodes += 1
        cu = [0]
        for i, c in enumerate(chunks):
            total = c.num_cached + c.num_new
            num_blocks = -(-total // block_size)
            if len(c.block_table) < num_blocks:
                raise ValueError(f"block table covers {len(c.block_table) * block_size} tokens, chunk needs {total}")
            table = list(c.block_table[:num_blocks])
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c.num_cached, total))
            tables.append(table)
            lens.append(total)
            if i >= num_decodes:
                cu.append(cu[-1] + c.num_new)
        width = max((len(t) for t in tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return cls(slots, padded, lens, num_decodes, cu)

    def packed(self, ids: Sequence[int], positions: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
        """One int64 host tensor holding the step's inputs and this metadata, for a single upload:
        ids, positions, slots (T each), seq_lens (S), prefill_cu_q_lens, rows (the sampled rows),
        then the block tables row by row."""
        flat = [*ids, *positions, *self.slot_mapping, *self.seq_lens, *self.prefill_cu_q_lens, *rows]
        for t in self.block_tables:
            flat.extend(t)
        return torch.tensor(flat, dtype=torch.int64)


@dataclass
class DeviceStep:
    """A step's inputs on the device: token ids, positions, the rows to take logits of, the batch."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    sample_rows: torch.Tensor
    batch: DeviceBatch


def upload(host: HostBatch, ids: Sequence[int], positions: Sequence[int], sample_rows: Sequence[int],
           block_size: int, device: torch.device) -> DeviceStep:
    """host's metadata and the step's inputs on `device`, in one host-to-device copy."""
    t, s, c, r = len(ids), len(host.seq_lens), len(host.prefill_cu_q_lens), len(sample_rows)
    flat = host.packed(ids, positions, sample_rows).to(device, non_blocking=True)
    ids_t, pos_t, slots, lens, cu, rows, tables = flat.split([t, t, t, s, c, r, flat.numel() - 3 * t - s - c - r])
    width = len(host.block_tables[0]) if host.block_tables else 0
    batch = DeviceBatch(slots, tables.view(s, width).to(torch.int32), lens.to(torch.int32),
                        None if host.is_decode else cu.to(torch.int32), host.num_decodes, block_size)
    return DeviceStep(ids_t, pos_t, rows, batch)


def write_and_attend_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, batch: DeviceBatch,
                            scale: float, window: int, softcap: float = 0.0) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D]: write this step's K/V, then attend over the paged cache.
    window > 0: a sliding-window layer (Gemma's local layers); softcap > 0: Gemma 2's capped scores.
    Returns [T, H, D]."""
    gpu_kernels.kv_write(k, v, cache.k, cache.v, batch.slot_mapping)
    return attend_device(q, cache, batch, scale, window, softcap)


def attend_device(q: torch.Tensor, cache: LayerKV, batch: DeviceBatch, scale: float, window: int,
                  softcap: float = 0.0) -> torch.Tensor:
    """write_and_attend_device's attention, for a step whose K/V are in the cache already (written
    with the rotary embedding: kernels.gpu.rope_kv_write)."""
    d, bs = batch.num_decodes, batch.block_size
    if batch.is_decode:
        return gpu_kernels.paged_decode_attention(q, cache.k, cache.v, batch.block_tables, batch.seq_lens, scale,
                                                  window, block_size=bs, softcap=softcap)
    prefill = gpu_kernels.paged_prefill_attention(q[d:], cache.k, cache.v, batch.block_tables[d:],
                                                  batch.prefill_cu_q_lens, batch.seq_lens[d:], scale, window,
                                                  block_size=bs, softcap=softcap)
    if not d:
        return prefill
    decode = gpu_kernels.paged_decode_attention(q[:d], cache.k, cache.v, batch.block_tables[:d], batch.seq_lens[:d],
                                                scale, window, block_size=bs, softcap=softcap)
    return torch.cat([decode, prefill])
