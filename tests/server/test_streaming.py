"""Streaming under stress: client disconnects free their KV blocks, errors after the first byte
arrive as a final chunk, and many concurrent streams are batched together."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from server_helpers import model_name, wait_idle

LONG = {"temperature": 0, "num_predict": 200}


def aborted(host) -> int:
    return host.current.engine.stats.finished.get("abort", 0)


def test_disconnect_mid_stream_aborts_and_frees_blocks(client, tiny):
    url, host = tiny
    before = aborted(host)
    with client.stream("POST", "/api/generate", json={"model": model_name(host), "prompt": "hello", "raw": True,
                                                      "options": LONG}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = json.loads(next(lines))
        assert first["done"] is False
        assert host.current.engine.blocks.num_used_blocks > 0
    # Closing the response drops the connection mid-stream.
    wait_idle(host)
    assert aborted(host) == before + 1


def test_disconnect_mid_sse_stream_aborts_every_choice(client, tiny):
    url, host = tiny
    before = aborted(host)
    with client.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 200, "temperature": 0,
                                                        "n": 2, "stream": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    wait_idle(host)
    assert aborted(host) == before + 2


def test_disconnect_while_waiting_for_a_non_streaming_answer(tiny, monkeypatch):
    url, host = tiny
    before = aborted(host)
    # Steps slowed so the answer (at most the context length of tokens) takes far longer than 0.3 s.
    monkeypatch.setattr(host.current.engine, "step_hook", lambda batch: time.sleep(0.01))
    with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=0.3)) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/api/generate", json={"model": model_name(host), "prompt": "hi", "stream": False,
                                      "options": {"temperature": 0, "num_predict": 5000}})  # shifts
    wait_idle(host)
    assert aborted(host) == before + 1


class FailAfter:
    """Wraps the model runner so the n-th step (and every later one) raises."""

    def __init__(self, run, n: int):
        self.run, self.n, self.calls = run, n, 0

    def __call__(self, batch, **kwargs):
        self.calls += 1
        if self.calls >= self.n:
            raise RuntimeError("simulated device failure")
        return self.run(batch, **kwargs)


@pytest.fixture
def failing_engine(tiny, monkeypatch):
    runner = tiny[1].current.engine.runner
    monkeypatch.setattr(runner, "run", FailAfter(runner.run, 4))


def test_error_after_stream_began_is_the_last_ndjson_line(client, tiny, failing_engine):
    r = client.post("/api/chat", json={"model": model_name(tiny[1]), "messages": [{"role": "user", "content": "x"}],
                                       "options": LONG})
    assert r.status_code == 200
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[0]["done"] is False
    assert "simulated device failure" in lines[-1]["error"] and "done" not in lines[-1]


def test_error_after_stream_began_is_the_last_sse_event(client, failing_engine):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 100,
                                                  "temperature": 0, "stream": True})
    assert r.status_code == 200
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "simulated device failure" in err["message"] and err["type"] == "server_error"
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"


def test_error_in_non_streaming_request_is_a_500(client, failing_engine):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "temperature": 0})
    assert r.status_code == 500 and "simulated device failure" in r.json()["error"]["message"]


def _histogram(metrics: str, name: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(rf'^{re.escape(name)}_bucket{{.*le="([^"]+)"}} (\S+)$', metrics, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def test_32_concurrent_streams_complete_and_share_steps(tiny):
    url, host = tiny
    name = model_name(host)
    n = 32

    async def one(c: httpx.AsyncClient, i: int) -> tuple[float, float, dict]:
        first = last = None
        final = None
        async with c.stream("POST", "/api/generate", json={"model": name, "prompt": f"request {i}", "raw": True,
                                                           "options": {"temperature": 0, "num_predict": 12}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                now = time.monotonic()
                first = first or now
                last = now
                final = json.loads(line)
        return first, last, final

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60,
                                     limits=httpx.Limits(max_connections=n + 4)) as c:
            before = (await c.get("/metrics")).text
            results = await asyncio.gather(*(one(c, i) for i in range(n)))
            after = (await c.get("/metrics")).text
        return before, results, after

    before, results, after = asyncio.run(main())
    assert all(final["done"] and final["eval_count"] == 12 for _, _, final in results)
    # Overlap in time: some moment had many streams open at once.
    events = sorted([(f, 1) for f, _, _ in results] + [(l_, -1) for _, l_, _ in results])
    open_now = peak = 0
    for _, delta in events:
        open_now += delta
        peak = max(peak, open_now)
    assert peak >= n // 2
    # And in the engine: steps that ran more than one sequence.
    b, a = _histogram(before, "tokenmill:batch_seqs_per_step"), _histogram(after, "tokenmill:batch_seqs_per_step")
    multi_seq_steps = (a["+Inf"] - a["1"]) - (b["+Inf"] - b["1"])
    assert multi_seq_steps > 0
    big = (a["+Inf"] - a["8"]) - (b["+Inf"] - b["8"])
    assert big > 0, "no step batched more than 8 sequences"
    wait_idle(host)
