"""Batch invariance with the settings a user gets by default (gguf weights on the native kernels,
bf16 KV cache): a greedy request gives the same tokens alone and inside any batch, whether its
prompt is computed whole or in chunks. Every kernel computes a row the same way whatever shares the
step, so this holds exactly, not only in fp32."""
from __future__ import annotations

import gguf
import pytest
import torch

from engine_helpers import make_engine, run_one_at_a_time, run_to_completion
from tiny_model import TinyGemma3Spec, TinyLlamaSpec, write_tiny_gemma3, write_tiny_llama
from tiny_spm import tiny_spm_metadata
from tokenmill.engine import SamplingParams
from tokenmill.kernels import variant
from tokenmill.model import load_model

Q = gguf.GGMLQuantizationType
LENGTHS = [5, 300, 17, 64, 120, 33, 250, 8, 90, 200, 45, 150, 12, 280, 70, 99]

pytestmark = pytest.mark.skipif(variant() == "torch", reason="native kernels not built")


def _prompts(vocab_lo: int, vocab_hi: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(vocab_lo, vocab_hi, (n,), generator=g).tolist() for n in LENGTHS]


def _alone_and_together(loaded, prompts, max_tokens: int = 10) -> tuple[list, list, object]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = [(p, params) for p in prompts]
    alone = run_one_at_a_time(make_engine(loaded, max_total_tokens=16384), reqs)
    engine = make_engine(loaded, max_total_tokens=16384, n_batch=64, n_ubatch=64)
    together = run_to_completion(engine, reqs, check_every_step=False)
    return alone, together, engine


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0])
def test_tiny_llama_alone_and_batched_with_chunked_prefill(tmp_path, qtype):
    path = write_tiny_llama(tmp_path / "t.gguf", TinyLlamaSpec(weight_type=qtype, context_length=512))
    loaded = load_model(path)  # defaults: gguf weights, f16 KV
    assert loaded.weights == "gguf"
    alone, together, engine = _alone_and_together(loaded, _prompts(6, 260))
    assert engine.kv.dtype == torch.float16 and engine.native_attention
    assert together == alone


def test_tiny_gemma3_alone_and_batched_across_its_window(tmp_path):
    path = write_tiny_gemma3(tmp_path / "g.gguf", tiny_spm_metadata(),
                             TinyGemma3Spec(weight_type=Q.Q8_0, context_length=512))
    alone, together, _ = _alone_and_together(load_model(path), _prompts(6, 260))
    assert together == alone


def test_int8_kv_cache_is_batch_invariant_too(tmp_path):
    path = write_tiny_llama(tmp_path / "t.gguf", TinyLlamaSpec(weight_type=Q.Q8_0, context_length=512))
    loaded = load_model(path)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reqs = [(p, params) for p in _prompts(6, 260)[:6]]
    alone = run_one_at_a_time(make_engine(loaded, kv_dtype="int8", max_total_tokens=8192), reqs)
    engine = make_engine(loaded, kv_dtype="int8", max_total_tokens=8192, n_batch=48, n_ubatch=48)
    assert engine.kv.dtype == torch.int8
    assert run_to_completion(engine, reqs) == alone


@pytest.mark.real_model
def test_smollm2_default_settings_sixteen_prompts_alone_and_together(smollm2_path):
    loaded = load_model(smollm2_path)
    tok = make_engine(loaded, max_total_tokens=1024).tokenizer
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
            "movable metal type, oil-based inks and a wooden press into a system that could produce books quickly. ")
    corpus = tok.encode(text * 12)
    prompts = [corpus[i * 7: i * 7 + n] for i, n in enumerate(LENGTHS)]
    assert min(len(p) for p in prompts) == 5 and max(len(p) for p in prompts) == 300
    alone, together, engine = _alone_and_together(loaded, prompts, max_tokens=12)
    assert together == alone
    assert engine.stats.tokens_per_step.count > 16  # chunked: many steps of at most 64 tokens
