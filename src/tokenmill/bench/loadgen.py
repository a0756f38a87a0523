"""An HTTP load generator for LLM servers: streams requests over the OpenAI API (`/v1/completions`,
`/v1/chat/completions`, SSE), Ollama's (`/api/generate`, `/api/chat`, NDJSON) or Anthropic's
(`/v1/messages`, typed SSE events; api_streams.py reads each) and times each one,
so tokenmill and its peers (llama.cpp, Ollama, vLLM) are measured the same way.

Loopback only: a benchmark must never send load to another machine. Every run is bounded by a number
of requests and a time limit, and stops by itself.

Per request
  ttft      seconds from sending the request to the first chunk carrying text (if no text comes
            at all, to the first chunk standing for a token).
  itl       gaps between consecutive chunks carrying text (one token per chunk on token-streaming
            servers); tpot = (e2e - ttft) / (output tokens - 1), the per-token average.
  e2e       seconds from sending to the end of the stream.
  tokens    output tokens: the server's count (OpenAI usage.completion_tokens, Ollama eval_count)
            when it sends one, else one per chunk with text. Prompt tokens likewise (usage.prompt_tokens,
            prompt_eval_count), else the local estimate.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx

from tokenmill.bench.api_streams import ApiOptions, RequestResult, error_text, take_line
from tokenmill.bench.common import CORPUS, percentiles


class BenchError(Exception):
    """A problem with the benchmark's own arguments or setup; the message is for the user."""


