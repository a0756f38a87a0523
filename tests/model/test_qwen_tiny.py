"""Qwen2 (q/k/v biases) and Qwen3 (q/k head norms, a head size of its own) on tiny random GGUF models
against transformers loading the same file; the native decoder step bitwise the per-op path with them;
greedy tokens the same alone and batched through the engine."""
from __future__ import annotations

import gguf
import pytest
import torch

from engine_helpers import assert_greedy_alone_is_batched
from model_helpers import assert_native_step_is_the_per_op_path, greedy, hf_model, prefill_logits
from tiny_model import TinyLlamaSpec, write_tiny_qwen
from tokenmill.kernels import native
from tokenmill.model import load_model

Q = gguf.GGMLQuantizationType
ARCHS = ["qwen2", "qwen3"]
PROMPT = torch.randint(6, 260, (40,), generator=torch.Generator().manual_seed(3)).tolist()
BLOCK = 16


def _reference(path, arch: str, spec: TinyLlamaSpec, ids: list[int]) -> torch.Tensor:
    # transformers' GGUF mapping does not read Qwen3's key_length: its head_dim is given here.
    config = {"head_dim": spec.head_dim or spec.dim // spec.n_heads} if arch == "qwen3" else {}
    with torch.inference_mode():
        return hf_model(path, **config)(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [None, 9])
def test_logits_match_transformers(tmp_path, arch, chunk):
    spec = TinyLlamaSpec(tied_embeddings=arch == "qwen2")
    path = write_tiny_qwen(tmp_path / "q.gguf", arch, spec)
    ours = load_model(path, torch.float32).model
    torch.testing.assert_close(prefill_logits(ours, PROMPT, chunk=chunk), _reference(path, arch, spec, PROMPT),
                               atol=1e-4, rtol=1e-4)


def test_qwen3_head_size_of_its_own_matches_transformers(tmp_path):
    # Qwen3-0.6B's heads are 128 wide under a 1024-wide stream of 16 heads; here 32 under 64 / 4.
    spec = TinyLlamaSpec(head_dim=32)
    path = write_tiny_qwen(tmp_path / "q.gguf", "qwen3", spec)
    model = load_model(path, torch.float32).model
    assert model.config.head_dim == 32 and model.blocks[0].attn.qkv_proj.out_features == (4 + 2 * 2) * 32
    torch.testing.assert_close(prefill_logits(model, PROMPT, chunk=13), _reference(path, "qwen3", spec, PROMPT),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_what_qwen_adds_is_what_makes_them_match(tmp_path, arch):
    """Guards the tests above: without the biases (Qwen2) or the head norms (Qwen3) the logits move."""
    spec = TinyLlamaSpec()
    path = write_tiny_qwen(tmp_path / "q.gguf", arch, spec)
    model = load_model(path, torch.float32).model
    for block in model.blocks:
        if arch == "qwen2":
            block.attn.qkv_proj.bias = None
        else:
            block.attn.q_norm = block.attn.k_norm = None
    assert (prefill_logits(model, PROMPT) - _reference(path, arch, spec, PROMPT)).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tmp_path, arch):
    path = write_tiny_qwen(tmp_path / "q.gguf", arch)
    config = {"head_dim": 16} if arch == "qwen3" else {}
    with torch.inference_mode():
        expected = hf_model(path, **config).generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                                                     eos_token_id=None, pad_token_id=0)
    assert greedy(load_model(path, torch.float32).model, PROMPT, 20) == expected[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_quantized_weights_on_the_native_kernels_match_transformers(tmp_path, arch, qtype):
    # transformers dequantizes the same blocks; ours keep them and quantize the activations to int8
    # (two planes), so the match is close, not exact.
    spec = TinyLlamaSpec(weight_type=qtype)
    path = write_tiny_qwen(tmp_path / "q.gguf", arch, spec)
    loaded = load_model(path, "gguf")
    assert loaded.weights == "gguf"
    got = prefill_logits(loaded.model, PROMPT, paged=True)
    torch.testing.assert_close(got, _reference(path, arch, spec, PROMPT), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not native.runnable_variants(), reason="native kernels not built")
@pytest.mark.parametrize("variant", native.runnable_variants())
@pytest.mark.parametrize("arch", ARCHS)
def test_native_step_is_bitwise_the_per_op_path(tmp_path, variant, arch):
    assert_native_step_is_the_per_op_path(
        write_tiny_qwen(tmp_path / "q.gguf", arch, TinyLlamaSpec(weight_type=Q.Q8_0, head_dim=32)), variant)


@pytest.mark.skipif(not native.runnable_variants(), reason="native kernels not built")
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_tokens_alone_and_batched(tmp_path, arch):
    """The defaults a user gets (gguf weights, the native step, f16 KV): the same tokens alone and batched."""
    path = write_tiny_qwen(tmp_path / "q.gguf", arch, TinyLlamaSpec(weight_type=Q.Q8_0, context_length=512))
    assert_greedy_alone_is_batched(load_model(path), 5)
