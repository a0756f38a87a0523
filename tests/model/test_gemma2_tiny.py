"""Gemma 2 on tiny random GGUF models against transformers loading the same file: soft-capped scores
(every CPU attention path: PyTorch's decode, chunk and piece paths, the native kernel) and logits,
alternating local and global layers across an 8-key window; the native decoder step bitwise the
per-op path; greedy tokens alone and batched; the caps' values checked."""
from __future__ import annotations

import math

import gguf
import pytest
import torch

from engine_helpers import assert_greedy_alone_is_batched
from model_helpers import assert_native_step_is_the_per_op_path, greedy, hf_model, prefill_logits
from tiny_model import TinyGemma3Spec, write_tiny_gemma2
from tiny_spm import tiny_spm_metadata
from tokenmill.gguf.config import ModelConfig
from tokenmill.gguf.reader import GGUFError
from tokenmill.kernels import native, use_variant
from tokenmill.kernels.attention import paged_attention, paged_attention_reference
from tokenmill.model import load_model
from tokenmill.model import attention as torch_attention

Q = gguf.GGMLQuantizationType
PROMPT = torch.randint(6, 260, (40,), generator=torch.Generator().manual_seed(2)).tolist()
SPEC = TinyGemma3Spec(n_layers=4, arch="gemma2")


def _hf(path, spec: TinyGemma3Spec = SPEC):
    # transformers' GGUF mapping leaves the caps at Gemma 2's defaults (50, 30): given here.
    return hf_model(path, attn_logit_softcapping=spec.attn_softcap, final_logit_softcapping=spec.final_softcap,
                    query_pre_attn_scalar=spec.head_dim)


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    return write_tiny_gemma2(tmp_path_factory.mktemp("gemma2") / "tiny-gemma2.gguf", tiny_spm_metadata(), SPEC)


@pytest.fixture(scope="module")
def reference_logits(tiny_gemma2):
    with torch.inference_mode():
        return _hf(tiny_gemma2)(torch.tensor([PROMPT])).logits[0, -1]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("chunk", [None, 7, 16])
def test_logits_match_transformers(tiny_gemma2, reference_logits, paged, chunk):
    model = load_model(tiny_gemma2, torch.float32).model
    assert [b.attn.window for b in model.blocks] == [8, None, 8, None]
    assert all(b.attn.softcap == 0.5 and b.attn.q_norm is None for b in model.blocks)
    assert model.final_softcap == 1.0 and model.local_rope is model.rope
    got = prefill_logits(model, PROMPT, chunk=chunk, paged=paged)
    torch.testing.assert_close(got, reference_logits, atol=1e-4, rtol=1e-4)


def test_the_caps_and_the_window_are_what_makes_them_match(tiny_gemma2, reference_logits):
    """Guards the test above: without the score cap, the logit cap or the window, the logits move."""
    model = load_model(tiny_gemma2, torch.float32).model
    model.final_softcap = 0.0
    assert (prefill_logits(model, PROMPT) - reference_logits).abs().max() > 1e-2
    model = load_model(tiny_gemma2, torch.float32).model
    for block in model.blocks:
        block.attn.softcap = 0.0
    assert (prefill_logits(model, PROMPT) - reference_logits).abs().max() > 1e-2
    model = load_model(tiny_gemma2, torch.float32).model
    for block in model.blocks:
        block.attn.window = None
    assert (prefill_logits(model, PROMPT) - reference_logits).abs().max() > 1e-2


def test_long_chunks_take_the_capped_pieces(tiny_gemma2, monkeypatch):
    """A chunk of PIECE_FROM queries or more runs causal_pieces: made small here, its capped scores
    give what the one-chunk path gives."""
    model = load_model(tiny_gemma2, torch.float32).model
    want = prefill_logits(model, PROMPT, chunk=20)
    monkeypatch.setattr(torch_attention, "PIECE_FROM", 16)
    monkeypatch.setattr(torch_attention, "PIECE", 8)
    torch_attention._keys_after_query.cache_clear()
    try:
        torch.testing.assert_close(prefill_logits(model, PROMPT, chunk=20), want, atol=1e-5, rtol=1e-5)
    finally:
        torch_attention._keys_after_query.cache_clear()


