"""Soak (outside CI: runs only when TOKENMILL_SOAK_SECONDS is set, e.g. 600): mixed generate / chat /
OpenAI / embed / abort traffic from 8 clients against a tiny-model server for that long. No request fails, RSS and open file
descriptors stay flat, throughput stays steady, and every KV block comes back. The curves are drawn
to TOKENMILL_SOAK_PNG (default: the test's tmp dir) for the record."""
from __future__ import annotations

import asyncio
import os
import random
import resource
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import model_name, start_server, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.skipif("TOKENMILL_SOAK_SECONDS" not in os.environ,
                                                  reason="set TOKENMILL_SOAK_SECONDS (e.g. 600) to soak")]

SECONDS = float(os.environ.get("TOKENMILL_SOAK_SECONDS", "600"))
CLIENTS = 8
SAMPLE_EVERY = 5.0


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def client_loop(c: httpx.AsyncClient, name: str, rng: random.Random, stop: float, counts: dict) -> None:
    chat = [{"role": "user", "content": "hello"}]
    while time.monotonic() < stop:
        kind = rng.choice(["generate", "chat", "openai", "responses", "anthropic", "embed", "abort"])
        opts = {"temperature": 0.7, "num_predict": rng.randrange(4, 24)}
        if kind == "generate":
            r = await c.post("/api/generate", json={"model": name, "prompt": f"soak {rng.random()}", "raw": True,
                                                    "stream": False, "options": opts})
        elif kind == "chat":
            r = await c.post("/api/chat", json={"model": name, "messages": chat, "stream": False, "options": opts})
        elif kind == "openai":
            r = await c.post("/v1/chat/completions", json={"messages": chat, "max_tokens": opts["num_predict"]})
        elif kind == "responses":
            r = await c.post("/v1/responses", json={"input": "hello", "max_output_tokens": opts["num_predict"]})
        elif kind == "anthropic":  # streamed: the events read to the end
            async with c.stream("POST", "/v1/messages", json={"max_tokens": opts["num_predict"], "messages": chat,
                                                              "stream": True}) as r:
                assert r.status_code == 200, (kind, await r.aread())
                assert [line async for line in r.aiter_lines()][-2:] == ["data: {\"type\": \"message_stop\"}", ""]
        elif kind == "embed":
            r = await c.post("/api/embed", json={"model": name, "input": [f"text {rng.random()}"] * 2})
        else:
            try:
                async with c.stream("POST", "/api/generate", json={"model": name, "prompt": "abort me",
                                                                   "options": {"num_predict": 200}}) as s:
                    async for _ in s.aiter_lines():
                        break
            finally:
                counts["abort"] = counts.get("abort", 0) + 1
            continue
        assert r.status_code == 200, (kind, r.text)
        counts[kind] = counts.get(kind, 0) + 1


def test_soak(tiny_gguf, tmp_path):
    server, host = start_server(str(tiny_gguf))
    assert host.wait_ready(60), host.error
    name = model_name(host)
    samples: list[tuple[float, float, int, int]] = []  # (t, rss MB, fds, requests done)
    counts: dict[str, int] = {}

    async def sampler(start: float, stop: float) -> None:
        while time.monotonic() < stop:
            samples.append((time.monotonic() - start, rss_mb(), open_fds(), sum(counts.values())))
            await asyncio.sleep(SAMPLE_EVERY)

    async def main() -> None:
        start = time.monotonic()
        stop = start + SECONDS
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            rngs = [random.Random(i) for i in range(CLIENTS)]
            await asyncio.gather(sampler(start, stop), *(client_loop(c, name, r, stop, counts) for r in rngs))

    try:
        asyncio.run(main())
        wait_idle(host, timeout=30)
        for served in host.loaded_models():
            served.aengine.call(lambda e: e.blocks.check_integrity()).result(10)
    finally:
        server.stop()
    _plot(samples, Path(os.environ.get("TOKENMILL_SOAK_PNG", tmp_path / "soak.png")))
    assert len(samples) >= 4 and sum(counts.values()) > 0
    # Flat: the last quarter is within a margin of the first quarter (after warm-up).
    q = max(1, len(samples) // 4)
    first, last = samples[q:2 * q], samples[-q:]
    assert max(s[1] for s in last) < max(s[1] for s in first) * 1.10 + 20, "RSS grows"
    assert max(s[2] for s in last) <= max(s[2] for s in first) + 8, "file descriptors leak"
    # Steady throughput: requests per second in the last quarter at least half that of the second.
    def rate(window):
        return (window[-1][3] - window[0][3]) / max(window[-1][0] - window[0][0], 1e-9)
    if q >= 2:
        assert rate(last) >= 0.5 * rate(first), "throughput fell"


def _plot(samples, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    t = [s[0] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    for ax, values, label in zip(axes, ([s[1] for s in samples], [s[2] for s in samples], [s[3] for s in samples]),
                                 ("RSS (MB)", "open fds", "requests done")):
        ax.plot(t, values)
        ax.set_ylabel(label)
    axes[-1].set_xlabel("seconds")
    fig.suptitle("tokenmill soak: tiny model, mixed traffic")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
