"""Greedy steps that take their tokens straight from the head (DecoderLM.greedy_tokens, the bounded
kernel of kernels/head_argmax.py): on tiny Llama and Gemma 3 models with a Q8_0 head, requests alone,
batched, with speculation and with parallel samples get exactly the tokens they get from the full
logits; the engine takes that path only when every sampling row wants nothing but the argmax (with the
same suppressed ids, which the head then excludes), and falls back to the sampler when a row asks for
logprobs, penalties, a bias or a grammar, or rows suppress different ids."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import gguf
import pytest

from engine_helpers import assert_all_free, make_engine, run_one_at_a_time, run_to_completion
from tiny_model import TinyGemma3Spec, TinyLlamaSpec, write_tiny_gemma3, write_tiny_llama
from tiny_spm import tiny_spm_metadata
from tokenmill.engine import SamplingParams, memory
from tokenmill.kernels import head_argmax, native, variant
from tokenmill.model import load_model
from tokenmill.model.decoder import DecoderLM

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(variant() == "torch", reason="native kernels not built")

GREEDY = SamplingParams(max_tokens=40, temperature=0)


def llama(tmp_path):
    return load_model(write_tiny_llama(tmp_path / "t.gguf", TinyLlamaSpec(weight_type=Q.Q8_0, context_length=512)))


def gemma(tmp_path):
    return load_model(write_tiny_gemma3(tmp_path / "g.gguf", tiny_spm_metadata(),
                                        TinyGemma3Spec(weight_type=Q.Q8_0, context_length=512)))


def count_calls(monkeypatch) -> list[int]:
    """The steps that took greedy tokens instead of logits from here on: calls[0]."""
    calls = [0]
    real = DecoderLM.greedy_tokens

    def counted(model, hidden, indices=None, exclude=()):
        calls[0] += 1
        return real(model, hidden, indices, exclude)

    monkeypatch.setattr(DecoderLM, "greedy_tokens", counted)
    return calls


def prompts(n: int) -> list[list[int]]:
    return [[3 + (7 * i + 13 * j) % 250 for j in range(5 + 3 * i)] + [40, 41, 42, 40, 41] for i in range(n)]


def outputs(model, monkeypatch, on: bool, requests, **cfg):
    """Each request alone, all at once, and three parallel samples of the first (forked after its prompt)."""
    monkeypatch.setattr(head_argmax, "_ENABLED", on)
    engine = make_engine(model, max_total_tokens=4096, **cfg)
    if cfg.get("speculative") == "ngram":  # propose whenever a match is found (rows cost nothing here)
        spec = engine.scheduler.speculator
        spec.cfg = replace(spec.cfg, row_cost=1e-4, learn_step_costs=False)
        spec.proposer.cfg = spec.cfg
    samples: dict[int, list[int]] = {0: [], 1: [], 2: []}
    engine.add_request(requests[0][0], requests[0][1], n=3)
    while engine.has_unfinished():
        for ev in engine.step():
            samples[ev.index] += ev.token_ids
    assert_all_free(engine)
    return run_one_at_a_time(engine, requests), run_to_completion(engine, requests), samples


@pytest.mark.parametrize("model_fn", [llama, gemma], ids=["llama", "gemma3"])
@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_same_tokens_as_the_full_logits(model_fn, speculative, monkeypatch, tmp_path):
    requests = [(p, GREEDY) for p in prompts(5)]
    cfg = dict(speculative=speculative, num_speculative_tokens=6, spec_ngram_min=1)
    off = outputs(model_fn(tmp_path), monkeypatch, False, requests, **cfg)
    calls = count_calls(monkeypatch)
    model = model_fn(tmp_path)
    on = outputs(model, monkeypatch, True, requests, **cfg)
    assert on == off
    assert on[2][0] == on[2][1] == on[2][2] == on[0][0]  # greedy samples are the request alone
    assert calls[0] > 0
    # The bounded kernel ran where it is built (elsewhere greedy_tokens took the logits' argmax).
    assert head_argmax.GreedyHead(model.model.head_quantized.parts[0][0]).native == (native.variant() == "avx512")


@pytest.mark.parametrize("extra", [dict(logprobs=True), dict(top_logprobs=2), dict(repeat_penalty=1.3),
                                   dict(logit_bias={40: 5.0})], ids=lambda d: next(iter(d)))
def test_rows_that_want_more_than_the_argmax_take_the_sampler(extra, monkeypatch, tmp_path):
    model = llama(tmp_path)
    monkeypatch.setattr(head_argmax, "_ENABLED", True)
    calls = count_calls(monkeypatch)
    engine = make_engine(model, max_total_tokens=4096)
    special = replace(GREEDY, **extra)
    # Alone, the request never takes the greedy head; beside plain greedy requests it makes their steps
    # take the sampler too, and every request still gets the tokens it gets alone.
    alone = run_one_at_a_time(engine, [(prompts(1)[0], special)])
    assert calls[0] == 0
    mixed = run_to_completion(engine, [(prompts(1)[0], special)] + [(p, GREEDY) for p in prompts(3)[1:]])
    assert mixed[0] == alone[0]
    plain = run_one_at_a_time(engine, [(p, GREEDY) for p in prompts(3)[1:]])
    assert mixed[1:] == plain


def test_a_batch_past_the_amx_head_rows(monkeypatch, tmp_path):
    # 50 sequences decoding together: steps of 48 rows and more take the logits' argmax where the head
    # runs on AMX (DecoderLM.greedy_tokens), fewer the bounded kernel; either way the tokens of each
    # request alone.
    monkeypatch.setattr(head_argmax, "_ENABLED", True)
    calls = count_calls(monkeypatch)
    engine = make_engine(llama(tmp_path), max_total_tokens=16384)
    requests = [(p[:12], replace(GREEDY, max_tokens=8)) for p in prompts(50)]
    together = run_to_completion(engine, requests)
    assert calls[0] > 0
    assert together == run_one_at_a_time(engine, requests)


@pytest.mark.parametrize("model_fn", [llama, gemma], ids=["llama", "gemma3"])
def test_the_heads_6_bit_copy_gives_the_same_tokens(model_fn, monkeypatch, tmp_path):
    # A head that is most of a model's bytes keeps a 6-bit copy for one-row steps (greedy, one stream);
    # the tiny models' heads are not, so the share is lowered to 0 here. The same tokens as the full
    # logits, alone, batched and in parallel samples; the copy is counted in the model's memory and
    # taken from the KV cache's share of a budget.
    requests = [(p, GREEDY) for p in prompts(4)]
    off = outputs(model_fn(tmp_path), monkeypatch, False, requests)
    monkeypatch.setattr(head_argmax, "_ENABLED", True)
    monkeypatch.setattr(head_argmax, "COARSE_HEAD_SHARE", 0.0)
    loaded = model_fn(tmp_path)
    kept = loaded.model.greedy_head_bytes()
    assert kept > 0
    assert memory.kept_bytes(loaded) == kept
    assert outputs(loaded, monkeypatch, True, requests) == off
    head = loaded.model._greedy_head()
    assert head is None or head.coarse is not None  # built where the bounded kernel runs (avx512)
    cfg = make_engine(model_fn(tmp_path), max_total_tokens=4096).cfg
    per_token = memory.kv_bytes_per_token(cfg, loaded)
    fitted = memory.fit_kv_cache(cfg, loaded, kept + 1024 * per_token)
    assert fitted.max_total_tokens == 1024  # what is left after the copy
    monkeypatch.setattr(head_argmax, "COARSE_HEAD_SHARE", 1.01)
    assert loaded.model.greedy_head_bytes() == 0


@pytest.mark.parametrize("model_fn", [llama, gemma], ids=["llama", "gemma3"])
@pytest.mark.parametrize("suppress", ["ignore_eos", "min_tokens"])
@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_suppressing_rows_take_the_head_without_those_ids(model_fn, suppress, speculative, monkeypatch, tmp_path):
    # A greedy row that suppresses its end tokens (ignore_eos; below min_tokens its stop tokens too)
    # takes its token from the head with those columns excluded: the tokens the sampler's suppression
    # gives, alone, batched (all rows suppressing the same ids), speculating, with the 6-bit copy; in a
    # batch whose rows suppress different ids (the sampler's steps) each still gets its own tokens.
    cfg = dict(speculative=speculative, num_speculative_tokens=6, spec_ngram_min=1)
    params = replace(GREEDY, ignore_eos=True)
    if suppress == "min_tokens":  # stop ids the model makes when free to: its two commonest tokens
        free = outputs(model_fn(tmp_path), monkeypatch, False, [(p, GREEDY) for p in prompts(4)], **cfg)[0]
        counts = Counter(t for out in free for t in out[:30])
        params = replace(GREEDY, min_tokens=30, stop_token_ids=[t for t, _ in counts.most_common(2)])
    requests = [(p, params) for p in prompts(4)]
    off = outputs(model_fn(tmp_path), monkeypatch, False, requests, **cfg)
    if suppress == "min_tokens":
        assert not any(t in params.stop_token_ids for out in off[0] for t in out[:30])
    calls = count_calls(monkeypatch)
    monkeypatch.setattr(head_argmax, "COARSE_HEAD_SHARE", 0.0)
    assert outputs(model_fn(tmp_path), monkeypatch, True, requests, **cfg) == off
    assert calls[0] > 0
    engine = make_engine(model_fn(tmp_path), max_total_tokens=4096)
    mixed = run_to_completion(engine, [(prompts(1)[0], params), (prompts(2)[1], GREEDY)])
    assert mixed == [off[0][0], run_one_at_a_time(engine, [(prompts(2)[1], GREEDY)])[0]]
