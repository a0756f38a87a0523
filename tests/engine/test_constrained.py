"""Grammar-constrained sequences in the engine, on the tiny random model: whatever the model wants,
the output matches; rows without a constraint are untouched."""
from __future__ import annotations

import json
import re
import threading
import time

import pytest

from engine_helpers import assert_all_free, make_engine, random_ids, step_until_done
from tokenmill.engine import FinishReason, SamplingParams
from tokenmill.structured import GrammarCompiler, GrammarSpec

CHOICES = ["alpha", "beta", "gamma delta"]
REGEX = r"[a-c]{3}-[0-9]{2}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "yy", "zzz"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "tag", "n"], "additionalProperties": False}


def check(kind: str, text: str) -> None:
    if kind == "choice":
        assert text in CHOICES
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        doc = json.loads(text)
        assert set(doc) == {"ok", "tag", "n"} and doc["tag"] in ("x", "yy", "zzz") and 0 <= doc["n"] <= 99


@pytest.fixture(scope="module")
def grammars(loaded):
    compiler = GrammarCompiler(make_engine(loaded).tokenizer)
    return {"choice": compiler.compile_now(GrammarSpec("choice", CHOICES)),
            "regex": compiler.compile_now(GrammarSpec("regex", REGEX)),
            "schema": compiler.compile_now(GrammarSpec("json_schema", SCHEMA))}


def finishes(engine, rid_of):
    """Step to the end; (text, finish reason) per (request id, index)."""
    texts: dict = {}
    reasons: dict = {}
    while engine.has_unfinished():
        for ev in engine.step():
            key = (ev.request_id, ev.index)
            texts[key] = texts.get(key, []) + ev.token_ids
            if ev.finished:
                reasons[key] = ev.finish_reason
        engine.blocks.check_integrity()
    assert_all_free(engine)
    return {k: (engine.tokenizer.decode(v, skip_special_tokens=True), reasons[k]) for k, v in texts.items()}


@pytest.mark.parametrize("kind", ["choice", "regex", "schema"])
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_output_matches_and_ends_with_stop_when_the_grammar_completes(loaded, grammars, kind, temperature):
    engine = make_engine(loaded)
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=3, constraint=grammars[kind])
    rids = [engine.add_request(random_ids(20, seed=i), params, n=3) for i in range(3)]
    results = finishes(engine, rids)
    assert len(results) == 9
    for text, reason in results.values():
        assert reason is FinishReason.STOP
        check(kind, text)


def test_samples_fork_only_after_the_mask_worker_is_done_with_their_parent(loaded, grammars, monkeypatch):
    # The worker reads a matcher while the model runs; forking copies it. Overlapping the two made
    # llguidance raise "Already mutably borrowed" now and then, so a slow mask must hold the fork back.
    from tokenmill.structured.constraint import Constraint
    busy = threading.Event()
    fill, fork = Constraint.fill_mask, Constraint.fork

    def slow_fill(self, row):
        busy.set()
        time.sleep(0.05)
        fill(self, row)
        busy.clear()

    def checked_fork(self):
        assert not busy.is_set(), "forked while the mask worker held the parent's matcher"
        return fork(self)

    monkeypatch.setattr(Constraint, "fill_mask", slow_fill)
    monkeypatch.setattr(Constraint, "fork", checked_fork)
    engine = make_engine(loaded)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=2, constraint=grammars["schema"])
    rids = [engine.add_request(random_ids(20, seed=i), params, n=3) for i in range(2)]
    results = finishes(engine, rids)
    assert len(results) == 6 and all(reason is not FinishReason.ERROR for _, reason in results.values())


def test_unconstrained_rows_are_identical_with_constrained_neighbours(loaded, grammars):
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    prompts = [random_ids(12, seed=40 + i) for i in range(2)]
    alone = make_engine(loaded)
    rids = [alone.add_request(p, q) for p, q in zip(prompts, (greedy, seeded))]
    before = step_until_done(alone)
    mixed = make_engine(loaded)
    rids2 = [mixed.add_request(p, q) for p, q in zip(prompts, (greedy, seeded))]
    for kind in ("choice", "regex", "schema"):
        mixed.add_request(random_ids(12, seed=7), SamplingParams(max_tokens=40, temperature=1.0,
                                                                  constraint=grammars[kind]), n=2)
    after = step_until_done(mixed)
    assert [after[(r, 0)] for r in rids2] == [before[(r, 0)] for r in rids]


