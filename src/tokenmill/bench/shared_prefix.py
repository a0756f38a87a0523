"""Shared-prefix benchmark (issue 6): does a burst of requests that share a long prefix start faster
than the same burst without the sharing? Against a running server (loopback only):

  1. cold    one request: a ~400-token prefix + a question (puts the prefix in the server's cache);
  2. shared  a burst of 30 concurrent requests: the same prefix + 30 distinct ~20-token questions;
  3. unique  the same burst, each prefix made unique from its first word on (nothing to reuse).

Reported: TTFT p50/p95 of both bursts, their ratio (shared median / unique median; target <= 0.15),
and how many requests reused the prefix: per request from OpenAI's
usage.prompt_tokens_details.cached_tokens when the server sends it, and in cached prompt tokens from
the /metrics counters vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total (deltas over
each phase) when the server has them (tokenmill counts as queries the tokens of each prompt's first
scheduled chunk, so under chunked prefill they can be fewer than the prompt tokens sent).
Each run starts its prefixes with a fresh nonce, so a previous run's cache cannot help.

    tokenmill bench shared-prefix --url http://127.0.0.1:11600 [--burst 30 --prefix-len 400 ...]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import Any

from tokenmill.bench.api_streams import APIS, ApiOptions, RequestResult
from tokenmill.bench.common import CORPUS, environment, fmt, loadavg, percentiles, progress, write_json
from tokenmill.bench.loadgen import (BenchError, RequestSpec, TextMaker, check_loopback, load_tokenizer, new_client,
                                     result_dict, send_one)
from tokenmill.bench.server_metrics import detect_model, scrape_metrics

TARGET_RATIO = 0.15
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"

TOPICS = ["the river", "the farmers", "the bakery", "the lighthouse keeper", "the historian", "prime numbers",
          "Euclid", "the library", "the librarian", "soup", "the stock", "clocks", "railways", "time zones",
          "bees", "the colony", "the bridge", "the engineer", "learning a language", "children", "the plateau",
          "shepherds", "the market", "binary numbers", "floating point", "careful programs", "the garden",
          "the new owners", "the bench", "the weather"]


def build_parser(prog: str = "tokenmill bench shared-prefix") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:11434", help="server base URL (loopback only)")
    p.add_argument("--api", choices=APIS, default="openai")
    p.add_argument("--model", default=None, help="model name to send (default: ask the server)")
    p.add_argument("--prefix-len", type=int, default=400, help="shared prefix tokens (default 400)")
    p.add_argument("--question-len", type=int, default=20, help="tokens of each distinct question (default 20)")
    p.add_argument("--burst", type=int, default=30, help="concurrent requests per burst (default 30)")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (default 8)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--warmup", type=int, default=1, help="untimed unrelated requests first (default 1)")
    p.add_argument("--tokenizer", default=None, help="local model or .gguf sizing the texts (default: --model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p


def _first_words(n: int, rng: random.Random, first_token=None) -> list[str]:
    """n distinct capitalised words to start the unique prefixes with; with `first_token` (text ->
    its first token id), words whose first tokens differ, as far as the corpus has such words."""
    seen: dict[str, None] = {}
    for w in CORPUS.split():
        w = "".join(ch for ch in w if ch.isalpha())
        if len(w) >= 4:
            seen.setdefault(w.lower().capitalize(), None)
    words = list(seen)
    rng.shuffle(words)
    if first_token is not None:
        by_first: dict[int, str] = {}
        for w in words:
            by_first.setdefault(first_token(w), w)
        distinct = list(by_first.values())
        words = distinct + [w for w in words if w not in by_first.values()]
    return [words[i % len(words)] + ("" if i < len(words) else str(i)) for i in range(n)]


def make_texts(maker: TextMaker, args: argparse.Namespace, nonce: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    body = maker.text(args.prefix_len, rng.randrange(1 << 30), head=f"Session {nonce}. Read this text.\n")
    questions = []
    for i in range(args.burst + 1):
        q = f"\n\nQuestion {i + 1}: in a few words, what does the text above say about {TOPICS[i % len(TOPICS)]}?"
        # pad or trim towards question_len with a neutral tail
        tail = " Answer briefly and plainly, please."
        while maker.count(q) < args.question_len and tail:
            q += tail
            tail = ""
        questions.append(q + "\nAnswer:")
    first = (lambda t: maker.tokenizer.encode(t, add_special_tokens=False)[0]) if maker.exact else None
    unique = [f"{w} {nonce}-{i}. " + body for i, w in enumerate(_first_words(args.burst, rng, first))]
    return {"prefix": body, "questions": questions, "unique_prefixes": unique}


def _first_token_distinct(maker: TextMaker, texts: list[str]) -> bool | None:
    if not maker.exact:
        return None
    firsts = [maker.tokenizer.encode(t, add_special_tokens=False)[:1] for t in texts]
    return len({tuple(f) for f in firsts}) == len(firsts)


def _delta(before: dict | None, after: dict | None) -> dict[str, float] | None:
    if before is None or after is None or HITS not in after or QUERIES not in after:
        return None
    hits = after[HITS] - before.get(HITS, 0.0)
    queries = after[QUERIES] - before.get(QUERIES, 0.0)
    return {"hit_tokens": hits, "query_tokens": queries, "hit_rate": hits / queries if queries else 0.0}


def _phase(results: list[RequestResult], delta: dict | None, wall: float, prefix_tokens: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    out: dict[str, Any] = {
        "num_requests": len(results), "num_completed": len(ok), "num_errors": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok}),
        "wall_s": wall,
        "ttft_ms": {k: v * 1000 for k, v in percentiles(ttft).items()},
        "prompt_tokens_mean": statistics.fmean([r.prompt_tokens for r in ok]) if ok else 0.0,
        "cached_tokens": ({"requests_reporting": len(cached), "requests_reused": sum(1 for c in cached if c > 0),
                           "mean": statistics.fmean(cached), "min": min(cached), "max": max(cached)}
                          if cached else None),
        "metrics": delta,
        "requests": [result_dict(r) for r in results],
    }
    if delta is not None and prefix_tokens > 0:
        # From the token counters alone: cached tokens in units of whole prefixes, i.e. about how
        # many requests found the prefix cached (block granularity makes it slightly low).
        out["metrics"]["prefix_equivalents"] = delta["hit_tokens"] / prefix_tokens
    return out


async def _burst(client, base: str, opts: ApiOptions, specs: list[RequestSpec]) -> tuple[list[RequestResult], float]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(send_one(client, base, opts, s) for s in specs))
    return list(results), time.perf_counter() - t0


async def _run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    async with new_client(args.burst + 2, args.request_timeout) as client:
        model = args.model or await detect_model(client, base)
        if not model:
            raise BenchError(f"could not ask {base} for its model (is it running?); pass --model")
        maker = TextMaker(load_tokenizer(args.tokenizer or model))
        # EOS ignored (OpenAI API) so every request does the same work whatever the model says.
        opts = ApiOptions(api=args.api, model=model, temperature=0.0, ignore_eos=True)
        nonce = f"{random.Random(time.time_ns()).randrange(16 ** 8):08x}"
        texts = make_texts(maker, args, nonce)
        prefix_tokens = maker.count(texts["prefix"])

        def spec(prefix: str, q: str) -> RequestSpec:
            return RequestSpec(prefix + q, args.max_tokens, maker.count(prefix + q))

        for i in range(args.warmup):
            w = await send_one(client, base, opts, RequestSpec(f"Warm-up {nonce} {i}: say hello.", 4, 8))
            if not w.ok:
                raise BenchError(f"warm-up request failed: {w.error}")

        phases: dict[str, Any] = {}
        m0 = await scrape_metrics(client, base)
        progress("cold request")
        cold, wall = await _burst(client, base, opts, [spec(texts["prefix"], texts["questions"][0])])
        m1 = await scrape_metrics(client, base)
        phases["cold"] = _phase(cold, _delta(m0, m1), wall, prefix_tokens)
        if not cold[0].ok:
            raise BenchError(f"the cold request failed: {cold[0].error}")

        progress(f"shared burst of {args.burst}")
        shared, wall = await _burst(client, base, opts,
                                    [spec(texts["prefix"], q) for q in texts["questions"][1:]])
        m2 = await scrape_metrics(client, base)
        phases["shared"] = _phase(shared, _delta(m1, m2), wall, prefix_tokens)

        progress(f"unique burst of {args.burst}")
        unique, wall = await _burst(client, base, opts,
                                    [spec(p, q) for p, q in zip(texts["unique_prefixes"], texts["questions"][1:])])
        m3 = await scrape_metrics(client, base)
        phases["unique"] = _phase(unique, _delta(m2, m3), wall, prefix_tokens)

    s50, u50 = phases["shared"]["ttft_ms"]["p50"], phases["unique"]["ttft_ms"]["p50"]
    ratio = s50 / u50 if u50 > 0 and phases["shared"]["num_completed"] and phases["unique"]["num_completed"] else None
    return {"model": model, "prompt_lengths_exact": maker.exact, "prefix_tokens": prefix_tokens,
            "unique_first_tokens_distinct": _first_token_distinct(maker, texts["unique_prefixes"]),
            "metrics_available": m0 is not None and HITS in (m0 or {}),
            "phases": phases, "ttft_ratio_shared_over_unique_p50": ratio, "target_ratio": TARGET_RATIO,
            "meets_target": None if ratio is None else ratio <= TARGET_RATIO}


def _reuse_text(ph: dict[str, Any], burst: int) -> str:
    parts = []
    if ph["cached_tokens"] is not None:
        c = ph["cached_tokens"]
        parts.append(f"{c['requests_reused']}/{ph['num_completed']} reused (cached_tokens mean {c['mean']:.0f})")
    if ph["metrics"] is not None:
        m = ph["metrics"]
        parts.append(f"/metrics: {m['hit_tokens']:.0f}/{m['query_tokens']:.0f} prompt tokens hit "
                     f"({100 * m['hit_rate']:.0f}%, = {m.get('prefix_equivalents', 0):.1f} prefixes)")
    return "; ".join(parts) or "no reuse information from the server"


def print_report(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"shared-prefix benchmark: {r['url']} ({args.api}, model {r['model']}), prefix {r['prefix_tokens']} "
          f"tokens{'' if r['prompt_lengths_exact'] else ' (estimated)'}, burst {args.burst}, "
          f"max tokens {args.max_tokens}")
    print(f"{'phase':8} {'ok':>4} {'err':>4} {'prompt tok':>10} {'TTFT p50 ms':>12} {'TTFT p95 ms':>12} "
          f"{'wall s':>7}  reuse")
    for name in ("cold", "shared", "unique"):
        ph = r["phases"][name]
        t = ph["ttft_ms"]
        print(f"{name:8} {ph['num_completed']:>4} {ph['num_errors']:>4} {ph['prompt_tokens_mean']:>10.0f} "
              f"{t['p50']:>12.1f} {t['p95']:>12.1f} {ph['wall_s']:>7.2f}  {_reuse_text(ph, args.burst)}")
        for e in ph["errors"][:3]:
            print(f"         error: {e}")
    ratio = r["ttft_ratio_shared_over_unique_p50"]
    verdict = "" if ratio is None else ("  (meets target)" if r["meets_target"] else "  (MISSES target)")
    print(f"shared median TTFT / unique median TTFT = {fmt(ratio, 3)} (target <= {TARGET_RATIO}){verdict}")
    print(f"loadavg {r['loadavg_start']} -> {r['loadavg_end']}")


def main(argv: list[str] | None = None, prog: str = "tokenmill bench shared-prefix") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        base = check_loopback(args.url)
        if args.burst < 1 or args.prefix_len < 1 or args.question_len < 1 or args.max_tokens < 1:
            raise BenchError("--burst, --prefix-len, --question-len and --max-tokens must be positive")
        la = loadavg()
        out = asyncio.run(_run(args, base))
    except BenchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    result = {"benchmark": "shared-prefix", "url": base, **out,
              "config": {k: getattr(args, k) for k in ("api", "prefix_len", "question_len", "burst", "max_tokens",
                                                       "seed", "warmup")},
              "loadavg_start": la, "loadavg_end": loadavg()}
    try:
        result["environment"] = environment()
    except Exception:  # noqa: BLE001 - torch-less client machine
        result["environment"] = None
    print_report(result, args)
    write_json(args.json, result)
    ok = all(out["phases"][p]["num_completed"] == out["phases"][p]["num_requests"] for p in out["phases"])
    return 0 if ok else 1
