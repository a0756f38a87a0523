"""What a benchmark asks the server under test besides its load: which model it serves, and its
/metrics (Prometheus text), scraped around a run for the server's own view of it. tokenmill serves
vLLM's metric names; llama.cpp's bundled server has no /metrics, and every figure here is then None."""
from __future__ import annotations

import re

import httpx


async def detect_model(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The served model's name: Ollama's /api/ps (loaded models), else the first of /v1/models."""
    for path, pick in (("/api/ps", lambda j: j["models"][0]["name"]), ("/v1/models", lambda j: j["data"][0]["id"])):
        try:
            r = await client.get(base_url + path, timeout=10)
            if r.status_code == 200:
                return str(pick(r.json()))
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            continue
    return None


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, summing over label sets (no histograms' buckets needed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


async def scrape_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    try:
        r = await client.get(base_url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    return parse_metrics(r.text) if r.status_code == 200 else None


# The server's own latency histograms (vLLM's names; tokenmill serves them, llama.cpp's server does not).
_SERVER_LATENCIES = {"ttft_mean_ms": "vllm:time_to_first_token_seconds", "queue_mean_ms": "vllm:request_queue_time_seconds"}


def server_latencies(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """Mean TTFT and queue time of the requests the server finished between two /metrics scrapes, in ms,
    as the server measures them: from when the engine took a request in. Set beside the client's TTFT,
    the difference is what the HTTP path and the wait for a running step cost. None without them."""
    if before is None or after is None:
        return None
    out: dict[str, float] = {}
    for key, name in _SERVER_LATENCIES.items():
        n = after.get(name + "_count", 0.0) - before.get(name + "_count", 0.0)
        if n <= 0:
            return None
        out[key] = (after[name + "_sum"] - before.get(name + "_sum", 0.0)) / n * 1000
    return out


def server_peak_rss_mib(metrics: dict[str, float] | None) -> float | None:
    """The server's peak resident memory so far, from its /metrics (tokenmill's; None from a server
    that does not say)."""
    value = (metrics or {}).get("tokenmill:peak_resident_memory_bytes")
    return None if value is None else value / 2**20
