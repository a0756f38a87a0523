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
