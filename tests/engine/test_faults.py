"""Reliability of the engine itself: a failing step fails only its own requests and frees their
blocks, bounded work (token cap, deadline), the watchdog, and a dead loop thread that refuses new
work at once. Faults are injected through LLMEngine.step_hook."""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from engine_helpers import assert_all_free, make_engine, random_ids, step_until_done
from tokenmill.engine import AsyncEngine, EngineDeadError, FinishReason, SamplingParams
from tokenmill.engine.health import FAILURES_UNHEALTHY

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class Boom(RuntimeError):
    pass


def fail_once(engine):
    """A step hook that raises in the next step only."""
    def hook(batch):
        engine.step_hook = None
        raise Boom("injected fault")
    return hook


def finishes(events):
    return {ev.request_id: ev for ev in events if ev.finished}


def test_failed_step_fails_only_its_requests_and_frees_their_blocks(loaded):
    engine = make_engine(loaded)
    first = engine.add_request(random_ids(20, 1), PARAMS)
    engine.step()  # first is running now
    engine.step_hook = fail_once(engine)
    events = engine.step()
    ended = finishes(events)
    assert ended[first].finish_reason is FinishReason.ERROR and "injected fault" in ended[first].error
    assert_all_free(engine)
    assert engine.faults.num_failed == 1 and not engine.faults.unhealthy
    # The engine goes on serving: a new request runs to its end.
    later = engine.add_request(random_ids(12, 2), PARAMS)
    out = step_until_done(engine)
    assert len(out[(later, 0)]) == PARAMS.max_tokens
    assert engine.faults.num_consecutive == 0


def test_failure_with_parallel_samples_frees_the_forks(loaded):
    engine = make_engine(loaded)
    engine.add_request(random_ids(20, 3), SamplingParams(max_tokens=8, temperature=1.0, seed=1), n=3)
    engine.step()  # prompt computed, samples forked
    assert engine.num_running() == 3
    engine.step_hook = fail_once(engine)
    events = engine.step()
    assert sorted(ev.index for ev in events if ev.finish_reason is FinishReason.ERROR) == [0, 1, 2]
    assert_all_free(engine)


def test_repeated_failures_make_the_engine_unhealthy_until_a_step_succeeds(loaded):
    engine = make_engine(loaded)

    def always(batch):
        raise Boom("kernel on fire")

    engine.step_hook = always
    for i in range(FAILURES_UNHEALTHY):
        engine.add_request(random_ids(8, i), PARAMS)
        engine.step()
    assert engine.faults.unhealthy and "kernel on fire" in engine.faults.last_error
    assert_all_free(engine)
    engine.step_hook = None
    engine.add_request(random_ids(8, 9), PARAMS)
    engine.step()
    assert not engine.faults.unhealthy
    step_until_done(engine)


def test_server_wide_token_cap_bounds_requests_without_max_tokens(loaded):
    engine = make_engine(loaded, max_new_tokens=6)
    unbounded = engine.add_request(random_ids(10, 4), SamplingParams(temperature=0, ignore_eos=True), shift=True)
    asks_more = engine.add_request(random_ids(10, 5), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    asks_less = engine.add_request(random_ids(10, 6), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    ended = {}
    outputs = {}
    while engine.has_unfinished():
        for ev in engine.step():
            outputs.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finished:
                ended[ev.request_id] = ev.finish_reason
    assert {r: len(outputs[r]) for r in outputs} == {unbounded: 6, asks_more: 6, asks_less: 3}
    assert set(ended.values()) == {FinishReason.LENGTH}
    assert_all_free(engine)


def test_default_cap_is_the_model_context_and_context_shift_works_within_it(loaded):
    ctx = loaded.config.context_length
    engine = make_engine(loaded, max_model_len=64)
    assert engine.max_new_tokens == ctx
    rid = engine.add_request(random_ids(40, 7), SamplingParams(temperature=0, ignore_eos=True), shift=True)
    out = step_until_done(engine)
    # Shifted past the 64-token context several times, then stopped by the cap.
    assert len(out[(rid, 0)]) == ctx


def test_deadline_finishes_running_and_waiting_requests(loaded, caplog):
    engine = make_engine(loaded, request_timeout=0.2, parallel=1)
    running = engine.add_request(random_ids(10, 8), SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True))
    waiting = engine.add_request(random_ids(10, 9), PARAMS)  # parallel=1: never admitted in time
    engine.step_hook = lambda batch: time.sleep(0.05)
    ended = {}
    deadline = time.monotonic() + 10
    with caplog.at_level(logging.INFO, "tokenmill.engine"):
        while engine.has_unfinished() and time.monotonic() < deadline:
            ended.update(finishes(engine.step()))
    assert ended[running].finish_reason is FinishReason.TIMEOUT and ended[running].num_output_tokens > 0
    assert ended[waiting].finish_reason is FinishReason.TIMEOUT and ended[waiting].num_output_tokens == 0
    assert "deadline" in caplog.text
    assert engine.stats_snapshot().finished == {"timeout": 2}
    assert_all_free(engine)


def test_watchdog_logs_a_slow_step_with_its_batch_shape(loaded, caplog):
    engine = make_engine(loaded, watchdog_seconds=0.2)
    aengine = AsyncEngine(engine).start()
    release = threading.Event()

    def stuck(batch):
        engine.step_hook = None
        release.wait(5)

    engine.step_hook = stuck

    async def main():
        async for _ in aengine.generate(random_ids(30, 10), PARAMS):
            pass

    try:
        with caplog.at_level(logging.WARNING, "tokenmill.engine"):
            worker = threading.Thread(target=asyncio.run, args=(main(),))
            worker.start()
            deadline = time.monotonic() + 5
            while aengine.watchdog.num_slow_steps == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            # While the step hangs, the published snapshot and the health answer without waiting.
            assert aengine.health().ok and aengine.snapshot is not None
            release.set()
            worker.join(10)
        assert aengine.watchdog.num_slow_steps == 1
        assert "watchdog" in caplog.text and "1 sequences, 30 tokens (0 decodes, 30 prefill tokens)" in caplog.text
    finally:
        release.set()
        aengine.shutdown()


class EngineKiller(BaseException):
    """Escapes every `except Exception`: what kills the loop thread."""


def test_a_dead_engine_thread_fails_streams_and_refuses_new_work(loaded):
    engine = make_engine(loaded)
    aengine = AsyncEngine(engine).start()

    def kill(batch):
        raise EngineKiller("simulated crash")

    async def main():
        engine.step_hook = kill
        events = [ev async for ev in aengine.generate(random_ids(10, 11), PARAMS, n=2)]
        assert {ev.index for ev in events if ev.finished} == {0, 1}
        assert all(ev.finish_reason is FinishReason.ERROR and "simulated crash" in ev.error
                   for ev in events if ev.finished)
        with pytest.raises(EngineDeadError):
            async for _ in aengine.generate(random_ids(10, 12), PARAMS):
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 10))
        health = aengine.health()
        assert health.status == "dead" and "simulated crash" in health.reason
        with pytest.raises(EngineDeadError):
            aengine.call(lambda e: 1).result(5)
    finally:
        aengine.shutdown()
