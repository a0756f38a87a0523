"""Gemma 3 on tiny random GGUF models against transformers loading the same file. The window is 8
keys, so prompts of 40 tokens cross it: the local layers' masks are exercised in whole and chunked
prefills and in decoding."""
from __future__ import annotations

import gguf
import pytest
import torch

from model_helpers import greedy, hf_model, prefill_logits
from tiny_model import TinyGemma3Spec, write_tiny_gemma3
from tiny_spm import tiny_spm_metadata
from tokenmill.model import load_model

Q = gguf.GGMLQuantizationType
PROMPT = torch.randint(6, 260, (40,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf", tiny_spm_metadata())


@pytest.fixture(scope="module")
def reference_logits(tiny_gemma3):
    with torch.inference_mode():
        return hf_model(tiny_gemma3)(torch.tensor([PROMPT])).logits[0]


@pytest.mark.parametrize("chunk", [None, 7, 16])
def test_logits_match_transformers_across_the_window(tiny_gemma3, reference_logits, chunk):
    ours = load_model(tiny_gemma3, torch.float32).model
    assert [b.attn.window for b in ours.blocks] == [8, 8, 8, 8, 8, None, 8]
    torch.testing.assert_close(prefill_logits(ours, PROMPT, chunk=chunk), reference_logits[-1], atol=1e-4, rtol=1e-4)


def test_the_window_is_what_makes_them_match(tiny_gemma3, reference_logits):
    """Guards the test above: attending to every key instead moves the logits far off."""
    ours = load_model(tiny_gemma3, torch.float32).model
    for block in ours.blocks:
        block.attn.window = None
    assert (prefill_logits(ours, PROMPT) - reference_logits[-1]).abs().max() > 1e-2


def test_greedy_matches_transformers(tiny_gemma3):
    ours = load_model(tiny_gemma3, torch.float32).model
    with torch.inference_mode():
        expected = hf_model(tiny_gemma3).generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                                                  eos_token_id=None, pad_token_id=0)
    assert greedy(ours, PROMPT, 24) == expected[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("wtype", [Q.Q8_0, Q.Q5_0, Q.BF16])
def test_quantized_weights_match_transformers(tmp_path, wtype):
    path = write_tiny_gemma3(tmp_path / "q.gguf", tiny_spm_metadata(), TinyGemma3Spec(weight_type=wtype))
    with torch.inference_mode():
        expected = hf_model(path)(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(load_model(path, torch.float32).model, PROMPT), expected,
                               atol=1e-4, rtol=1e-4)


def test_bf16_stays_close_to_fp32(tiny_gemma3):
    fp32 = prefill_logits(load_model(tiny_gemma3, torch.float32).model, PROMPT)
    bf16 = prefill_logits(load_model(tiny_gemma3, torch.bfloat16).model, PROMPT).float()
    assert (bf16 - fp32).abs().max() < 0.1 * fp32.abs().max()
