"""Parallel samples (n > 1): the prompt is computed once and its blocks shared; each sample then
copies a shared block before writing into it (copy-on-write)."""
from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import assert_all_free, make_engine, run_to_completion, step_until_done
from tokenmill.engine import LLM, AsyncEngine, EngineConfig, FinishReason, Priority, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 270) for _ in range(n)]


def test_samples_share_the_prompt_blocks_then_copy_on_write(loaded):
    engine = make_engine(loaded, max_total_tokens=1024)
    p = prompt(37)  # 3 blocks of 16, the last one partial: shared until each sample writes into it
    rid = engine.add_request(p, SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True), n=4)
    events = engine.step()  # the whole prompt in one step, then the fork
    assert sorted(ev.index for ev in events) == [0, 1, 2, 3] and all(len(ev.token_ids) == 1 for ev in events)
    seqs = engine.scheduler.find(rid)
    assert len(seqs) == 4
    tables = {tuple(engine.blocks.block_table(s.seq_id)) for s in seqs}
    assert len(tables) == 1 and engine.blocks.num_used_blocks == 3
    assert engine.stats.num_prompt_tokens == 37  # computed once, not four times
    engine.blocks.check_integrity()
    engine.step()  # each sample writes position 37: the shared partial block is copied (n-1 times)
    assert 3 < engine.blocks.num_used_blocks <= 3 + 4
    tables = [engine.blocks.block_table(s.seq_id) for s in seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)  # full prompt blocks stay shared
    assert len({t[2] for t in tables}) == 4  # the partial one is private to each now
    outputs = step_until_done(engine)
    assert sorted(outputs) == [(rid, i) for i in range(4)]


def test_greedy_samples_equal_single_request(loaded):
    p = prompt(21, seed=1)
    alone = run_to_completion(make_engine(loaded, max_total_tokens=1024), [(p, GREEDY)])[0]
    engine = make_engine(loaded, max_total_tokens=1024)
    rid = engine.add_request(p, GREEDY, n=3)
    outputs = step_until_done(engine)
    assert [outputs[rid, i] for i in range(3)] == [alone] * 3


def test_seeded_samples_differ_and_each_equals_a_single_request_with_seed_plus_index(loaded):
    p = prompt(40, seed=2)
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=100, ignore_eos=True)
    engine = make_engine(loaded, max_total_tokens=2048)
    rid = engine.add_request(p, params, n=4)
    outputs = step_until_done(engine)
    samples = [outputs[rid, i] for i in range(4)]
    assert len({tuple(s) for s in samples}) > 1
    singles = run_to_completion(make_engine(loaded, max_total_tokens=2048),
                                [(p, SamplingParams(max_tokens=12, temperature=1.5, seed=100 + i, ignore_eos=True))
                                 for i in range(4)])
    assert samples == singles


def test_abort_ends_every_sample_before_and_after_the_fork(loaded):
    for steps_before_abort in (0, 2):
        engine = make_engine(loaded, max_total_tokens=1024)
        rid = engine.add_request(prompt(30, seed=3), GREEDY, n=3)
        for _ in range(steps_before_abort):
            engine.step()
        events = engine.abort(rid)
        assert sorted(ev.index for ev in events) == [0, 1, 2]
        assert all(ev.finish_reason is FinishReason.ABORT for ev in events)
        assert not engine.has_unfinished()
        assert_all_free(engine)


def test_abort_of_one_sample_spares_its_siblings(loaded):
    engine = make_engine(loaded, max_total_tokens=1024)
    rid = engine.add_request(prompt(30, seed=4), GREEDY, n=3)
    first = {ev.index: ev.token_ids for ev in engine.step()}
    assert [ev.index for ev in engine.abort(rid, index=1)] == [1]
    outputs = step_until_done(engine)
    assert (rid, 1) not in outputs
    assert len(first[0] + outputs[rid, 0]) == len(first[2] + outputs[rid, 2]) == 10