# --- loopback guard ------------------------------------------------------------------------------
def check_loopback(url: str) -> str:
    """The URL without a trailing slash, if its host is a loopback address; else BenchError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"--url must look like http://127.0.0.1:PORT, got {url!r}")
    host = parts.hostname
    ok = host == "localhost"
    if not ok:
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False
    if not ok:
        raise BenchError(f"refusing to send load to {host!r}: only loopback servers (127.0.0.0/8, ::1, localhost) "
                         "may be benchmarked")
    return url.rstrip("/")


def new_client(concurrency: int, timeout: float) -> httpx.AsyncClient:
    # trust_env=False: an HTTP(S)_PROXY in the environment must not route loopback traffic elsewhere.
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits, trust_env=False)


# --- distributions and prompts -------------------------------------------------------------------
def parse_length(spec: str | int) -> Callable[[random.Random], int]:
    """'100' (fixed) or 'uniform:50:150' (inclusive) -> a sampler of positive ints."""
    s = str(spec).strip()
    m = re.fullmatch(r"uniform:(\d+):(\d+)", s)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if not 1 <= lo <= hi:
            raise BenchError(f"bad length distribution {s!r}: need 1 <= low <= high")
        return lambda rng: rng.randint(lo, hi)
    if s.isdigit() and int(s) >= 1:
        n = int(s)
        return lambda rng: n
    raise BenchError(f"bad length {s!r}: use a positive integer or uniform:LOW:HIGH")


class TextMaker:
    """Prompt texts of about N tokens from the fixed corpus. With a local tokenizer (the served
    model's GGUF) lengths are exact up to re-tokenization at the edges; without one, ~0.75 words per
    token is assumed."""

    WORDS_PER_TOKEN = 0.75

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.words = CORPUS.split()
        self.ids = tokenizer.encode(CORPUS, add_special_tokens=False) if tokenizer is not None else None

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        return max(1, round(len(text.split()) / self.WORDS_PER_TOKEN))

    def text(self, num_tokens: int, offset: int, head: str = "") -> str:
        """`head` followed by corpus text from `offset`, about `num_tokens` tokens in all."""
        budget = max(1, num_tokens - (self.count(head) if head else 0))
        if self.ids is not None:
            src = self.ids
            off = offset % len(src)
            window = (src[off:] + src * (budget // len(src) + 1))[:budget]
            body = self.tokenizer.decode(window, skip_special_tokens=True)
        else:
            n = max(1, round(budget * self.WORDS_PER_TOKEN))
            off = offset % len(self.words)
            body = " ".join((self.words[off:] + self.words * (n // len(self.words) + 1))[:n])
        return head + body


def load_tokenizer(name: str | None):
    """tokenmill's tokenizer of a local model (name or .gguf path), or None when it is not available."""
    if not name:
        return None
    try:
        from tokenmill.store import resolve_model
        from tokenmill.tokenizer import Tokenizer

        return Tokenizer.from_file(resolve_model(name))
    except Exception:  # noqa: BLE001 - no local copy: fall back to estimated lengths
        return None


@dataclass
class RequestSpec:
    prompt: str
    max_tokens: int
    prompt_tokens_est: int


def make_requests(n: int, prompt_len: str, max_tokens: str, maker: TextMaker, *, seed: int = 0,
                  prompt_file: str | None = None, tag: str | None = None) -> list[RequestSpec]:
    """n request specs. Generated prompts start with a tag unique to the run and the request, then
    corpus text from a random offset, so no two share a prefix block (nor do runs of one sweep)."""
    rng = random.Random(seed)
    out_len = parse_length(max_tokens)
    if prompt_file:
        with open(prompt_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:
            raise BenchError(f"{prompt_file}: no prompts (one per line expected)")
        return [RequestSpec(p, out_len(rng), maker.count(p)) for p in (lines[i % len(lines)] for i in range(n))]
    in_len = parse_length(prompt_len)
    tag = tag if tag is not None else f"{rng.randrange(16 ** 6):06x}"
    specs = []
    for i in range(n):
        want = in_len(rng)
        text = maker.text(want, rng.randrange(1 << 30), head=f"[{tag}-{i}] ")
        specs.append(RequestSpec(text, out_len(rng), maker.count(text)))
    return specs


# --- one request ---------------------------------------------------------------------------------
async def send_one(client: httpx.AsyncClient, base_url: str, opts: ApiOptions, spec: RequestSpec) -> RequestResult:
    """One streamed request, timed. Never raises (except cancellation): failures are in .error."""
    res = RequestResult(prompt_tokens=spec.prompt_tokens_est)
    res.start = time.perf_counter()
    try:
        async with client.stream("POST", base_url + opts.endpoint(), json=opts.body(spec.prompt, spec.max_tokens)) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode("utf-8", "replace")
                try:
                    msg = error_text(json.loads(raw))
                except ValueError:
                    msg = raw[:200]
                raise RuntimeError(f"HTTP {r.status_code}: {msg}")
            done = False
            async for line in r.aiter_lines():
                now = time.perf_counter()
                line = line.strip()
                if line and take_line(opts, line, res, now):
                    done = True
                    break
            if not done and opts.api != "openai":  # OpenAI-style servers may end without [DONE]
                raise RuntimeError("stream ended without its final " + ("object" if opts.api == "ollama" else "event"))
        if not res.tokens_from_server:
            res.output_tokens = len(res.chunk_times)
        if res.ttft is None and res.output_tokens > 0 and res.first_event is not None:
            # Tokens without text (e.g. only an end-of-generation token): the first chunk is the first token.
            res.ttft = res.first_event - res.start
        res.ok = True
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RuntimeError) else str(exc)
    res.end = time.perf_counter()
    return res


# --- a run ---------------------------------------------------------------------------------------
@dataclass
class LoadConfig:
    concurrency: int | None = None  # most requests in flight (None with a rate: unlimited)
    rate: float | None = None       # Poisson arrivals per second (None: all at once, up to concurrency)
    duration: float = 600.0         # no request starts after this many seconds
    request_timeout: float = 600.0  # per-request read timeout; the run ends by duration + this
    seed: int = 0


async def run_load(base_url: str, opts: ApiOptions, specs: list[RequestSpec], cfg: LoadConfig,
                   client: httpx.AsyncClient | None = None) -> tuple[list[RequestResult], float, int]:
    """Send `specs` (at most; fewer if `duration` runs out). Returns (results, wall seconds, number
    of requests not started because the time ran out)."""
    if cfg.concurrency is None and cfg.rate is None:
        raise BenchError("give a concurrency or a rate")
    limit = cfg.concurrency or len(specs) or 1
    own = client is None
    client = client or new_client(limit, cfg.request_timeout)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(cfg.seed)
    results: list[RequestResult] = []
    tasks: list[asyncio.Task] = []

    async def worker(spec: RequestSpec) -> None:
        try:
            results.append(await send_one(client, base_url, opts, spec))
        finally:
            sem.release()

    t0 = time.perf_counter()
    stop_at = t0 + cfg.duration
    next_arrival = t0
    skipped = 0
    try:
        for i, spec in enumerate(specs):
            if cfg.rate:
                next_arrival += rng.expovariate(cfg.rate)
                delay = next_arrival - time.perf_counter()
                if next_arrival >= stop_at:
                    skipped = len(specs) - i
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
            remaining = stop_at - time.perf_counter()
            if remaining <= 0:
                skipped = len(specs) - i
                break
            try:
                await asyncio.wait_for(sem.acquire(), remaining)
            except asyncio.TimeoutError:
                skipped = len(specs) - i
                break
            tasks.append(asyncio.create_task(worker(spec)))
        if tasks:
            # Bounded: each request has its own read timeout, and the run a hard deadline besides.
            hard = max(0.0, stop_at - time.perf_counter()) + cfg.request_timeout + 5
            _, pending = await asyncio.wait(tasks, timeout=hard)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
                for _ in pending:
                    results.append(RequestResult(ok=False, error="cancelled at the run's deadline",
                                                 start=t0, end=time.perf_counter()))
    finally:
        if own:
            await client.aclose()
    wall = (max((r.end for r in results), default=t0) - min((r.start for r in results), default=t0))
    return results, wall, skipped


def _ms(values: list[float]) -> dict[str, float]:
    return {k: v * 1000 for k, v in percentiles(values).items()}


def summarize(results: list[RequestResult], wall: float, *, skipped: int = 0) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    errors = Counter(r.error for r in results if not r.ok)
    itl = [x for r in ok for x in r.itls()]
    tpot = [t for r in ok if (t := r.tpot()) is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_errors": len(results) - len(ok),
        "num_not_started": skipped,
        "errors": dict(errors.most_common(5)),
        "duration_s": wall,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tokens_counted_by": ("server" if ok and all(r.tokens_from_server for r in ok)
                                     else "stream chunks" if ok and not any(r.tokens_from_server for r in ok)
                                     else "mixed" if ok else None),
        "prompt_tokens_counted_by": ("server" if ok and all(r.prompt_from_server for r in ok) else "estimate"),
        "request_per_s": len(ok) / wall if wall > 0 else 0.0,
        "output_tok_s": output_tokens / wall if wall > 0 else 0.0,
        "total_tok_s": (prompt_tokens + output_tokens) / wall if wall > 0 else 0.0,
        "ttft_ms": _ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _ms(itl),
        "tpot_ms": _ms(tpot),
        "e2e_ms": _ms([r.e2e for r in ok]),
        "cached_tokens": {"requests_reporting": len(cached), "requests_with_hits": sum(1 for c in cached if c > 0),
                          "total": sum(cached)} if cached else None,
    }


def result_dict(r: RequestResult) -> dict[str, Any]:
    d = asdict(r)
    d.pop("chunk_times")
    d.pop("text")
    d["e2e"] = r.e2e
    return d
