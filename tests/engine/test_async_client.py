"""The async API: background loop thread, concurrent streams, abort by leaving the stream."""
from __future__ import annotations

import asyncio

import pytest

from engine_helpers import assert_all_free, make_engine, run_to_completion
from tokenmill.engine import AsyncEngine, InvalidSamplingParams, SamplingParams

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def test_concurrent_streams_match_offline_and_abort_frees(loaded):
    prompts = [[5 + i, 40, 41, 42 + i, 7] for i in range(6)]
    expected = run_to_completion(make_engine(loaded), [(p, PARAMS) for p in prompts])
    engine = make_engine(loaded)
    aengine = AsyncEngine(engine).start()

    async def collect(p):
        out = []
        async for ev in aengine.generate(p, PARAMS):
            out += ev.token_ids
        return out

    async def leave_early(p):
        async for ev in aengine.generate(p, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)):
            if ev.token_ids:
                break  # a client going away mid-stream

    async def main():
        results = await asyncio.gather(*(collect(p) for p in prompts), leave_early(prompts[0]))
        with pytest.raises(InvalidSamplingParams):
            async for _ in aengine.generate(prompts[0], SamplingParams(temperature=-1)):
                pass
        return results[:-1]

    try:
        assert asyncio.run(main()) == expected
        # The abandoned request is aborted on the loop thread; its blocks come back.
        assert aengine.call(lambda e: (e.has_unfinished(), e.blocks.num_used_blocks)).result(5) == (False, 0)
        assert_all_free(engine)
    finally:
        aengine.shutdown()


def test_a_shut_down_engine_refuses_requests_instead_of_keeping_them(loaded):
    """After shutdown() the loop is gone: a request (one that leased a model just before it was unloaded)
    gets EngineDeadError at once, and one that got in while the loop stopped ends with an error; neither
    waits forever. Calls fail too."""
    from tokenmill.engine import EngineDeadError

    aengine = AsyncEngine(make_engine(loaded)).start()
    aengine.shutdown()

    async def one_request():
        async for _ in aengine.generate([5, 40, 41], PARAMS):
            pass

    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(asyncio.wait_for(one_request(), 5))
    with pytest.raises(EngineDeadError, match="shut down"):
        aengine.call(lambda e: e.has_unfinished()).result(5)


def test_requests_racing_a_shutdown_all_end(loaded):
    from tokenmill.engine import EngineDeadError

    for _ in range(5):
        aengine = AsyncEngine(make_engine(loaded)).start()
        outcomes: list[str] = []

        async def one_request():
            try:
                async for ev in aengine.generate([5, 40, 41], SamplingParams(max_tokens=50, temperature=0,
                                                                              ignore_eos=True)):
                    if ev.finished:
                        outcomes.append(ev.finish_reason.value)
            except EngineDeadError:
                outcomes.append("refused")

        async def main():
            tasks = [asyncio.create_task(one_request()) for _ in range(8)]
            await asyncio.sleep(0.01)
            await asyncio.to_thread(aengine.shutdown)
            tasks += [asyncio.create_task(one_request()) for _ in range(4)]
            await asyncio.wait_for(asyncio.gather(*tasks), 10)  # a stream left waiting fails here

        asyncio.run(main())
        assert len(outcomes) == 12