def test_seeded_constrained_samples_do_not_depend_on_the_batch(loaded, grammars):
    params = SamplingParams(max_tokens=40, temperature=1.2, seed=5, constraint=grammars["schema"])
    alone = make_engine(loaded)
    rid = alone.add_request(random_ids(15, seed=1), params, n=2)
    expected = step_until_done(alone)
    busy = make_engine(loaded)
    busy.add_request(random_ids(30, seed=2), SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True), n=3)
    rid2 = busy.add_request(random_ids(15, seed=1), params, n=2)
    got = step_until_done(busy)
    assert [got[(rid2, i)] for i in range(2)] == [expected[(rid, i)] for i in range(2)]


def test_preemption_by_recompute_keeps_the_grammar_state(loaded, grammars):
    params = SamplingParams(max_tokens=60, temperature=0, constraint=grammars["schema"])
    prompts = [random_ids(40, seed=20 + i) for i in range(6)]
    roomy = make_engine(loaded)
    rids = [roomy.add_request(p, params) for p in prompts]
    expected = step_until_done(roomy)
    tight = make_engine(loaded, max_total_tokens=16 * 12, n_batch=64)
    rids2 = [tight.add_request(p, params) for p in prompts]
    got = step_until_done(tight)
    assert tight.scheduler.num_preemptions > 0
    assert [got[(r, 0)] for r in rids2] == [expected[(r, 0)] for r in rids]
    for r in rids2:
        check("schema", tight.tokenizer.decode(got[(r, 0)], skip_special_tokens=True))


def test_logprobs_are_over_the_allowed_tokens(loaded, grammars):
    engine = make_engine(loaded)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1, logprobs=True, top_logprobs=5,
                            constraint=grammars["choice"])
    engine.add_request(random_ids(10), params)
    events = [ev for _ in range(20) if engine.has_unfinished() for ev in engine.step()]
    lps = [lp for ev in events for lp in ev.logprobs]
    tops = [t for ev in events for t in ev.top_logprobs]
    assert lps and all(lp > float("-inf") for lp in lps)
    # The first position may only start one of the choices: "a", "b" or "g" (alone or merged).
    first = {engine.tokenizer.decode([t]) for t, lp in tops[0] if lp > float("-inf")}
    assert first and all(any(c.startswith(s) for c in CHOICES) for s in first)


def test_min_tokens_cannot_trap_a_complete_grammar(loaded, grammars):
    # The grammar is done after one word; min_tokens must not keep the row with nothing to sample.
    engine = make_engine(loaded)
    rid = engine.add_request(random_ids(10), SamplingParams(max_tokens=30, min_tokens=20, temperature=1.0,
                                                            constraint=grammars["choice"]))
    results = finishes(engine, [rid])
    text, reason = results[(rid, 0)]
    assert reason is FinishReason.STOP and text in CHOICES


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_stop_token_the_grammar_requires_before_min_tokens_is_sampled_not_refused(loaded, temperature):
    # Below min_tokens the request's stop tokens are suppressed; when the grammar allows nothing else
    # the row must still follow the grammar. It used to be handed an end token the grammar refused,
    # and the request failed ("the grammar rejected token 0").
    engine = make_engine(loaded)
    grammar = GrammarCompiler(engine.tokenizer).compile_now(GrammarSpec("regex", r"x[0-9]{3}"))
    (x,) = engine.tokenizer.encode("x")
    params = SamplingParams(max_tokens=10, min_tokens=2, temperature=temperature, seed=1, stop_token_ids=[x],
                            constraint=grammar)
    rid = engine.add_request(random_ids(10), params, n=2)
    results = finishes(engine, [rid])
    assert len(results) == 2
    for text, reason in results.values():
        assert reason is FinishReason.STOP and re.fullmatch(r"x[0-9]{3}", text), (text, reason)


def test_aborting_a_constrained_request_mid_way_frees_everything(loaded, grammars):
    engine = make_engine(loaded)
    rid = engine.add_request(random_ids(30), SamplingParams(max_tokens=60, temperature=1.0,
                                                            constraint=grammars["schema"]), n=3)
    other = engine.add_request(random_ids(30, seed=9), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    events = engine.abort(rid)
    assert sorted(ev.index for ev in events) == [0, 1, 2] and all(ev.finish_reason is FinishReason.ABORT
                                                                  for ev in events)
    assert not engine.scheduler.find(rid)
    rest = step_until_done(engine)
    assert len(rest[(other, 0)]) >= 5
    assert_all_free(engine)


def test_a_grammar_for_another_vocabulary_is_refused(loaded):
    from types import SimpleNamespace

    from tokenmill.engine import RequestError

    engine = make_engine(loaded)
    foreign = SimpleNamespace(vocab_size=engine.tokenizer.vocab_size + 1)  # e.g. compiled before a model switch
    with pytest.raises(RequestError, match="another model"):
        engine.add_request(random_ids(5), SamplingParams(constraint=foreign))
