"""The server's default path: decode steps through the compiled graphs, checked over HTTP against a
server running every step eagerly."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from server_helpers import start_server, wait_idle

pytestmark = pytest.mark.slow  # compiles the tiny model's decode graphs (cached on disk after)

PROMPTS = [f"story {i}: " + "once upon a time " * (i % 5) for i in range(12)]


async def _complete_all(url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def one(prompt: str) -> str:
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20 + len(prompt) % 7,
                                                      "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def test_concurrent_completions_through_the_graphs_match_eager(tiny_gguf):
    answers = {}
    for compile in (True, False):
        server, host = start_server(str(tiny_gguf), compile=compile)
        try:
            assert host.wait_ready(300), host.error
            answers[compile] = asyncio.run(_complete_all(server.url))
            wait_idle(host)
            if compile:
                assert host.current.engine.runner.graph_steps > 10
        finally:
            server.stop()
    assert answers[True] == answers[False]
