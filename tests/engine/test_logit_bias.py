"""OpenAI's logit_bias through the engine: a ban, a forced token, the vocabulary check, and the output
unchanged by batching and speculation (each verification row is biased as its own step would be)."""
from __future__ import annotations

from dataclasses import replace

import gguf
import pytest

from engine_helpers import make_engine, random_ids, run_one_at_a_time, run_to_completion
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.engine import SamplingParams
from tokenmill.engine.sampling_params import InvalidSamplingParams
from tokenmill.kernels import variant
from tokenmill.model import load_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("bias") / "t.gguf",
                            TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0, context_length=512))
    return load_model(path)


def repetitive(seed: int) -> list[int]:
    return random_ids(10, seed) * 4  # speculation finds matches in it


def test_a_banned_token_never_comes_and_a_forced_one_always_does(loaded):
    e = make_engine(loaded)
    prompt = random_ids(20, 1)
    plain = run_to_completion(e, [(prompt, GREEDY)])[0]
    first = plain[0]
    banned = run_to_completion(e, [(prompt, replace(GREEDY, logit_bias={first: -100.0}))])[0]
    assert banned[0] != first and first not in banned
    forced = run_to_completion(e, [(prompt, replace(GREEDY, logit_bias={7: 100.0}))])[0]
    assert forced == [7] * GREEDY.max_tokens
    # Sampled rows see the same logits: a token banned from a hot distribution never comes either.
    hot = SamplingParams(max_tokens=64, temperature=1.5, seed=3, ignore_eos=True)
    free = run_to_completion(e, [(prompt, hot)])[0]
    common = max(set(free), key=free.count)
    assert common not in run_to_completion(e, [(prompt, replace(hot, logit_bias={common: -100.0}))])[0]


@pytest.mark.skipif(variant() == "torch", reason="speculation needs the native kernels")
def test_biased_greedy_output_is_the_same_alone_batched_and_speculating(loaded):
    requests = [(repetitive(i), replace(GREEDY, logit_bias={5 + i: 3.0, 40: -2.5})) for i in range(3)]
    requests.append((repetitive(9), GREEDY))
    alone = run_one_at_a_time(make_engine(loaded, speculative="off"), requests)
    assert run_to_completion(make_engine(loaded, speculative="off"), requests) == alone
    spec = make_engine(loaded, speculative="ngram", num_speculative_tokens=6, spec_ngram_min=1)
    spec.scheduler.speculator.cfg = replace(spec.scheduler.speculator.cfg, row_cost=1e-4, learn_step_costs=False)
    spec.scheduler.speculator.proposer.cfg = spec.scheduler.speculator.cfg
    assert run_to_completion(spec, requests) == alone
    assert spec.stats.spec.num_accepted_tokens > 0  # verification rows ran, biased


@pytest.mark.parametrize("bias,message", [({5: 101.0}, "between -100 and 100"), ({5: float("nan")}, "between"),
                                          ({-1: 1.0}, "at least 0"), ({5: "x"}, "must be a number"),
                                          ([5], "map token ids")])
def test_bad_biases_name_logit_bias(bias, message):
    with pytest.raises(InvalidSamplingParams, match=message) as info:
        replace(GREEDY, logit_bias=bias).validate()
    assert info.value.field == "logit_bias"


def test_an_id_past_the_vocabulary_is_refused_before_anything_runs(loaded):
    e = make_engine(loaded)
    vocab = loaded.config.vocab_size
    with pytest.raises(InvalidSamplingParams, match="outside the vocabulary") as info:
        e.add_request(random_ids(5, 2), replace(GREEDY, logit_bias={vocab: 1.0}))
    assert info.value.field == "logit_bias" and not e.has_unfinished()
