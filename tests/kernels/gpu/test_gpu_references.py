"""The PyTorch references of tokenmill.kernels.gpu (the kernels' oracle) against attention computed
independently from the sequences' dense K/V, against the CPU path's own reference, and the ops'
dispatch and input checks. No triton needed."""
from __future__ import annotations

import pytest
import torch

from gpu_paged_cases import JUNK_BLOCK, dense_attention, make_case, packed_queries
from tokenmill.kernels.attention import paged_attention_reference as cpu_paged_attention_reference
from tokenmill.kernels.gpu import (apply_token_bitmask, apply_token_bitmask_reference, force, kv_write,
                                   kv_write_reference, paged_decode_attention, paged_decode_attention_reference,
                                   paged_prefill_attention, paged_prefill_attention_reference, use_triton)

SCALE = 0.3


@pytest.mark.parametrize("heads,kv_heads,window,strided", [(4, 2, 0, False), (4, 1, 5, True), (2, 2, 3, False)])
def test_decode_reference_matches_dense_attention(heads, kv_heads, window, strided):
    lens = [11, 0, 17]  # a padding row in the middle
    case = make_case(lens, kv_heads, 16, 4, torch.float32, shared_blocks=2, strided=strided)
    q = torch.randn(3, heads, 16, generator=torch.Generator().manual_seed(3))
    out = paged_decode_attention_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, SCALE,
                                           window, block_size=4)
    assert out.dtype == q.dtype and not out.isnan().any()
    assert torch.equal(out[1], torch.zeros(heads, 16))
    for b in (0, 2):
        want = dense_attention(q[b:b + 1], case.keys[b], case.values[b], [lens[b] - 1], SCALE, window)[0]
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,strided", [(0, False), (4, True)])
def test_prefill_reference_matches_dense_attention(window, strided):
    lens, q_lens = [12, 3, 9], [7, 3, 0]  # a cached prefix of 5, a fresh prompt, a sequence with no new rows
    case = make_case(lens, 2, 16, 4, torch.float32, shared_blocks=1, strided=strided)
    q, cu = packed_queries(q_lens, 4, 16, torch.float32)
    out = paged_prefill_attention_reference(q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens,
                                            SCALE, window, block_size=4)
    for s, (n, q_len) in enumerate(zip(lens, q_lens)):
        if q_len == 0:
            continue
        rows = slice(int(cu[s]), int(cu[s + 1]))
        want = dense_attention(q[rows], case.keys[s], case.values[s], list(range(n - q_len, n)), SCALE, window)
        torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=1e-5)


def test_references_agree_with_the_cpu_paths_reference():
    """One meaning of positions, windows and GQA on both devices."""
    lens, q_lens = [10, 6], [4, 6]
    case = make_case(lens, 2, 16, 4, torch.float32)
    q, cu = packed_queries(q_lens, 4, 16, torch.float32)
    starts = torch.tensor([n - ql for n, ql in zip(lens, q_lens)], dtype=torch.int32)
    empty = torch.empty(0)
    tables = case.block_tables.clamp(max=case.k_cache.shape[1] // 4 - 1)  # the CPU reference wants in-range ids
    for window in (0, 3):
        cpu = cpu_paged_attention_reference(q, case.k_cache, case.v_cache, empty, empty, cu, starts, tables, 4,
                                            SCALE, window)
        gpu = paged_prefill_attention_reference(q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens,
                                                SCALE, window, block_size=4)
        torch.testing.assert_close(gpu, cpu, atol=1e-6, rtol=1e-6)


def test_decode_reference_is_prefills_last_row():
    lens = [9, 14]
    case = make_case(lens, 2, 16, 4, torch.float32)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(5))
    decode = paged_decode_attention_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, SCALE, 6,
                                              block_size=4)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    prefill = paged_prefill_attention_reference(q, case.k_cache, case.v_cache, case.block_tables, cu, case.seq_lens,
                                                SCALE, 6, block_size=4)
    torch.testing.assert_close(decode, prefill, atol=0, rtol=0)


def test_kv_write_reference_scatters_rows_and_skips_padding():
    cache_k = torch.zeros(8, 2, 16).transpose(0, 1)  # [Hkv=2, slots=8, D], strided
    cache_v = torch.zeros(2, 8, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    kv_write_reference(k, v, cache_k, cache_v, torch.tensor([5, -1, 2]))
    assert torch.equal(cache_k[:, 5], k[0]) and torch.equal(cache_v[:, 2], v[2])
    written = torch.zeros(8, dtype=torch.bool)
    written[[2, 5]] = True
    assert not cache_k[:, ~written].any() and not cache_v[:, ~written].any()


def test_bitmask_reference_reads_little_endian_bits():
    vocab = 70  # three words, the last partly used
    allowed = torch.rand(3, vocab, generator=torch.Generator().manual_seed(0)) < 0.5
    allowed[1] = True
    words = torch.zeros(3, 3, dtype=torch.int64)
    for b, t in allowed.nonzero().tolist():
        words[b, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    logits = torch.randn(3, vocab)
    masked = logits.clone()
    apply_token_bitmask_reference(masked, bitmask)
    assert torch.equal(masked, torch.where(allowed, logits, float("-inf")))
    narrow = logits.clone()
    apply_token_bitmask_reference(narrow, bitmask[:, :2])  # tokens past the mask's words: not allowed
    assert narrow[:, 64:].isneginf().all()


def test_ops_take_the_reference_on_cpu_tensors():
    case = make_case([5], 1, 16, 4, torch.float32)
    q = torch.randn(1, 2, 16)
    assert not use_triton(q)
    out = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, SCALE, block_size=4)
    want = paged_decode_attention_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, SCALE,
                                            block_size=4)
    assert torch.equal(out, want)
    with force("reference"):
        assert not use_triton(q)
    with pytest.raises(ValueError):
        with force("fast"):
            pass


def test_ops_reject_bad_inputs_with_clear_errors():
    case = make_case([5], 2, 16, 4, torch.float32)
    k_cache, v_cache, tables, lens = case.k_cache, case.v_cache, case.block_tables, case.seq_lens
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(torch.randn(1, 3, 16), k_cache, v_cache, tables, lens, SCALE, block_size=4)
    with pytest.raises(ValueError, match="q must be"):
        paged_decode_attention(torch.randn(1, 4, 8), k_cache, v_cache, tables, lens, SCALE, block_size=4)
    with pytest.raises(TypeError, match="block_tables"):
        paged_decode_attention(torch.randn(1, 4, 16), k_cache, v_cache, tables.float(), lens, SCALE, block_size=4)
    with pytest.raises(TypeError, match="caches"):
        paged_decode_attention(torch.randn(1, 4, 16), k_cache, v_cache.half(), tables, lens, SCALE, block_size=4)
    with pytest.raises(ValueError, match="cu_q_lens"):
        paged_prefill_attention(torch.randn(2, 4, 16), k_cache, v_cache, tables, torch.tensor([0], dtype=torch.int32),
                                lens, SCALE, block_size=4)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_write(torch.randn(2, 2, 16), torch.randn(2, 2, 16), k_cache, v_cache, torch.tensor([1]))
    with pytest.raises(ValueError, match="unit stride"):
        kv_write(torch.randn(2, 16, 2).transpose(1, 2), torch.randn(2, 2, 16), k_cache, v_cache, torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="bitmask"):
        apply_token_bitmask(torch.randn(2, 40), torch.zeros(2, 2, dtype=torch.int64))
    assert JUNK_BLOCK > k_cache.shape[1]  # the fixtures' junk table entries really are out of range
