"""The Triton paged decode attention (interpreted on CPU, compiled on CUDA) against its reference."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gpu_paged_cases import make_case
from tokenmill.kernels.gpu import force, paged_decode_attention, paged_decode_attention_reference

SCALE = 0.25


def _run(device, q, case, window, parts):
    with force("triton"):
        return paged_decode_attention(q.to(device), case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                      SCALE, window, parts, block_size=case.block_size).cpu()


def _reference(q, case, window):
    return paged_decode_attention_reference(q, case.k_cache.cpu(), case.v_cache.cpu(), case.block_tables.cpu(),
                                            case.seq_lens.cpu(), SCALE, window, block_size=case.block_size)


@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(4, 2, 24, 0), (4, 1, 16, 6), (4, 1, 16, 40)])
def test_float32_matches_the_reference(device, heads, kv_heads, head_dim, window):
    """Two parts, each over several 32-key tiles (100 keys: tiles 0-3), a window whose first tile is
    partly before it (100 - 40 = key 60, in tile 1) or that sits in the last two tiles (6), a part
    with no tile (13 keys), GQA, D not a power of two, a padding row, shared and out-of-order
    blocks in a strided cache."""
    case = make_case([100, 0, 13], kv_heads, head_dim, 4, torch.float32, device=device, shared_blocks=2, strided=True)
    q = torch.randn(3, heads, head_dim, generator=torch.Generator().manual_seed(7))
    out = _run(device, q, case, window, 2)
    assert out.dtype == torch.float32
    assert torch.equal(out[1], torch.zeros(heads, head_dim))  # padding: zeros, no NaN
    torch.testing.assert_close(out, _reference(q, case, window), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [0, 6])
def test_soft_capped_scores_match_the_reference(device, window):
    """Gemma 2's cap, small enough to change every score (q scaled up so that scores pass it)."""
    case = make_case([100, 13], 1, 16, 4, torch.float32, device=device, shared_blocks=2)
    q = torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(9)) * 4
    with force("triton"):
        out = paged_decode_attention(q.to(device), case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                     SCALE, window, 2, block_size=case.block_size, softcap=0.7).cpu()
    want = paged_decode_attention_reference(q, case.k_cache.cpu(), case.v_cache.cpu(), case.block_tables.cpu(),
                                            case.seq_lens.cpu(), SCALE, window, block_size=case.block_size,
                                            softcap=0.7)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert (want - _reference(q, case, window)).abs().max() > 1e-2  # the cap is felt


def test_bfloat16_matches_the_reference(device):
    case = make_case([40, 9], 2, 32, 16, torch.bfloat16, device=device)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(8)).bfloat16()
    out = _run(device, q, case, 0, 1)  # one part: both tiles of the 40 keys in one program
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q, case, 0).float(), atol=2e-2, rtol=2e-2)


def test_a_rows_output_does_not_depend_on_the_batch(device):
    """Row 1 alone, with a table just wide enough for it, and in a batch of three whose table is
    wider and whose rows are longer and shorter."""
    case = make_case([150, 70, 7], 2, 16, 4, torch.bfloat16, device=device)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(9)).bfloat16()
    batch = _run(device, q, case, 0, 2)
    alone = replace(case, block_tables=case.block_tables[1:2, :18], seq_lens=case.seq_lens[1:2])
    single = _run(device, q[1:2], alone, 0, 2)
    assert torch.equal(single[0], batch[1])


def test_any_number_of_parts_attends_the_same_keys(device):
    """parts only spreads the tiles over programs: 1, 2 and 8 parts (more parts than tiles) agree
    with the reference, a long row (5 tiles) and a short one alike."""
    case = make_case([150, 33], 1, 16, 16, torch.float32, device=device)
    q = torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(10))
    want = _reference(q, case, 0)
    for parts in (1, 2, 8):
        torch.testing.assert_close(_run(device, q, case, 0, parts), want, atol=2e-5, rtol=2e-5)


def test_parts_must_be_a_power_of_two(device):
    case = make_case([5], 1, 16, 4, torch.float32, device=device)
    with pytest.raises(ValueError, match="power of two"):
        _run(device, torch.randn(1, 1, 16), case, 0, 3)
