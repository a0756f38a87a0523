"""The Triton token bitmask (interpreted on CPU, compiled on CUDA) against its reference."""
from __future__ import annotations

import torch

from tokenmill.kernels.gpu import apply_token_bitmask, apply_token_bitmask_reference, force


def test_matches_the_reference(device):
    vocab = 1100  # two programs' worth of tokens, the last word partly used
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, -(-vocab // 32)), generator=gen, dtype=torch.int32)
    bitmask[1] = -1  # everything allowed
    bitmask[2, :5] = 0  # the first 160 tokens forbidden
    logits = torch.randn(3, vocab, generator=gen)
    want = logits.clone()
    apply_token_bitmask_reference(want, bitmask)
    got = logits.to(device)
    with force("triton"):
        apply_token_bitmask(got, bitmask.to(device))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got.cpu()[1], logits[1]) and got.cpu()[2, :160].isneginf().all()


def test_tokens_past_the_masks_words_are_forbidden(device):
    logits = torch.randn(2, 100)
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)  # covers tokens 0..63 only
    got = logits.to(device)
    with force("triton"):
        apply_token_bitmask(got, bitmask.to(device))
    assert torch.equal(got.cpu()[:, :64], logits[:, :64]) and got.cpu()[:, 64:].isneginf().all()
