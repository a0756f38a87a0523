"""The device-independent half of CUDA-graph decoding: which captured batch size (bucket) a decode
step runs in, and the static input buffers every graph reads, filled for a step with its rows and
padded to the bucket.

A graph replays fixed addresses and shapes, so every bucket's graph reads the first `bucket` rows of
the same buffers: token ids, positions, slot mapping, block tables (full context width) and
sequence lengths. Padding rows write nothing (slot -1) and attend nothing (sequence length 0), so a
step of 5 sequences in the bucket of 8 computes exactly what 5 would, in the 5 rows read back.

Buckets: 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, up to the largest batch (`parallel`),
which is always a bucket itself (as vLLM and SGLang grade theirs)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch

from tokenmill.model.gpu.batch import DeviceBatch


def decode_buckets(max_batch: int) -> list[int]:
    """The batch sizes to capture, ascending, the last one max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    grid = [1, 2, 4, 8, *range(16, 65, 8)]
    while grid[-1] < max_batch:
        grid.append(grid[-1] + 16)
    return [b for b in grid if b < max_batch] + [max_batch]


@dataclass
class DecodeRows:
    """One decode step's rows as the host knows them (one new token per sequence)."""
    input_ids: Sequence[int]
    positions: Sequence[int]
    slot_mapping: Sequence[int]
    block_tables: Sequence[Sequence[int]]  # each sequence's blocks covering its seq_len (any longer is ignored)
    seq_lens: Sequence[int]


class DecodeBuffers:
    """Static inputs of the decode graphs on `device`, with a host staging buffer (pinned on CUDA, so
    the copy runs asynchronously) that a step fills before one copy. Everything is int32 in one
    buffer (ids, positions and slot mapping [3, max_batch], sequence lengths [max_batch], block tables
    [max_batch, max_blocks]), so a step's inputs go up in a single copy of its used prefix."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: torch.device | str):
        self.device = torch.device(device)
        self.buckets = decode_buckets(max_batch)
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.block_size = block_size
        pin = self.device.type == "cuda"
        size = 4 * max_batch + max_batch * max_blocks
        self._host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self._dev = torch.zeros(size, dtype=torch.int32, device=self.device)
        self.tokens = self._dev[:3 * max_batch].view(3, max_batch)
        self.tokens[2].fill_(-1)
        self.seq_lens = self._dev[3 * max_batch:4 * max_batch]
        self.block_tables = self._dev[4 * max_batch:].view(max_batch, max_blocks)
        # The last step's copy out of the staging buffer, which the next fill must not overwrite early.
        self._copied = torch.cuda.Event() if pin else None
        # The block tables the staging buffer holds: (the list object filled from, its bucket, each
        # table's length). Decode steps in a row fill from the same list every step.
        self._staged: tuple[object, int, list[int]] | None = None
        self._rows = 0  # the rows of the last fill()

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tokens[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.tokens[1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.tokens[2]

    def bucket_for(self, num_rows: int) -> int | None:
        """The smallest bucket holding num_rows rows; None when none does."""
        i = bisect.bisect_left(self.buckets, num_rows)
        return self.buckets[i] if num_rows >= 1 and i < len(self.buckets) else None

    def accepts(self, num_rows: int, num_blocks: int) -> bool:
        """Whether a step of num_rows sequences, the longest using num_blocks blocks, fits."""
        return self.bucket_for(num_rows) is not None and num_blocks <= self.max_blocks

    def fill(self, rows: DecodeRows, steps_ahead: int = 0) -> int:
        """Write a step's rows into the buffers, pad them to their bucket, and return the bucket.
        steps_ahead: how many times advance() will move these rows on (each table must hold them)."""
        n = len(rows.input_ids)
        self._rows = 0  # until this fill has succeeded
        bucket = self.bucket_for(n)
        if bucket is None:
            raise ValueError(f"{n} rows fit no bucket (largest {self.buckets[-1]})")
        if self._copied is not None:
            self._copied.synchronize()
        mb, width = self.max_batch, self.max_blocks
        host = self._host.numpy()
        tokens = host[:3 * mb].reshape(3, mb)
        lens = host[3 * mb:4 * mb]
        tables = host[4 * mb:].reshape(mb, width)
        tokens[:, :bucket] = 0
        tokens[2, :bucket] = -1  # padding rows write nothing
        tokens[0, :n] = rows.input_ids
        tokens[1, :n] = rows.positions
        tokens[2, :n] = rows.slot_mapping
        lens[:bucket] = 0        # ... and attend nothing
        lens[:n] = rows.seq_lens
        staged = self._staged
        if staged is None or staged[0] is not rows.block_tables or staged[1] != bucket:
            # Each table whole (its blocks past seq_len are never read): a run of decode steps keeps
            # the same tables while its rows grow into their reserved blocks, and writes them once.
            tables[:bucket] = 0
            for i, table in enumerate(rows.block_tables):
                tables[i, :min(len(table), width)] = table[:width]
            staged = self._staged = (rows.block_tables, bucket, [len(t) for t in rows.block_tables])
        for i, (length, seq_len) in enumerate(zip(staged[2], rows.seq_lens)):
            seq_len += steps_ahead
            used = -(-seq_len // self.block_size)
            if used > width or length < used:
                self._staged = None
                raise ValueError(f"row {i}: {seq_len} keys need {used} blocks; the table has {length}, "
                                 f"the buffers {width}")
        used = 4 * mb + bucket * width  # every input of the bucket's graph, in one copy
        self._dev[:used].copy_(self._host[:used], non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
        self._rows = n
        return bucket

    def advance(self) -> int:
        """The next decode step of the rows fill() wrote: every row one position further, in the
        same blocks (fill's steps_ahead checked that they hold it). Done on the device, in place, so a
        run of decode steps uploads its inputs once: the host neither rebuilds the rows nor waits for
        a copy. The input ids are the caller's (the tokens just sampled there). Returns the bucket."""
        n = self._rows
        if n == 0:
            raise ValueError("advance() needs a fill() first")
        positions, lens = self.positions[:n], self.seq_lens[:n]
        positions += 1
        lens += 1
        bs = self.block_size
        blocks = self.block_tables[:n].gather(1, (positions // bs).long().unsqueeze(1)).squeeze(1)
        slots = self.slot_mapping[:n]
        torch.mul(blocks, bs, out=slots)
        slots += positions % bs
        return self.bucket_for(n)

    def batch(self, bucket: int) -> DeviceBatch:
        """The first `bucket` rows of the buffers as a decode batch (views: a graph captured on it reads
        whatever the buffers hold when it replays)."""
        return DeviceBatch(self.slot_mapping[:bucket], self.block_tables[:bucket], self.seq_lens[:bucket], None,
                           bucket, self.block_size)
