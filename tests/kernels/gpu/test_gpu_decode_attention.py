"""The Triton paged decode attention (interpreted on CPU, compiled on CUDA) against its reference."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gpu_paged_cases import make_case
from tokenmill.kernels.gpu import force, paged_decode_attention, paged_decode_attention_reference

SCALE = 0.25


def _run(device, q, case, window, split_size):
    with force("triton"):
        return paged_decode_attention(q.to(device), case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                      SCALE, window, split_size, block_size=case.block_size).cpu()


def _reference(q, case, window):
    return paged_decode_attention_reference(q, case.k_cache.cpu(), case.v_cache.cpu(), case.block_tables.cpu(),
                                            case.seq_lens.cpu(), SCALE, window, block_size=case.block_size)


@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(4, 2, 24, 0), (4, 1, 16, 6)])
def test_float32_matches_the_reference(device, heads, kv_heads, head_dim, window):
    """Several splits per row (split_size 8), GQA, D not a power of two, a padding row, shared and
    out-of-order blocks in a strided cache."""
    case = make_case([19, 0, 13], kv_heads, head_dim, 4, torch.float32, device=device, shared_blocks=2, strided=True)
    q = torch.randn(3, heads, head_dim, generator=torch.Generator().manual_seed(7))
    out = _run(device, q, case, window, 8)
    assert out.dtype == torch.float32
    assert torch.equal(out[1], torch.zeros(heads, head_dim))  # padding: zeros, no NaN
    torch.testing.assert_close(out, _reference(q, case, window), atol=2e-5, rtol=2e-5)


def test_bfloat16_matches_the_reference(device):
    case = make_case([40, 9], 2, 32, 16, torch.bfloat16, device=device)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(8)).bfloat16()
    out = _run(device, q, case, 0, 16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q, case, 0).float(), atol=2e-2, rtol=2e-2)


def test_a_rows_output_does_not_depend_on_the_batch(device):
    """Row 1 alone, with a table just wide enough for it (3 splits in the grid), and in a batch of
    three whose table is wider (5 splits in the grid)."""
    case = make_case([30, 21, 7], 2, 16, 4, torch.bfloat16, device=device)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(9)).bfloat16()
    batch = _run(device, q, case, 0, 8)
    alone = replace(case, block_tables=case.block_tables[1:2, :6], seq_lens=case.seq_lens[1:2])
    single = _run(device, q[1:2], alone, 0, 8)
    assert torch.equal(single[0], batch[1])
