"""The server's default path: decode steps through the compiled graphs, checked over HTTP against a
server running every step eagerly."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from server_helpers import start_server, wait_idle
from tokenmill.kernels import use_variant

pytestmark = pytest.mark.slow  # compiles the tiny model's decode graphs (cached on disk after)


@pytest.fixture(autouse=True)
def pytorch_path():
    """The compiled graphs belong to the PyTorch path (the native kernels' path runs eagerly)."""
    with use_variant("torch"):
        yield

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


def test_switching_models_compiles_the_new_one_while_the_old_keeps_streaming(tiny_gguf, store):
    import json
    import time

    from tiny_model import TinyLlamaSpec, write_tiny_llama

    write_tiny_llama(store / "other-tiny.gguf", TinyLlamaSpec(seed=7))
    server, host = start_server(str(tiny_gguf), compile=True)
    try:
        assert host.wait_ready(300), host.error
        old = host.current
        with httpx.Client(base_url=server.url, timeout=300) as c:
            with c.stream("POST", "/api/generate", json={"model": old.name, "prompt": "hello", "raw": True,
                                                         "options": {"temperature": 0, "num_predict": 150}}) as r:
                lines = r.iter_lines()
                assert json.loads(next(lines))["done"] is False
                assert c.post("/load", json={"model": "other-tiny"}).status_code == 202
                final = [json.loads(line) for line in lines][-1]
            assert final["done"] is True and final["eval_count"] == 150
            deadline = time.monotonic() + 300
            while host.current is old and time.monotonic() < deadline:
                time.sleep(0.1)
            assert host.current is not old and host.current.engine.runner.decode_graph is not None
            r = c.post("/api/generate", json={"model": "other-tiny", "prompt": "x", "stream": False, "raw": True,
                                              "options": {"num_predict": 20, "temperature": 0}})
            assert r.status_code == 200 and r.json()["eval_count"] == 20
            assert host.current.engine.runner.graph_steps > 0
    finally:
        server.stop()
