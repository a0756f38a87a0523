"""Sampling on device logits (engine/sampler.py): a tensor off the CPU takes the torch reference paths
(native.for_rows gives no kernel for it) with its tensors on the logits' device, and grammar masks go
through tokenmill.kernels.gpu. Held here on CPU tensors: the reference paths — what a GPU runs — give
the same tokens and logprobs as the compiled CPU kernels for every knob; on a GPU (skipped without one)
the sampler on CUDA logits gives the CPU's tokens."""
from __future__ import annotations

import pytest
import torch

from tokenmill.engine.sampler import Sampler, SamplerInput, make_generator
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.kernels import native
from tokenmill.kernels.token_mask import apply_token_bitmask_on_device, apply_token_bitmask_reference
from tokenmill.structured.masks import TokenMasks

VOCAB = 1000
ROWS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_k=40, seed=2),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3),
    SamplingParams(temperature=1.2, min_p=0.05, seed=4),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.02, seed=5),
    SamplingParams(temperature=0, repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
                   repeat_last_n=8),
    SamplingParams(temperature=1.0, typical_p=0.9, seed=6),
    SamplingParams(temperature=0.6, repeat_penalty=1.1, seed=7, logprobs=True, top_logprobs=5),
    SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
]


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def sampler_input(params: list[SamplingParams], masks: TokenMasks | None = None) -> SamplerInput:
    recent = [[(7 * i + j) % VOCAB for j in range(12)] for i in range(len(params))]
    return SamplerInput(params=params, generators=[make_generator(p.seed) for p in params],
                        recent_token_ids=recent, num_output_tokens=[3] * len(params),
                        stop_token_ids=[frozenset({2})] * len(params), token_masks=masks)


def sample(logits: torch.Tensor, params, masks=None, *, seed: int = 0):
    torch.manual_seed(seed)  # rows without a seed draw from the global RNG
    return Sampler()(logits.clone(), sampler_input(params, masks), owned=True)


def grammar_masks(rows: list[int]) -> TokenMasks:
    g = torch.Generator().manual_seed(9)
    bits = torch.randint(-2**31, 2**31 - 1, (len(rows), (VOCAB + 31) // 32), generator=g, dtype=torch.int64)
    return TokenMasks(rows, bits.to(torch.int32))


@pytest.mark.skipif(native.variant() == "torch", reason="native kernels not built: nothing to compare")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_paths_sample_what_the_cpu_kernels_do(seed):
    logits = logits_rows(len(ROWS), seed)
    ours = sample(logits, ROWS, seed=seed)
    with native.use_variant("torch"):
        device_path = sample(logits, ROWS, seed=seed)
    assert device_path.token_ids == ours.token_ids
    for a, b in zip(device_path.logprobs, ours.logprobs):
        assert (a is None) == (b is None) and (a is None or abs(a - b) < 1e-4)
    for a, b in zip(device_path.top_logprobs, ours.top_logprobs):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b))


@pytest.mark.skipif(native.variant() == "torch", reason="native kernels not built: nothing to compare")
def test_grammar_masks_on_the_reference_path():
    logits = logits_rows(len(ROWS), 5)
    masks = grammar_masks([0, 3, 6, 9])
    ours = sample(logits, ROWS, masks)
    with native.use_variant("torch"):
        assert sample(logits, ROWS, masks).token_ids == ours.token_ids


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], []])
def test_device_mask_helper_matches_the_reference(rows):
    """apply_token_bitmask_on_device is what device logits take; on CPU tensors the GPU op falls
    back to its reference, so the helper's row handling is checked here. A mask shorter than the
    vocabulary (padding ids of the embedding) disallows the rest."""
    logits = logits_rows(4, 2)[:, :70]
    bits = grammar_masks(rows).bits[:, :2]  # 64 tokens' worth of mask for 70 logits
    expected = logits.clone()
    if rows:
        apply_token_bitmask_reference(expected, rows, bits)
    got = logits.clone()
    apply_token_bitmask_on_device(got, rows, bits)
    assert torch.equal(got, expected)
    if rows:
        assert torch.isneginf(got[rows[0], 64:]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_logits_sample_the_cpu_tokens(seed):
    logits = logits_rows(len(ROWS), seed)
    masks = grammar_masks([0, 2, 5])
    with native.use_variant("torch"):
        cpu = sample(logits, ROWS, masks, seed=seed)
    cuda = sample(logits.cuda(), ROWS, masks, seed=seed)
    assert cuda.token_ids == cpu.token_ids
    for a, b in zip(cuda.logprobs, cpu.logprobs):
        assert (a is None) == (b is None) and (a is None or abs(a - b) < 1e-3)
