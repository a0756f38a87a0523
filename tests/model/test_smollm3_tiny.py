"""SmolLM3 on a tiny random GGUF against transformers' SmolLM3: Llama's decoder with every fourth
layer attending without positions (NoPE). transformers cannot load a smollm3 GGUF, so its model is
built from the same config and given the weights transformers reads from a byte-identical Llama file
(Q/K rows un-interleaved as for Llama); the native step stays bitwise the per-op path with the NoPE
layers' unrotated tables."""
from __future__ import annotations

import gguf
import pytest
import torch

from model_helpers import greedy, hf_model, prefill_logits
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.kernels import native
from tokenmill.model import load_model, native_step

Q = gguf.GGMLQuantizationType
SPEC = TinyLlamaSpec(n_layers=8, rope_theta=5_000_000.0)
PROMPT = torch.randint(6, 260, (60,), generator=torch.Generator().manual_seed(6)).tolist()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm3")
    return write_tiny_llama(folder / "s3.gguf", SPEC, arch="smollm3"), write_tiny_llama(folder / "l.gguf", SPEC)


@pytest.fixture(scope="module")
def reference(files):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    llama = hf_model(files[1])
    c = llama.config
    config = SmolLM3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                           rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2,
                           rope_parameters={"rope_type": "default", "rope_theta": SPEC.rope_theta})
    assert config.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]  # every fourth layer without positions
    model = SmolLM3ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    model.tie_weights()
    return model


def test_logits_match_transformers_smollm3(files, reference):
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0, -1]
    model = load_model(files[0], torch.float32).model
    assert model.rope_of_layer == [0, 0, 0, 1, 0, 0, 0, 1]
    for chunk in (None, 13):
        torch.testing.assert_close(prefill_logits(model, PROMPT, chunk=chunk), want, atol=1e-4, rtol=1e-4)
    # Guard: read as a Llama (positions in every layer), the same weights are far off.
    llama = load_model(files[1], torch.float32).model
    assert (prefill_logits(llama, PROMPT) - want).abs().max() > 1e-2


def test_greedy_matches_transformers(files, reference):
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
    assert greedy(load_model(files[0], torch.float32).model, PROMPT, 16) == expected[0, len(PROMPT):].tolist()


@pytest.mark.skipif(not native.runnable_variants(), reason="native kernels not built")
def test_native_step_is_bitwise_the_per_op_path(tmp_path):
    path = write_tiny_llama(tmp_path / "q.gguf", TinyLlamaSpec(n_layers=8, weight_type=Q.Q8_0), arch="smollm3")
    model = load_model(path, "gguf").model
    got = prefill_logits(model, PROMPT, chunk=17, paged=True)
    with native_step.disabled():
        want = prefill_logits(model, PROMPT, chunk=17, paged=True)
    assert torch.equal(got, want)
