"""Scheduling policies: priority (with preemption of lower-priority work), shortest job first with
ageing, and holding a step back to let a batch fill (max_wait_ms)."""
from __future__ import annotations

import pytest

from engine_helpers import random_ids as ids, make_engine, run_to_completion
from tokenmill.engine import ConfigError, EngineConfig, Priority, SamplingParams
from tokenmill.engine.policy import WaitingQueue, expected_work
from tokenmill.engine.request import Sequence


def seq(seq_id: int, n_prompt: int, max_tokens: int, arrival: float, priority=Priority.NORMAL) -> Sequence:
    s = Sequence(seq_id, f"r{seq_id}", [5] * n_prompt, SamplingParams(max_tokens=max_tokens), 1000, priority)
    s.times.arrival = arrival
    return s


def test_queue_orders():
    long_old = seq(0, 100, 100, arrival=0.0, priority=Priority.LOW)
    short_new = seq(1, 5, 5, arrival=1.0, priority=Priority.HIGH)
    normal = seq(2, 50, 10, arrival=0.5)
    for policy, expected in [("fifo", [0, 2, 1]), ("priority", [1, 2, 0]), ("sjf", [1, 2, 0])]:
        q = WaitingQueue(policy, aging_ms=20.0)
        for s in (long_old, short_new, normal):
            q.add(s)
        assert [s.seq_id for s in q.ordered(1.0)] == expected, policy
    # Ageing: all waiting jobs gain credit at the same rate, so the long one overtakes jobs that
    # arrive long after it: at 20 ms/token, 5 s of waiting are worth 250 tokens.
    q = WaitingQueue("sjf", aging_ms=20.0)
    q.add(long_old)
    q.add(seq(3, 5, 5, arrival=5.0))
    assert [s.seq_id for s in q.ordered(5.0)] == [0, 3]
    assert expected_work(long_old) == 200 and expected_work(seq(4, 990, None, 0.0)) == 1000


def test_config_checks_policy_and_caps_context():
    with pytest.raises(ConfigError):
        EngineConfig(policy="lifo").validate()
    assert EngineConfig(max_model_len=100, max_sequence_length=80).context_limit(2048) == 80
    assert EngineConfig().context_limit(2048) == 2048


def run_recording_finish_order(engine, requests) -> tuple[list[str], dict[str, list[int]], dict[str, Sequence]]:
    """requests: (step to submit at, prompt, params, priority). Returns finish order, outputs, sequences."""
    order, outputs, seqs = [], {}, {}
    step = 0
    pending = sorted(requests, key=lambda r: r[0])
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, p, params, prio = pending.pop(0)
            rid = engine.add_request(p, params, priority=prio)
            [seqs[rid]] = engine.scheduler.find(rid)
            outputs[rid] = []
        for ev in engine.step():
            outputs[ev.request_id] += ev.token_ids
            if ev.finished:
                order.append(ev.request_id)
        engine.blocks.check_integrity()
        step += 1
    assert engine.blocks.num_used_blocks == 0
    return order, outputs, seqs


def test_high_priority_request_preempts_low_ones_and_finishes_first(loaded):
    low = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    high = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    # 9 blocks of 16: from step 12 on the three low requests (20-token prompts) hold 3 blocks each,
    # all of them, when the high one arrives.
    reqs = [(0, ids(20, seed=i), low, Priority.LOW) for i in range(3)] + [(14, ids(20, seed=9), high, Priority.HIGH)]
    expected = run_to_completion(make_engine(loaded, max_total_tokens=4096), [(p, s) for _, p, s, _ in reqs])
    for policy in ("priority", "fifo"):
        engine = make_engine(loaded, max_total_tokens=9 * 16, policy=policy)
        order, outputs, seqs = run_recording_finish_order(engine, reqs)
        high_rid = [r for r, s in seqs.items() if s.priority is Priority.HIGH][0]
        assert list(outputs.values()) == expected
        assert seqs[high_rid].num_preemptions == 0
        assert any(s.num_preemptions > 0 for s in seqs.values() if s.priority is Priority.LOW)
        # fifo: the high request waits behind the preempted low one that arrived before it.
        assert (order[0] == high_rid) == (policy == "priority"), (policy, order)