@pytest.mark.parametrize("aborted", [[1], [0], [0, 1], [2, 0], [3, 1, 2], [0, 1, 2, 3]])
def test_abort_of_samples_not_yet_forked_spares_the_others(loaded, aborted):
    """Samples aborted while the prompt is still being computed end at once (no tokens); the rest,
    the first sample included when only siblings go, come out as if the others had never been asked
    for: seeded sample i still draws from seed + i."""
    p = prompt(60, seed=5)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
    engine = make_engine(loaded, max_total_tokens=1024, n_batch=16)  # the prompt takes 4 steps
    rid = engine.add_request(p, params, n=4)
    engine.step()
    for i in aborted:
        (ev,) = engine.abort(rid, i)
        assert (ev.index, ev.token_ids, ev.finish_reason) == (i, [], FinishReason.ABORT)
        assert engine.abort(rid, i) == []  # once ended, a sample is not ended again
    ends: dict[int, FinishReason] = {}
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for ev in engine.step():
            assert ev.index not in aborted
            outputs.setdefault(ev.index, []).extend(ev.token_ids)
            if ev.finish_reason is not None:
                ends[ev.index] = ev.finish_reason
        engine.blocks.check_integrity()
    assert_all_free(engine)
    kept = [i for i in range(4) if i not in aborted]
    assert ends == {i: FinishReason.LENGTH for i in kept}
    singles = run_to_completion(make_engine(loaded, max_total_tokens=1024),
                                [(p, SamplingParams(max_tokens=5, temperature=1.0, seed=1 + i, ignore_eos=True))
                                 for i in kept])
    assert [outputs[i] for i in kept] == singles


def test_samples_under_memory_pressure_are_preempted_and_still_right(loaded):
    p = prompt(20, seed=5)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = run_to_completion(make_engine(loaded, max_total_tokens=1024), [(p, params)])[0]
    engine = make_engine(loaded, max_total_tokens=10 * 16, n_batch=32)  # 4 samples x 4 blocks do not fit
    rid = engine.add_request(p, params, n=4)
    outputs = step_until_done(engine)
    assert engine.stats.num_preemptions > 0
    assert [outputs[rid, i] for i in range(4)] == [alone] * 4


def test_llm_generate_returns_n_outputs_per_prompt(loaded, tiny_gguf):
    llm = LLM(str(tiny_gguf), EngineConfig(dtype="fp32", max_total_tokens=1024))
    outs = llm.generate([prompt(10, seed=6), prompt(12, seed=7)], GREEDY, n=2)
    assert [o.index for o in outs] == [0, 1, 0, 1]
    assert outs[0].token_ids == outs[1].token_ids and outs[0].prompt_token_ids == prompt(10, seed=6)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in outs)
    assert_all_free(llm.engine)


def test_async_engine_streams_n_samples(loaded):
    p = prompt(25, seed=8)
    alone = run_to_completion(make_engine(loaded, max_total_tokens=1024), [(p, GREEDY)])[0]
    engine = make_engine(loaded, max_total_tokens=1024)
    aengine = AsyncEngine(engine).start()

    async def collect():
        out: dict[int, list[int]] = {}
        async for ev in aengine.generate(p, GREEDY, n=3):
            out.setdefault(ev.index, []).extend(ev.token_ids)
        return out

    try:
        assert asyncio.run(collect()) == {0: alone, 1: alone, 2: alone}
        assert aengine.call(lambda e: (e.has_unfinished(), e.blocks.num_used_blocks)).result(5) == (False, 0)
    finally:
        aengine.shutdown()


action = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(3, 270), min_size=1, max_size=40), st.integers(1, 12),
              st.sampled_from([0.0, 1.0]), st.integers(1, 4), st.sampled_from(list(Priority)), st.booleans()),
    st.tuples(st.just("abort"), st.integers(0, 20), st.sampled_from([None, 0, 1, 2])),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(action, min_size=1, max_size=15), num_blocks=st.integers(4, 12),
       n_batch=st.sampled_from([4, 16, 64]), policy=st.sampled_from(["fifo", "priority", "sjf"]))
def test_random_samples_shifts_and_priorities_keep_the_cache_consistent(loaded, actions, num_blocks, n_batch, policy):
    engine = make_engine(loaded, max_total_tokens=num_blocks * 16, n_batch=n_batch, parallel=6, policy=policy)
    rids: list[str] = []
    endings: dict[str, int] = {}
    expected: dict[str, int] = {}
    for act in actions:
        if act[0] == "add":
            _, ids, max_tokens, temp, n, prio, shift = act
            try:
                rid = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=temp, seed=1), n=n,
                                         priority=prio, num_ctx=24 if shift else None, shift=shift, truncate=True)
            except ValueError:
                continue
            rids.append(rid)
            expected[rid] = n
        elif act[0] == "abort" and rids:
            for ev in engine.abort(rids[act[1] % len(rids)], act[2]):
                endings[ev.request_id] = endings.get(ev.request_id, 0) + 1
        else:
            for _ in range(act[1]):
                for ev in engine.step():
                    endings[ev.request_id] = endings.get(ev.request_id, 0) + ev.finished
        engine.blocks.check_integrity()
    while engine.has_unfinished():
        for ev in engine.step():
            endings[ev.request_id] = endings.get(ev.request_id, 0) + ev.finished
        engine.blocks.check_integrity()
    assert_all_free(engine)
    assert endings == expected  # every sample of every request ended exactly once
