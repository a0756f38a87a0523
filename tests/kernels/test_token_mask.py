"""Grammar token masks on logits rows (kernels.token_mask) on every variant this CPU runs, against the
PyTorch reference: bitwise, since both only write -inf or leave a logit as it is. Awkward shapes: a
vocabulary that is not a multiple of 32, logits rows wider than the mask (padding ids: never
allowed), a subset of rows in any order, and words that are all set, all clear or mixed."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.token_mask import apply_token_bitmask, apply_token_bitmask_reference

VARIANTS = [*native.runnable_variants(), "torch"]


def random_bits(rows: int, words: int, gen: torch.Generator) -> torch.Tensor:
    bits = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    kinds = torch.randint(0, 3, (rows, words), generator=gen)
    bits[kinds == 0] = 0          # nothing allowed in these 32 ids: the common case under a grammar
    bits[kinds == 1] = -1         # everything allowed
    return bits


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("vocab,mask_vocab,rows", [(49152, 49152, [0, 1, 2]), (1000, 997, [3, 0]),
                                                    (70, 33, [1]), (262144, 262144, [0]), (64, 64, [])])
def test_matches_reference(variant, vocab, mask_vocab, rows):
    gen = torch.Generator().manual_seed(vocab + len(rows))
    logits = torch.randn(4, vocab, generator=gen)
    bits = random_bits(len(rows), (mask_vocab + 31) // 32, gen)
    expected = logits.clone()
    apply_token_bitmask_reference(expected, rows, bits)
    with native.use_variant(variant):
        apply_token_bitmask(logits, rows, bits)
    assert torch.equal(logits, expected)
    for j, r in enumerate(rows):  # the reference itself: allowed ids keep their logit, others are -inf
        allowed = [t for t in range(min(vocab, bits.shape[1] * 32)) if (int(bits[j, t // 32]) >> (t % 32)) & 1]
        assert torch.isfinite(logits[r, allowed]).all()
        assert int(torch.isfinite(logits[r]).sum()) == len(allowed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_outside_the_logits_are_refused(variant):
    logits = torch.zeros(2, 64)
    with native.use_variant(variant), pytest.raises(IndexError):
        apply_token_bitmask(logits, [2], torch.zeros(1, 2, dtype=torch.int32))