def test_sjf_admits_short_jobs_first_and_fifo_does_not(loaded):
    params_long = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    params_short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    reqs = [(0, ids(40, seed=1), params_long, Priority.NORMAL)] + \
           [(0, ids(4, seed=2 + i), params_short, Priority.NORMAL) for i in range(2)]
    for policy in ("sjf", "fifo"):
        order, _, seqs = run_recording_finish_order(make_engine(loaded, max_total_tokens=1024, parallel=1,
                                                                policy=policy), reqs)
        long_rid = next(r for r, s in seqs.items() if len(s.prompt_ids) == 40)
        assert (order[-1] == long_rid) == (policy == "sjf"), policy


@pytest.mark.parametrize("aging_ms, admitted", [(10.0, True), (1e9, False)])
def test_ageing_lets_a_long_job_in_while_short_ones_keep_coming(loaded, aging_ms, admitted):
    engine = make_engine(loaded, max_total_tokens=1024, parallel=1, policy="sjf", aging_ms=aging_ms)
    clock = [0.0]
    engine.scheduler.clock = lambda: clock[0]

    def add(n_prompt: int, max_tokens: int, seed: int) -> Sequence:
        rid = engine.add_request(ids(n_prompt, seed), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                     ignore_eos=True))
        [s] = engine.scheduler.find(rid)
        s.times.arrival = clock[0]
        return s

    add(3, 1, seed=0)
    long_job = add(30, 2, seed=1)  # expected work 32 tokens; each short one is 4
    for step in range(12):
        add(3, 1, seed=10 + step)  # a new short job every step: without ageing there is always one
        engine.step()
        clock[0] += 0.05  # 50 ms a step: at 10 ms/token the long job gains 5 tokens of credit each
    assert (long_job.times.first_scheduled is not None) == admitted
    for s in engine.scheduler.find(long_job.request_id):
        engine.abort(s.request_id)


def test_max_wait_ms_holds_an_idle_engine_until_the_batch_fills_or_time_is_up(loaded):
    engine = make_engine(loaded, max_total_tokens=1024, parallel=2, max_wait_ms=50)
    assert engine.ready_to_step()  # nothing waits
    engine.add_request(ids(5), SamplingParams(max_tokens=2, temperature=0))
    [s] = engine.scheduler.waiting
    t0 = s.times.arrival
    assert not engine.ready_to_step(t0 + 0.01) and engine.step_delay(t0 + 0.01) == pytest.approx(0.04)
    assert engine.ready_to_step(t0 + 0.06)
    engine.add_request(ids(5, seed=1), SamplingParams(max_tokens=2, temperature=0))
    assert engine.ready_to_step(t0)  # a full batch waits: go
    engine.step()
    engine.add_request(ids(5, seed=2), SamplingParams(max_tokens=2, temperature=0))
    assert engine.ready_to_step(t0)  # running work never waits
    assert make_engine(loaded, max_total_tokens=1024).ready_to_step(0.0)  # default: off


def test_async_engine_waits_at_most_max_wait_ms(loaded):
    import asyncio

    from tokenmill.engine import AsyncEngine

    engine = make_engine(loaded, max_total_tokens=1024, parallel=4, max_wait_ms=200)
    aengine = AsyncEngine(engine).start()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def one(p):
        return [t async for ev in aengine.generate(p, params) for t in ev.token_ids]

    async def main():
        return await asyncio.gather(one(ids(6, seed=1)), one(ids(7, seed=2)))

    try:
        assert [len(o) for o in asyncio.run(main())] == [3, 3]
        assert engine.stats.num_steps == 3  # both prompts started in one batch
    finally:
        aengine.shutdown()
