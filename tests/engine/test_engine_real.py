"""Batching must not change greedy results: real SmolLM2 in fp32."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import make_engine, run_one_at_a_time, run_to_completion
from tokenmill.engine import SamplingParams
from tokenmill.model import load_model

pytestmark = pytest.mark.real_model

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based inks and a wooden press into a system that could produce books quickly. "
        "Before that, books were copied by hand, which made them rare and expensive. The new technique spread "
        "across Europe within decades, and cities such as Venice, Paris and Lyon became centres of printing. ")


@pytest.fixture(scope="module")
def loaded(smollm2_path):
    return load_model(smollm2_path, torch.float32)


def test_sixteen_prompts_alone_and_together_with_chunked_prefill(loaded):
    tok = make_engine(loaded).tokenizer
    corpus = tok.encode(TEXT * 5)
    lengths = [5, 300, 17, 64, 120, 33, 250, 8, 90, 200, 45, 150, 12, 280, 70, 99]
    # Distinct starting points so the prompts do not share prefixes.
    prompts = [corpus[i * 7: i * 7 + n] for i, n in enumerate(lengths)]
    assert sorted(len(p) for p in prompts)[0] == 5 and max(len(p) for p in prompts) == 300
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reqs = [(p, params) for p in prompts]
    alone = run_one_at_a_time(make_engine(loaded, max_total_tokens=16384), reqs)
    engine = make_engine(loaded, max_total_tokens=16384, n_batch=64, n_ubatch=64)
    together = run_to_completion(engine, reqs, check_every_step=False)
    assert together == alone
    assert engine.stats.tokens_per_step.count > 16  # chunked: many steps, each at most 64 tokens
    assert max(b for b, c in zip([*engine.stats.tokens_per_step.buckets, float("inf")],
                                 engine.stats.tokens_per_step.counts) if c) <= 64
