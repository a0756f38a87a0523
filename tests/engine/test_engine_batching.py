"""Continuous batching on the tiny model: chunked prefill, preemption, abort, fairness, seeds."""
from __future__ import annotations

import random

import pytest

from engine_helpers import assert_all_free, make_engine, run_one_at_a_time, run_to_completion
from tokenmill.engine import FinishReason, PromptTooLongError, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 270) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_batched_chunked_prefill_equals_one_at_a_time(loaded):
    reqs = [(p, GREEDY) for p in prompts(10)]
    alone = run_one_at_a_time(make_engine(loaded, max_total_tokens=4096), reqs)
    together = run_to_completion(make_engine(loaded, max_total_tokens=4096, n_batch=16, n_ubatch=8), reqs)
    assert together == alone
    assert all(len(o) == 12 for o in together)


def test_preemption_under_memory_pressure_changes_nothing(loaded):
    reqs = [(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for p in prompts(16, seed=1, lo=20, hi=40)]
    unconstrained = run_to_completion(make_engine(loaded, max_total_tokens=8192), reqs)
    # Room for about 4 sequences of ~64 tokens.
    small = make_engine(loaded, max_total_tokens=16 * 16, n_batch=64)
    constrained = run_to_completion(small, reqs)
    assert constrained == unconstrained
    assert small.stats.num_preemptions > 0
    assert small.stats.finished == {"length": 16}


def test_round_robin_serves_everyone_when_budget_is_short(loaded):
    """With a token budget smaller than the number of running sequences, every sequence still
    advances: none waits more than a couple of steps for its next token."""
    engine = make_engine(loaded, max_total_tokens=8192, n_batch=4, parallel=10)
    rids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            for p in prompts(10, seed=2, lo=3, hi=4)]
    last_progress = {r: 0 for r in rids}
    step = 0
    while engine.has_unfinished():
        step += 1
        for ev in engine.step():
            if ev.token_ids:
                last_progress[ev.request_id] = step
        for r in rids:
            if engine.scheduler.find(r) and engine.scheduler.find(r)[0].output_ids:
                assert step - last_progress[r] <= 3, f"{r} starved"
    assert_all_free(engine)


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_abort_frees_blocks_at_once_and_spares_others(loaded, when):
    ps = prompts(4, seed=3, lo=40, hi=50)
    reqs = [(p, GREEDY) for p in ps]
    expected = run_to_completion(make_engine(loaded, max_total_tokens=4096), reqs)

    engine = make_engine(loaded, max_total_tokens=4096, n_batch=16)
    rids = [engine.add_request(p, GREEDY) for p in ps]
    outputs = {r: [] for r in rids}
    victim = rids[1]
    steps = 0
    while engine.has_unfinished():
        for ev in engine.step():
            outputs[ev.request_id] += ev.token_ids
        steps += 1
        seq = engine.scheduler.find(victim)
        if seq and ((when == "prefill" and seq[0].num_computed_tokens > 0 and seq[0].is_prefilling)
                    or (when == "decode" and len(seq[0].output_ids) >= 3)):
            used_before = engine.blocks.num_used_blocks
            own = len(engine.blocks.block_table(seq[0].seq_id))
            events = engine.abort(victim)
            assert events[0].finish_reason is FinishReason.ABORT
            assert engine.blocks.num_used_blocks == used_before - own
            engine.blocks.check_integrity()
    assert_all_free(engine)
    for i, r in enumerate(rids):
        if r != victim:
            assert outputs[r] == expected[i]


def test_seeded_sampling_same_alone_and_in_a_batch_of_8(loaded):
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    p = prompts(1, seed=4)[0]
    alone = run_to_completion(make_engine(loaded, max_total_tokens=4096), [(p, seeded)])[0]
    others = [(q, SamplingParams(max_tokens=10 + i, temperature=1.0, ignore_eos=True)) for i, q in enumerate(prompts(7, seed=5))]
    batch = others[:3] + [(p, seeded)] + others[3:]
    together = run_to_completion(make_engine(loaded, max_total_tokens=4096, n_batch=32), batch)
    assert together[3] == alone


def test_max_tokens_eos_and_context_limit(loaded):
    engine = make_engine(loaded, max_total_tokens=4096, max_model_len=40)
    p = prompts(1, seed=6, lo=30, hi=30)[0]
    rid = engine.add_request(p, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    outs = []
    reasons = []
    while engine.has_unfinished():
        for ev in engine.step():
            outs += ev.token_ids
            reasons.append(ev.finish_reason)
    assert rid and len(outs) == 10 and reasons[-1] is FinishReason.LENGTH  # 30 + 10 = the 40-token context
    with pytest.raises(PromptTooLongError) as err:
        engine.add_request(prompts(1, seed=7, lo=45, hi=45)[0], GREEDY)
    assert err.value.num_prompt_tokens == 45 and err.value.limit == 40
    with pytest.raises(PromptTooLongError, match="holds 40, with no room left to generate"):
        engine.add_request(prompts(1, seed=8, lo=40, hi=40)[0], GREEDY)  # fills the context exactly
    assert_all_free(engine)


def test_stop_token_ends_sequence(loaded):
    """A token listed in stop_token_ids ends the sequence with reason stop, and is the last output."""
    engine = make_engine(loaded, max_total_tokens=4096)
    p = prompts(1, seed=8)[0]
    free_run = run_to_completion(engine, [(p, GREEDY)])[0]
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    rid = engine.add_request(p, params)
    outs, last = [], None
    while engine.has_unfinished():
        for ev in engine.step():
            outs += ev.token_ids
            last = ev
    assert rid and outs == free_run[: first + 1] and last.finish_reason is FinishReason.STOP