def test_greedy_matches_transformers(tiny_gemma2):
    with torch.inference_mode():
        expected = _hf(tiny_gemma2).generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                                             eos_token_id=None, pad_token_id=0)
    assert greedy(load_model(tiny_gemma2, torch.float32).model, PROMPT, 20) == expected[0, len(PROMPT):].tolist()


def test_quantized_weights_on_the_native_kernels_match_transformers(tmp_path):
    spec = TinyGemma3Spec(n_layers=4, arch="gemma2", weight_type=Q.Q8_0)
    path = write_tiny_gemma2(tmp_path / "q.gguf", tiny_spm_metadata(), spec)
    loaded = load_model(path, "gguf")
    assert loaded.weights == "gguf"
    with torch.inference_mode():
        want = _hf(path, spec)(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(loaded.model, PROMPT, paged=True), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not native.runnable_variants(), reason="native kernels not built")
@pytest.mark.parametrize("variant", native.runnable_variants())
@pytest.mark.parametrize("softcap", [0.0, 0.3, 50.0])
def test_the_kernels_cap_as_the_reference_does(variant, softcap):
    g = torch.Generator().manual_seed(7)
    h_kv, group, d, block, rows = 2, 2, 64, 16, [5, 1, 23]
    k_cache, v_cache = (torch.randn(h_kv, 8 * block, d, generator=g) for _ in range(2))
    q = torch.randn(sum(rows), h_kv * group, d, generator=g) * 3
    cu_rows = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    start_pos = torch.tensor([20, 40, 0], dtype=torch.int32)
    tables = torch.tensor([[3, 1, 0, 0], [2, 4, 6, 7], [5, 0, 0, 0]], dtype=torch.int32)
    args = (q, k_cache, v_cache, torch.empty(0), torch.empty(0), cu_rows, start_pos, tables, block, 0.125)
    want = paged_attention_reference(*args, window=6, softcap=softcap)
    with use_variant(variant):
        got = paged_attention(*args, window=6, softcap=softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    if softcap == 0.3:  # the cap changes the result (else the test above would not see a missing one)
        assert (paged_attention_reference(*args, window=6) - want).abs().max() > 1e-2


@pytest.mark.skipif(not native.runnable_variants(), reason="native kernels not built")
@pytest.mark.parametrize("variant", native.runnable_variants())
def test_native_step_is_bitwise_the_per_op_path(tmp_path, variant):
    spec = TinyGemma3Spec(n_layers=4, arch="gemma2", weight_type=Q.Q8_0)
    assert_native_step_is_the_per_op_path(write_tiny_gemma2(tmp_path / "q.gguf", tiny_spm_metadata(), spec), variant)


@pytest.mark.skipif(not native.runnable_variants(), reason="native kernels not built")
def test_engine_greedy_tokens_alone_and_batched(tmp_path):
    """The defaults a user gets (gguf weights, the native step, f16 KV, greedy on capped logits)."""
    spec = TinyGemma3Spec(n_layers=4, arch="gemma2", weight_type=Q.Q8_0, context_length=512)
    assert_greedy_alone_is_batched(load_model(write_tiny_gemma2(tmp_path / "q.gguf", tiny_spm_metadata(), spec)), 8)


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_caps_must_be_numbers_zero_or_more(value):
    shapes = {"token_embd.weight": (8, 32)}
    metadata = {"gemma2.attention.head_count": 2, "gemma2.embedding_length": 32, "gemma2.block_count": 1,
                "gemma2.feed_forward_length": 64, "gemma2.vocab_size": 8, "gemma2.attn_logit_softcapping": value}
    with pytest.raises(GGUFError, match="attn_logit_softcapping"):
        ModelConfig.from_metadata("gemma2", metadata, shapes, "the file")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("value", [-3, 2.5, "abc", True])
def test_the_window_must_be_a_whole_number(arch, value):
    # A hostile file's window was taken as it came: a string failed the load with a bare ValueError.
    shapes = {"token_embd.weight": (8, 32)}
    metadata = {f"{arch}.attention.head_count": 2, f"{arch}.embedding_length": 32, f"{arch}.block_count": 1,
                f"{arch}.feed_forward_length": 64, f"{arch}.vocab_size": 8, f"{arch}.attention.sliding_window": value}
    with pytest.raises(GGUFError, match="sliding_window"):
        ModelConfig.from_metadata(arch, metadata, shapes, "the file")
