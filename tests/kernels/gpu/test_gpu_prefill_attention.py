"""The Triton paged prefill attention (interpreted on CPU, compiled on CUDA) against its reference."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gpu_paged_cases import make_case, packed_queries
from tokenmill.kernels.gpu import dispatch, paged_prefill_attention_reference

SCALE = 0.25


def _run(device, q, cu, case, window, block_m=16, block_n=16):
    """The kernel with 16-row tiles, so that short sequences still cross tile edges."""
    with dispatch.force("triton"):
        launch = dispatch.kernel_module("prefill_attention").paged_prefill_attention_triton
        return launch(q.to(device), case.k_cache, case.v_cache, case.block_tables, cu.to(device), case.seq_lens,
                      SCALE, window, block_size=case.block_size, block_m=block_m, block_n=block_n).cpu()


def _reference(q, cu, case, window):
    return paged_prefill_attention_reference(q, case.k_cache.cpu(), case.v_cache.cpu(), case.block_tables.cpu(), cu,
                                             case.seq_lens.cpu(), SCALE, window, block_size=case.block_size)


@pytest.mark.parametrize("kv_heads,window", [(2, 0), (1, 5)])
def test_float32_with_a_cached_prefix_matches_the_reference(device, kv_heads, window):
    """Sequences: 6 cached + 18 new rows (two tiles), a fresh 5-row prompt, one with no new rows;
    shared and out-of-order blocks in a strided cache."""
    lens, q_lens = [24, 5, 9], [18, 5, 0]
    case = make_case(lens, kv_heads, 24, 4, torch.float32, device=device, shared_blocks=1, strided=True)
    q, cu = packed_queries(q_lens, 4, 24, torch.float32)
    out = _run(device, q, cu, case, window)
    torch.testing.assert_close(out, _reference(q, cu, case, window), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [0, 5])
def test_soft_capped_scores_match_the_reference(device, window):
    lens, q_lens = [24, 5], [18, 5]
    case = make_case(lens, 1, 16, 4, torch.float32, device=device, shared_blocks=1)
    q, cu = packed_queries(q_lens, 2, 16, torch.float32)
    q = q * 4
    with dispatch.force("triton"):
        launch = dispatch.kernel_module("prefill_attention").paged_prefill_attention_triton
        out = launch(q.to(device), case.k_cache, case.v_cache, case.block_tables, cu.to(device), case.seq_lens,
                     SCALE, window, block_size=case.block_size, block_m=16, block_n=16, softcap=0.7).cpu()
    want = paged_prefill_attention_reference(q, case.k_cache.cpu(), case.v_cache.cpu(), case.block_tables.cpu(), cu,
                                             case.seq_lens.cpu(), SCALE, window, block_size=case.block_size,
                                             softcap=0.7)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert (want - _reference(q, cu, case, window)).abs().max() > 1e-2  # the cap is felt


def test_bfloat16_matches_the_reference(device):
    lens, q_lens = [37, 20], [21, 20]
    case = make_case(lens, 2, 32, 16, torch.bfloat16, device=device)
    q, cu = packed_queries(q_lens, 4, 32, torch.bfloat16)
    out = _run(device, q, cu, case, 0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q, cu, case, 0).float(), atol=2e-2, rtol=2e-2)


def test_a_sequences_rows_do_not_depend_on_the_others(device):
    lens, q_lens = [11, 26], [3, 19]
    case = make_case(lens, 2, 16, 4, torch.bfloat16, device=device)
    q, cu = packed_queries(q_lens, 4, 16, torch.bfloat16)
    batch = _run(device, q, cu, case, 7)
    alone = replace(case, block_tables=case.block_tables[1:], seq_lens=case.seq_lens[1:])
    single = _run(device, q[3:], torch.tensor([0, 19], dtype=torch.int32), alone, 7)
    assert torch.equal(single, batch[3:])
