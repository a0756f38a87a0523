"""Phi-3 (fused q/k/v and gate/up in its files) on tiny random GGUF models against transformers loading
the same file; the native decoder step bitwise the per-op path; greedy tokens the same alone and
batched through the engine; the file's sliding window not run (as llama.cpp and transformers);
LongRoPE (Phi-3.5, Phi-4-mini, with its partial rotation) against transformers' longrope."""
from __future__ import annotations

from dataclasses import replace

import gguf
import pytest
import torch

from engine_helpers import assert_greedy_alone_is_batched
from model_helpers import assert_native_step_is_the_per_op_path, greedy, hf_model, prefill_logits
from tiny_model import TinyLlamaSpec, write_tiny_llama, write_tiny_phi3
from tokenmill.gguf.config import ModelConfig
from tokenmill.gguf.reader import GGUFError, open_gguf
from tokenmill.gguf.validate import InvalidGGUF, validate_gguf
from tokenmill.kernels import native
from tokenmill.model import ARCHITECTURES, ModelLoadError, load_model

Q = gguf.GGMLQuantizationType
PROMPT = torch.randint(6, 260, (40,), generator=torch.Generator().manual_seed(4)).tolist()


def _reference(path, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(path)(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [None, 9])
def test_logits_match_transformers(tmp_path, tied, chunk):
    path = write_tiny_phi3(tmp_path / "p.gguf", TinyLlamaSpec(tied_embeddings=tied))
    model = load_model(path, torch.float32).model
    assert model.blocks[0].attn.qkv_proj.out_features == (4 + 2 * 2) * 16
    assert model.blocks[0].mlp.gate_up_proj.out_features == 2 * 128
    torch.testing.assert_close(prefill_logits(model, PROMPT, chunk=chunk), _reference(path, PROMPT),
                               atol=1e-4, rtol=1e-4)


def test_the_gate_is_the_fused_tensors_first_half(tmp_path):
    """Guards the test above: with ffn_up's halves the other way round the logits move."""
    path = write_tiny_phi3(tmp_path / "p.gguf")
    model = load_model(path, torch.float32).model
    for block in model.blocks:
        w = block.mlp.gate_up_proj.weight
        w.data = torch.cat([w.data[128:], w.data[:128]])
    assert (prefill_logits(model, PROMPT) - _reference(path, PROMPT)).abs().max() > 1e-2


def test_greedy_matches_transformers(tmp_path):
    path = write_tiny_phi3(tmp_path / "p.gguf")
    with torch.inference_mode():
        expected = hf_model(path).generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    assert greedy(load_model(path, torch.float32).model, PROMPT, 20) == expected[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_quantized_weights_on_the_native_kernels_match_transformers(tmp_path, qtype):
    # transformers dequantizes the same blocks; ours keep them and quantize the activations to int8.
    path = write_tiny_phi3(tmp_path / "p.gguf", TinyLlamaSpec(tied_embeddings=False, weight_type=qtype))
    loaded = load_model(path, "gguf")
    assert loaded.weights == "gguf"
    torch.testing.assert_close(prefill_logits(loaded.model, PROMPT, paged=True), _reference(path, PROMPT),
                               atol=2e-2, rtol=2e-2)


def test_the_files_sliding_window_is_not_run(tmp_path):
    # Phi-3-mini-4k's files say 2047; llama.cpp disables Phi's window and transformers' GGUF loading
    # leaves it out, so every layer attends to the whole context. A window of 8 would change these logits.
    path = write_tiny_phi3(tmp_path / "p.gguf", TinyLlamaSpec(tied_embeddings=False, sliding_window=8))
    model = load_model(path, torch.float32).model
    assert all(block.attn.window is None for block in model.blocks)
    torch.testing.assert_close(prefill_logits(model, PROMPT, chunk=9), _reference(path, PROMPT), atol=1e-4, rtol=1e-4)


LONG = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0)
SHORT = (1.0, 1.0, 1.1, 1.2, 1.4, 1.6, 2.0, 2.5)


def _longrope_spec(rope_dim: int | None = None, context_length: int = 256, **kw) -> TinyLlamaSpec:
    n = (rope_dim or 16) // 2
    return TinyLlamaSpec(tied_embeddings=False, context_length=context_length, rope_dim=rope_dim,
                         longrope=(LONG[:n], SHORT[:n], 16, 1.19), **kw)


def _hf_longrope(path, spec: TinyLlamaSpec):
    long, short, original, attn = spec.longrope
    rope = {"rope_type": "longrope", "rope_theta": spec.rope_theta, "long_factor": list(long),
            "short_factor": list(short), "original_max_position_embeddings": original, "attention_factor": attn,
            "partial_rotary_factor": (spec.rope_dim or 16) / 16}
    return hf_model(path, rope_parameters=rope, original_max_position_embeddings=original)


@pytest.mark.parametrize("rope_dim", [None, 12])  # 12 of 16: Phi-4-mini's partial rotation (3/4)
@pytest.mark.parametrize("paged", [False, True])
def test_longrope_matches_transformers(tmp_path, rope_dim, paged):
    """Phi-3.5 / Phi-4-mini: a 256-token context beyond the original 16 takes the long factors, with
    the attention factor on cos and sin; transformers takes them for a forward longer than 16."""
    spec = _longrope_spec(rope_dim)
    path = write_tiny_phi3(tmp_path / "p.gguf", spec)
    model = load_model(path, torch.float32).model
    assert model.longrope_factors() == "rope_factors_long.weight" and model.rope.magnitude == pytest.approx(1.19)
    with torch.inference_mode():
        want = _hf_longrope(path, spec)(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(model, PROMPT, chunk=9, paged=paged), want, atol=1e-4, rtol=1e-4)


def test_longrope_greedy_and_quantized_match_transformers(tmp_path):
    spec = _longrope_spec(12, weight_type=Q.Q8_0)
    path = write_tiny_phi3(tmp_path / "p.gguf", spec)
    hf = _hf_longrope(path, spec)
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        want = hf(torch.tensor([PROMPT])).logits[0, -1]
    assert greedy(load_model(path, torch.float32).model, PROMPT, 16) == expected[0, len(PROMPT):].tolist()
    torch.testing.assert_close(prefill_logits(load_model(path, "gguf").model, PROMPT, paged=True), want,
                               atol=2e-2, rtol=2e-2)


def test_longrope_within_the_original_context_takes_the_short_factors(tmp_path):
    spec = _longrope_spec(context_length=16)
    path = write_tiny_phi3(tmp_path / "p.gguf", spec)
    model = load_model(path, torch.float32).model
    assert model.longrope_factors() == "rope_factors_short.weight"
    with torch.inference_mode():
        want = _hf_longrope(path, spec)(torch.tensor([PROMPT[:12]])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(model, PROMPT[:12]), want, atol=1e-4, rtol=1e-4)
    assert (prefill_logits(load_model(write_tiny_phi3(tmp_path / "q.gguf", _longrope_spec()), torch.float32).model,
                           PROMPT[:12]) - want).abs().max() > 1e-3  # the long factors would differ


def test_longrope_follows_the_context_the_engine_runs_with(tmp_path):
    # llama.cpp picks the factors by its n_ctx: an engine whose context (the KV cache's size here) is
    # within the original one takes the short factors, as a file of that context does; back beyond it,
    # the long ones. Through the engine, greedy tokens follow.
    long_path = write_tiny_phi3(tmp_path / "long.gguf", _longrope_spec(weight_type=Q.Q8_0))
    short_path = write_tiny_phi3(tmp_path / "short.gguf", _longrope_spec(context_length=16, weight_type=Q.Q8_0))
    model = load_model(long_path, torch.float32).model
    long_logits = prefill_logits(model, PROMPT[:12])
    model.fit_context(16)
    assert model.longrope_factors(16) == "rope_factors_short.weight" and model.rope.magnitude == pytest.approx(1.19)
    short_logits = prefill_logits(load_model(short_path, torch.float32).model, PROMPT[:12])
    torch.testing.assert_close(prefill_logits(model, PROMPT[:12]), short_logits, atol=0, rtol=0)
    model.fit_context(256)
    torch.testing.assert_close(prefill_logits(model, PROMPT[:12]), long_logits, atol=0, rtol=0)
    assert (long_logits - short_logits).abs().max() > 1e-3
    if native.runnable_variants():  # the defaults a user gets: gguf weights, the native step
        from engine_helpers import make_engine
        from tokenmill.engine import SamplingParams

        def tokens(path, **cfg) -> list[int]:
            e = make_engine(load_model(path), **cfg)
            e.add_request(PROMPT[:8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            out = []
            while e.has_unfinished():
                out += [t for ev in e.step() for t in ev.token_ids]
            return out

        small = dict(max_total_tokens=16, block_size=16)
        assert tokens(long_path, **small) == tokens(short_path, **small)
        assert tokens(long_path, max_total_tokens=256) != tokens(long_path, **small)


def test_longrope_is_refused_where_it_cannot_run(tmp_path):
    # In a Llama file the factors are refused, not ignored (at load and when pushed, naming no path).
    spec = _longrope_spec()
    path = write_tiny_llama(tmp_path / "l.gguf", replace(spec, tied_embeddings=True))
    with pytest.raises(ModelLoadError, match="LongRoPE") as exc:
        load_model(path, torch.float32)
    assert str(tmp_path) not in str(exc.value).split(":", 1)[1]
    with pytest.raises(InvalidGGUF, match="LongRoPE") as exc:
        validate_gguf(path, ARCHITECTURES)
    assert str(tmp_path) not in str(exc.value)
    # A Phi-3 file needs its original context, a positive attention factor, and a factor a rotary frequency.
    g = open_gguf(write_tiny_phi3(tmp_path / "p.gguf", spec))
    meta, shapes = dict(g.metadata), {n: t.shape for n, t in g.tensors.items()}
    ModelConfig.from_metadata("phi3", meta, shapes, "the file")  # as written: fine
    for key, value, why in (("phi3.rope.scaling.original_context_length", None, "original_context_length"),
                            ("phi3.rope.scaling.original_context_length", 0, "original_context_length"),
                            ("phi3.rope.scaling.attn_factor", -1.0, "attn_factor")):
        bad = {k: v for k, v in meta.items() if k != key} if value is None else {**meta, key: value}
        with pytest.raises(GGUFError, match=why):
            ModelConfig.from_metadata("phi3", bad, shapes, "the file")
    with pytest.raises(GGUFError, match="rope_factors_long.weight has shape"):
        ModelConfig.from_metadata("phi3", meta, {**shapes, "rope_factors_long.weight": (5,)}, "the file")


@pytest.mark.skipif(not native.runnable_variants(), reason="native kernels not built")
@pytest.mark.parametrize("variant", native.runnable_variants())
def test_native_step_is_bitwise_the_per_op_path(tmp_path, variant):
    spec = TinyLlamaSpec(tied_embeddings=False, weight_type=Q.Q8_0)
    assert_native_step_is_the_per_op_path(write_tiny_phi3(tmp_path / "p.gguf", spec), variant)


@pytest.mark.skipif(not native.runnable_variants(), reason="native kernels not built")
def test_engine_greedy_tokens_alone_and_batched(tmp_path):
    """The defaults a user gets (gguf weights, the native step, f16 KV): the same tokens alone and batched."""
    spec = TinyLlamaSpec(tied_embeddings=False, weight_type=Q.Q8_0, context_length=512)
    assert_greedy_alone_is_batched(load_model(write_tiny_phi3(tmp_path / "p.gguf", spec)), 6)
