"""The device-independent half of CUDA-graph decoding (model/gpu/buckets.py) and of the device
batch (model/gpu/batch.py), on CPU tensors."""
from __future__ import annotations

import pytest
import torch

from tokenmill.model import AttentionMetadata, ChunkSpec
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model.gpu.batch import HostBatch, upload, write_and_attend_device
from tokenmill.model.gpu.buckets import DecodeBuffers, DecodeRows, decode_buckets
from tokenmill.model.paged_batch import PagedBatch


def test_buckets_are_powers_of_two_to_8_then_steps_of_8_and_16():
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert decode_buckets(256)[-4:] == [208, 224, 240, 256]
    with pytest.raises(ValueError):
        decode_buckets(0)


def rows_of(specs: list[ChunkSpec], block_size: int, ids: list[int]) -> DecodeRows:
    positions = [s.num_cached for s in specs]
    slots = [s.block_table[p // block_size] * block_size + p % block_size for s, p in zip(specs, positions)]
    return DecodeRows(ids, positions, slots, [s.block_table for s in specs], [p + 1 for p in positions])


def test_bucket_choice():
    b = DecodeBuffers(20, 8, 4, "cpu")
    assert b.buckets == [1, 2, 4, 8, 16, 20]
    assert [b.bucket_for(n) for n in (1, 2, 3, 5, 9, 16, 17, 20)] == [1, 2, 4, 8, 16, 16, 20, 20]
    assert b.bucket_for(21) is None and b.bucket_for(0) is None
    assert b.accepts(20, 8) and not b.accepts(21, 1) and not b.accepts(3, 9)


def test_fill_pads_to_the_bucket_with_rows_that_write_and_attend_nothing():
    b = DecodeBuffers(16, 6, 4, "cpu")
    specs = [ChunkSpec([7, 3, 9], 9, 1), ChunkSpec([2], 0, 1), ChunkSpec([5, 1, 4, 8, 0, 6], 21, 1)]
    bucket = b.fill(rows_of(specs, 4, [11, 12, 13]))
    assert bucket == 4
    assert b.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert b.positions[:4].tolist() == [9, 0, 21, 0]
    assert b.slot_mapping[:4].tolist() == [9 * 4 + 1, 2 * 4, 6 * 4 + 1, -1]
    assert b.seq_lens[:4].tolist() == [10, 1, 22, 0]
    # Each row holds its table (blocks past its keys are never read), zeros after; the width is the
    # buffers' (full context).
    assert b.block_tables[:4].tolist() == [[7, 3, 9, 0, 0, 0], [2, 0, 0, 0, 0, 0], [5, 1, 4, 8, 0, 6],
                                          [0, 0, 0, 0, 0, 0]]
    meta = b.batch(bucket)
    assert meta.is_decode and meta.block_size == 4
    assert meta.slot_mapping.data_ptr() == b.slot_mapping.data_ptr()  # views: what a graph reads
    assert meta.block_tables.shape == (4, 6) and meta.seq_lens.shape == (4,)


def test_buffers_are_reused_and_a_smaller_step_leaves_nothing_of_a_larger_one():
    b = DecodeBuffers(8, 4, 2, "cpu")
    big = [ChunkSpec([3, 2, 1, 0], 6, 1) for _ in range(7)]
    assert b.fill(rows_of(big, 2, list(range(7)))) == 8
    ptrs = (b.input_ids.data_ptr(), b.block_tables.data_ptr(), b.seq_lens.data_ptr())
    small = [ChunkSpec([1], 0, 1)]
    assert b.fill(rows_of(small, 2, [42])) == 1
    assert (b.input_ids.data_ptr(), b.block_tables.data_ptr(), b.seq_lens.data_ptr()) == ptrs
    assert b.block_tables[0].tolist() == [1, 0, 0, 0]
    # A step of 3 rows reuses the bucket of 4: its padding row is clean, not the old seventh row's.
    b.fill(rows_of([ChunkSpec([0, 1], 2, 1)] * 3, 2, [1, 2, 3]))
    assert b.seq_lens[:4].tolist() == [3, 3, 3, 0] and b.slot_mapping[3] == -1
    assert b.block_tables[3].tolist() == [0, 0, 0, 0]


def test_a_run_of_steps_stages_its_tables_once():
    """Decode steps in a row fill from the same list of tables while their rows grow into the blocks
    reserved for the run: written whole at the first step, so a later step's new block is there."""
    b = DecodeBuffers(4, 4, 2, "cpu")
    tables = [[3, 1, 7], [2]]
    b.fill(DecodeRows([1, 2], [2, 0], [1 * 2 + 0, 2 * 2 + 0], tables, [3, 1]))
    assert b.block_tables[:2].tolist() == [[3, 1, 7, 0], [2, 0, 0, 0]]
    b.fill(DecodeRows([5, 6], [4, 1], [7 * 2 + 0, 2 * 2 + 1], tables, [5, 2]))  # row 0 now in block 7
    assert b.block_tables[:2].tolist() == [[3, 1, 7, 0], [2, 0, 0, 0]] and b.seq_lens[:2].tolist() == [5, 2]
    with pytest.raises(ValueError, match="need 2 blocks"):  # still checked against each table's length
        b.fill(DecodeRows([5, 6], [4, 2], [7 * 2, 2 * 2], tables, [5, 3]))
    b.fill(DecodeRows([9], [0], [4 * 2], [[4]], [1]))  # another list: staged again
    assert b.block_tables[0].tolist() == [4, 0, 0, 0]


def test_fill_refuses_what_does_not_fit():
    b = DecodeBuffers(4, 2, 4, "cpu")
    with pytest.raises(ValueError, match="fit no bucket"):
        b.fill(rows_of([ChunkSpec([0], 0, 1)] * 5, 4, [1] * 5))
    with pytest.raises(ValueError, match="need 3 blocks"):
        b.fill(rows_of([ChunkSpec([0, 1, 2], 8, 1)], 4, [1]))


def test_host_batch_slots_match_the_cpu_metadata():
    specs = [ChunkSpec([4, 0, 2], 5, 6), ChunkSpec([1, 3], 2, 1), ChunkSpec([5, 6], 0, 7)]
    host = HostBatch.build(specs, 4)
    assert host.slot_mapping == AttentionMetadata.build(specs, 4).slot_mapping.tolist()
    assert host.slot_mapping == PagedBatch.build(specs, 4).slot_mapping.tolist()
    assert host.block_tables == [[4, 0, 2], [1, 0, 0], [5, 6, 0]]
    assert host.seq_lens == [11, 3, 7] and host.prefill_cu_q_lens == [0, 6, 7, 14]
    assert host.num_decodes == 0 and not host.is_decode  # a decode after a prefill chunk is a prefill row
    decodes = HostBatch.build([ChunkSpec([1], 3, 1), ChunkSpec([2, 3], 4, 1)], 4)
    assert decodes.is_decode and decodes.num_decodes == 2
    mixed = HostBatch.build([ChunkSpec([1], 3, 1), ChunkSpec([2, 3], 4, 1), ChunkSpec([5, 6], 0, 5),
                             ChunkSpec([7], 1, 2)], 4)
    assert mixed.num_decodes == 2 and mixed.prefill_cu_q_lens == [0, 5, 7] and not mixed.is_decode
    with pytest.raises(ValueError, match="block table covers"):
        HostBatch.build([ChunkSpec([1], 3, 2)], 4)


def test_upload_unpacks_one_copy_into_the_step():
    specs = [ChunkSpec([1, 3], 2, 1), ChunkSpec([4, 0, 2], 5, 6)]
    host = HostBatch.build(specs, 4)
    ids = list(range(100, 107))
    positions = [2, 5, 6, 7, 8, 9, 10]
    step = upload(host, ids, positions, [0, 6], 4, torch.device("cpu"))
    assert step.input_ids.tolist() == ids and step.positions.tolist() == positions
    assert step.sample_rows.tolist() == [0, 6]
    meta = step.batch
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == host.slot_mapping
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.tolist() == host.block_tables
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == [3, 11]
    assert meta.num_decodes == 1 and meta.prefill_cu_q_lens.tolist() == [0, 6] and not meta.is_decode
    decode = upload(HostBatch.build([ChunkSpec([3], 1, 1)], 4), [9], [1], [], 4, torch.device("cpu"))
    assert decode.batch.is_decode and decode.batch.prefill_cu_q_lens is None and decode.sample_rows.numel() == 0


def test_a_decode_row_attends_the_same_way_in_a_mixed_step():
    """The decode rows of a step with prefill chunks go through the decode kernel (its reference on
    CPU tensors), as they would alone: bitwise the same output."""
    torch.manual_seed(0)
    kv = KVStorage(1, 8, 4, 2, 16, torch.float32)
    kv.k[0].normal_()
    kv.v[0].normal_()
    cache = kv.layer(0)
    decode_spec, prefill_spec = ChunkSpec([5, 2, 7], 9, 1), ChunkSpec([1, 0], 3, 4)
    q = torch.randn(5, 4, 16)
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)

    def attend(specs, rows):
        host = HostBatch.build(specs, 4)
        n = sum(s.num_new for s in specs)
        step = upload(host, [0] * n, [0] * n, [], 4, torch.device("cpu"))
        return write_and_attend_device(q[rows], k[rows], v[rows], cache, step.batch, 0.25, 0)

    mixed = attend([decode_spec, prefill_spec], slice(0, 5))
    alone = attend([decode_spec], slice(0, 1))
    assert torch.equal(mixed[:1], alone)
    assert torch.equal(mixed[1:], attend([prefill_spec], slice(1, 5)))


def test_advance_moves_every_row_one_position_on_as_a_fill_of_the_next_step_would():
    """Decode steps in a row after the first: positions, lengths and slots moved on in the buffers
    themselves, across block boundaries, the padding rows untouched."""
    tables = [[3, 1, 7], [2, 5], [6]]
    starts = [3, 1, 0]  # row 0 crosses into block 7 at position 4, row 1 into block 5 at position 2
    moved = DecodeBuffers(4, 4, 2, "cpu")
    bucket = moved.fill(rows_of([ChunkSpec(t, p, 1) for t, p in zip(tables, starts)], 2, [1, 2, 3]), steps_ahead=1)
    assert bucket == 4
    assert moved.advance() == 4
    fresh = DecodeBuffers(4, 4, 2, "cpu")
    fresh.fill(rows_of([ChunkSpec(t, p + 1, 1) for t, p in zip(tables, starts)], 2, [1, 2, 3]))
    assert moved.positions.tolist() == fresh.positions.tolist() == [4, 2, 1, 0]
    assert moved.seq_lens.tolist() == fresh.seq_lens.tolist() == [5, 3, 2, 0]
    assert moved.slot_mapping.tolist() == fresh.slot_mapping.tolist() == [14, 10, 13, -1]
    assert moved.block_tables.tolist() == fresh.block_tables.tolist()


def test_advance_needs_a_fill_and_a_run_must_fit_its_tables():
    b = DecodeBuffers(4, 4, 2, "cpu")
    with pytest.raises(ValueError, match="fill"):
        b.advance()
    # Position 3 fits the table's two blocks; two steps ahead (position 5) would need a third.
    with pytest.raises(ValueError, match="need 3 blocks"):
        b.fill(rows_of([ChunkSpec([0, 1], 3, 1)], 2, [1]), steps_ahead=2)
    with pytest.raises(ValueError, match="fill"):  # a fill that failed leaves nothing to advance
        b.advance()
