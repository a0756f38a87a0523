"""Speculative decoding against the engine's statistics: what /metrics reports of a request whose steps
deliver several tokens at once (accepted proposals) must describe what the client got."""
from __future__ import annotations

import time
from dataclasses import replace

import gguf
import pytest

from engine_helpers import assert_all_free, make_engine
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.engine import SamplingParams
from tokenmill.kernels import variant
from tokenmill.model import load_model

pytestmark = pytest.mark.skipif(variant() == "torch", reason="native kernels not built")

STEP_SECONDS = 0.01  # every step lasts at least this long: a step's 7 tokens at most share over 1 ms each


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("specaudit") / "t.gguf",
                            TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0, context_length=512))
    return load_model(path)


def eager_engine(loaded, speculative: str):
    e = make_engine(loaded, max_total_tokens=4096, speculative=speculative, num_speculative_tokens=6,
                    spec_ngram_min=1)
    if e.scheduler.speculator is not None:  # propose at every match: rows cost next to nothing here
        cfg = replace(e.scheduler.speculator.cfg, row_cost=1e-4, learn_step_costs=False)
        e.scheduler.speculator.cfg = e.scheduler.speculator.proposer.cfg = cfg
    e.step_hook = lambda batch: time.sleep(STEP_SECONDS)
    return e


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_inter_token_latency_covers_every_token_and_the_whole_generation(llama, speculative):
    # vllm:inter_token_latency_seconds / time_per_output_token_seconds: one observation per token after
    # the first, summing to the time from the first token to the last. A step that accepted proposals
    # delivers its tokens together: the step's time is theirs, shared, not a single gap of 0 (which is
    # what the histogram got, once per step: the mean said speculation made tokens free).
    e = eager_engine(llama, speculative)
    prompt = list(range(40, 52)) * 4
    e.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    e.step()
    [seq] = e.scheduler.running
    while e.has_unfinished():
        e.step()
    assert_all_free(e)
    assert len(seq.output_ids) == 40
    if speculative != "off":
        assert e.stats.spec.num_accepted_tokens >= 10 and e.stats.num_steps < 30
    itl, t = e.stats.itl, seq.times
    assert itl.count == len(seq.output_ids) - 1
    assert itl.sum == pytest.approx(t.last_token - t.first_token, rel=1e-6)
    assert itl.cumulative()[0][1] == 0  # no token's share under a millisecond: every step slept 10
