"""Granite on a tiny random GGUF against transformers' Granite: Llama's decoder with an embedding
multiplier, its own attention scale, a residual multiplier and a logit divisor, all from the file.
transformers cannot load a granite GGUF, so its model is built from the same config and given the
weights transformers reads from a byte-identical Llama file (as for SmolLM3); the native step stays
bitwise the per-op path with the residual multiplier; greedy tokens alone and batched."""
from __future__ import annotations

from dataclasses import replace

import gguf
import pytest
import torch

from engine_helpers import assert_greedy_alone_is_batched
from model_helpers import assert_native_step_is_the_per_op_path, greedy, hf_model, prefill_logits
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.gguf.config import ModelConfig
from tokenmill.gguf.reader import GGUFError
from tokenmill.kernels import native
from tokenmill.model import load_model

Q = gguf.GGMLQuantizationType
# Far from 1 so that each one moves the logits (Granite 3.x 2B's are 12, 0.22, 1/64 and 8).
MULTIPLIERS = (("embedding_scale", 6.0), ("residual_scale", 0.3), ("attention.scale", 0.09), ("logit_scale", 4.0))
SPEC = TinyLlamaSpec(n_layers=3, tied_embeddings=False, arch_floats=MULTIPLIERS)
PROMPT = torch.randint(6, 260, (50,), generator=torch.Generator().manual_seed(7)).tolist()


def _hf(llama_path):
    from transformers import GraniteConfig, GraniteForCausalLM

    llama = hf_model(llama_path)
    c = llama.config
    m = dict(MULTIPLIERS)
    config = GraniteConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                           rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": SPEC.rope_theta},
                           embedding_multiplier=m["embedding_scale"], residual_multiplier=m["residual_scale"],
                           attention_multiplier=m["attention.scale"], logits_scaling=m["logit_scale"])
    model = GraniteForCausalLM(config).eval()
    model.load_state_dict(llama.state_dict(), strict=True)  # the same tensors, Granite's forward
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("granite")
    return (write_tiny_llama(folder / "g.gguf", SPEC, arch="granite"),
            write_tiny_llama(folder / "l.gguf", replace(SPEC, arch_floats=())))


@pytest.fixture(scope="module")
def reference(files):
    return _hf(files[1])


def test_logits_match_transformers_granite(files, reference):
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0, -1]
    model = load_model(files[0], torch.float32).model
    assert (model.embed_scale, model.logit_divisor) == (6.0, 4.0)
    assert all(b.residual_scale == pytest.approx(0.3) and b.attn.scale == pytest.approx(0.09) for b in model.blocks)
    for chunk, paged in ((None, False), (13, False), (13, True)):
        torch.testing.assert_close(prefill_logits(model, PROMPT, chunk=chunk, paged=paged), want, atol=1e-4, rtol=1e-4)
    # Guard: read as a Llama (no multipliers), the same weights are far off.
    llama = load_model(files[1], torch.float32).model
    assert (prefill_logits(llama, PROMPT) - want).abs().max() > 1e-2


def test_greedy_and_quantized_match_transformers(tmp_path, reference, files):
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
    assert greedy(load_model(files[0], torch.float32).model, PROMPT, 16) == expected[0, len(PROMPT):].tolist()
    spec = replace(SPEC, weight_type=Q.Q8_0)
    q_path = write_tiny_llama(tmp_path / "q.gguf", spec, arch="granite")
    with torch.inference_mode():
        want = _hf(write_tiny_llama(tmp_path / "ql.gguf", replace(spec, arch_floats=())))(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(load_model(q_path, "gguf").model, PROMPT, paged=True), want,
                               atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not native.runnable_variants(), reason="native kernels not built")
@pytest.mark.parametrize("variant", native.runnable_variants())
def test_native_step_is_bitwise_the_per_op_path(tmp_path, variant):
    path = write_tiny_llama(tmp_path / "q.gguf", replace(SPEC, weight_type=Q.Q8_0), arch="granite")
    assert_native_step_is_the_per_op_path(path, variant)


@pytest.mark.skipif(not native.runnable_variants(), reason="native kernels not built")
def test_engine_greedy_tokens_alone_and_batched(tmp_path):
    spec = replace(SPEC, weight_type=Q.Q8_0, context_length=512)
    assert_greedy_alone_is_batched(load_model(write_tiny_llama(tmp_path / "q.gguf", spec, arch="granite")), 9)


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), "x"])
def test_multipliers_must_be_numbers_zero_or_more(value):
    meta = {"granite.attention.head_count": 2, "granite.embedding_length": 32, "granite.block_count": 1,
            "granite.feed_forward_length": 64, "granite.vocab_size": 8, "granite.residual_scale": value}
    with pytest.raises(GGUFError, match="residual_scale"):
        ModelConfig.from_metadata("granite", meta, {"token_embd.weight": (8, 32)}, "the file")
