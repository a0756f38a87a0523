"""Rotary scaling in Llama files, against transformers with the same settings: Llama 3.1+'s "llama3"
scaling, which GGUF files carry as a rope_freqs tensor (a divisor per frequency, as llama.cpp's converter
writes it from the model's rope_scaling), linear scaling (rope.scaling.type / factor) and YaRN (Qwen's
long-context settings). Types tokenmill does not implement (longrope outside phi3 files, others) are
refused, not ignored."""
from __future__ import annotations

import math

import pytest
import torch

from model_helpers import hf_model, prefill_logits
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.model import ModelLoadError, load_model

# Small enough that the tiny model's 8 frequencies fall in all three of llama3's bands.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
PROMPT = torch.randint(6, 260, (200,), generator=torch.Generator().manual_seed(4)).tolist()


def llama3_factors(head_dim: int, theta: float, p: dict) -> tuple[float, ...]:
    """The rope_freqs llama.cpp's converter writes for these settings."""
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / \
                     (p["high_freq_factor"] - p["low_freq_factor"])
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return tuple(out)


def _reference(path, spec: TinyLlamaSpec, rope: dict) -> torch.Tensor:
    with torch.inference_mode():
        model = hf_model(path, rope_parameters={**rope, "rope_theta": spec.rope_theta})
        return model(torch.tensor([PROMPT])).logits[0, -1]


def test_llama3_rope_freqs_match_transformers_llama3_scaling(tmp_path):
    spec = TinyLlamaSpec(rope_freqs=llama3_factors(16, 10000.0, LLAMA3))
    assert {1.0, 8.0} < set(spec.rope_freqs) and len(set(spec.rope_freqs)) > 3  # every band is exercised
    path = write_tiny_llama(tmp_path / "l3.gguf", spec)
    want = _reference(path, spec, LLAMA3)
    for dtype in (torch.float32, "gguf"):
        got = prefill_logits(load_model(path, dtype).model, PROMPT, chunk=64, paged=dtype == "gguf")
        torch.testing.assert_close(got, want, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-3)
    # Guard: the same file read without its factors is far off.
    plain = load_model(write_tiny_llama(tmp_path / "plain.gguf", TinyLlamaSpec()), torch.float32).model
    assert (prefill_logits(plain, PROMPT) - want).abs().max() > 1e-2


def test_linear_scaling_matches_transformers(tmp_path):
    spec = TinyLlamaSpec(rope_scaling=("linear", 4.0))
    path = write_tiny_llama(tmp_path / "lin.gguf", spec)
    want = _reference(path, spec, {"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(prefill_logits(load_model(path, torch.float32).model, PROMPT), want,
                               atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_yarn_matches_transformers(tmp_path, arch):
    """A 200-token prompt in a context stretched 4x beyond the original 48: the ramp between beta_fast
    and beta_slow falls inside the tiny model's 8 frequencies, and cos/sin carry 1 + 0.1 ln 4."""
    from tiny_model import write_tiny_qwen

    spec = TinyLlamaSpec(rope_scaling=("yarn", 4.0), rope_original_context=48)
    path = write_tiny_qwen(tmp_path / "y.gguf", arch, spec) if arch == "qwen2" else write_tiny_llama(tmp_path / "y.gguf", spec)
    model = load_model(path, torch.float32).model
    assert model.rope.magnitude == pytest.approx(1 + 0.1 * math.log(4.0))
    want = _reference(path, spec, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 48})
    for dtype in (torch.float32, "gguf"):
        got = prefill_logits(load_model(path, dtype).model, PROMPT, chunk=64, paged=dtype == "gguf")
        torch.testing.assert_close(got, want, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-3)
    # Guard: linear scaling by the same factor is far off.
    linear = load_model(write_tiny_llama(tmp_path / "lin.gguf", TinyLlamaSpec(rope_scaling=("linear", 4.0))),
                        torch.float32).model
    if arch == "llama":
        assert (prefill_logits(linear, PROMPT) - want).abs().max() > 1e-2


def test_yarn_needs_its_original_context(tmp_path):
    path = write_tiny_llama(tmp_path / "y.gguf", TinyLlamaSpec(rope_scaling=("yarn", 4.0)))
    with pytest.raises(ModelLoadError, match="original_context_length"):
        load_model(path, torch.float32)


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_scaling_types_not_implemented_are_refused(tmp_path, kind):
    path = write_tiny_llama(tmp_path / "y.gguf", TinyLlamaSpec(rope_scaling=(kind, 4.0)))
    with pytest.raises(ModelLoadError, match=f"rope scaling '{kind}' is not supported"):
        load_model(path, torch.float32)


def test_bad_rope_freqs_are_refused(tmp_path):
    path = write_tiny_llama(tmp_path / "bad.gguf", TinyLlamaSpec(rope_freqs=(1.0,) * 7 + (0.0,)))
    with pytest.raises(ModelLoadError, match="rope_freqs must be 8 positive factors"):
        load_model(path, torch.float32)


def test_validation_checks_the_rope_freqs_size(tmp_path):
    from tokenmill.gguf.validate import InvalidGGUF, validate_gguf

    good = write_tiny_llama(tmp_path / "good.gguf", TinyLlamaSpec(rope_freqs=(1.0,) * 8))
    assert validate_gguf(good, ("llama",)).architecture == "llama"
    short = write_tiny_llama(tmp_path / "short.gguf", TinyLlamaSpec(rope_freqs=(1.0,) * 7))
    with pytest.raises(InvalidGGUF, match=r"rope_freqs.weight has shape \[7\].*make it \[8\]"):
        validate_gguf(short, ("llama",))


@pytest.mark.parametrize("key,value", [("yarn_ext_factor", 0.5), ("yarn_attn_factor", 2.0), ("yarn_beta_fast", -1.0)])
def test_yarn_variants_and_bad_numbers_are_refused(tmp_path, key, value):
    spec = TinyLlamaSpec(rope_scaling=("yarn", 4.0), rope_original_context=48,
                         arch_floats=((f"rope.scaling.{key}", value),))
    with pytest.raises(ModelLoadError, match=f"rope.scaling.{key}"):
        load_model(write_tiny_llama(tmp_path / "y.gguf", spec), torch.float32)
