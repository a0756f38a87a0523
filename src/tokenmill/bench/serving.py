"""Serving benchmark: a load generator against a running server (tokenmill or a peer such as
llama.cpp's or Ollama's) over its HTTP API, with streaming, at a fixed concurrency or a Poisson rate.

    tokenmill serve smollm2 --port 11600 &
    tokenmill bench serve --url http://127.0.0.1:11600 --concurrency 16 --num-requests 64 \\
        --prompt-len 100 --max-tokens 128 --ignore-eos --json serve.json
    tokenmill bench serve --url ... --sweep 1,4,16,64 --chart sweep.png

Only loopback URLs are accepted. A run ends after --num-requests requests or when --duration seconds
have passed (no request starts later; running ones get --request-timeout more at most).

Figures (per run)
  output tok/s   output tokens / wall time from the first request sent to the last one finished.
  total tok/s    (prompt + output tokens) / the same wall time.
  TTFT           send -> first chunk with text.  ITL: gaps between chunks with text.
  TPOT           (E2E - TTFT) / (output tokens - 1).  E2E: send -> end of stream.
Output tokens are the server's own count when it sends one (OpenAI usage with
stream_options.include_usage, Ollama eval_count), else one per chunk with text.
--ignore-eos sends ignore_eos and min_tokens (vLLM's extensions) on the OpenAI API; Ollama's API has
no such option, so there only num_predict caps the output.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from tokenmill.bench.api_streams import APIS, ApiOptions
from tokenmill.bench.common import environment, fmt, loadavg, progress, write_json
from tokenmill.bench.loadgen import (BenchError, LoadConfig, TextMaker, check_loopback, load_tokenizer, make_requests,
                                     new_client, parse_length, run_load, send_one, summarize)
from tokenmill.bench.server_metrics import detect_model, scrape_metrics, server_latencies, server_peak_rss_mib


def build_parser(prog: str = "tokenmill bench serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:11434", help="server base URL (loopback only)")
    p.add_argument("--api", choices=APIS, default="openai",
                   help="openai: /v1/completions (SSE); ollama: /api/generate (NDJSON); anthropic: /v1/messages "
                        "(typed SSE events, chat only)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions or /api/chat instead")
    p.add_argument("--model", default=None, help="model name to send (default: ask the server)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (default 8; with --rate: a cap, default none)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second instead of all at once")
    p.add_argument("--sweep", default=None, metavar="C1,C2,...",
                   help="run once per concurrency level (each with --num-requests requests)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per run (default 64)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds after which no request starts (default 600)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="per-request read timeout, seconds")
    p.add_argument("--prompt-len", default="100", help="prompt tokens: N or uniform:LOW:HIGH (default 100)")
    p.add_argument("--prompt-file", default=None, help="prompts, one per line (overrides --prompt-len)")
    p.add_argument("--max-tokens", default="128", help="output tokens: N or uniform:LOW:HIGH (default 128)")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly max-tokens (OpenAI API)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrival times")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests before measuring (default 1)")
    p.add_argument("--tokenizer", default=None,
                   help="local model name or .gguf whose tokenizer sizes the prompts (default: --model, if "
                        "installed; else ~0.75 words per token)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--chart", metavar="PATH.png", help="with --sweep: draw throughput and latency vs concurrency")
    p.add_argument("--label", default=None, help="name of the server under test, for the report and chart")
    return p


def _levels(args: argparse.Namespace) -> list[int | None]:
    if args.sweep:
        if args.rate is not None:
            raise BenchError("--sweep varies the concurrency; it cannot be combined with --rate")
        try:
            levels = [int(x) for x in args.sweep.split(",") if x.strip()]
        except ValueError:
            raise BenchError(f"--sweep must be a comma-separated list of integers, got {args.sweep!r}") from None
        if not levels or min(levels) < 1:
            raise BenchError("--sweep levels must be positive integers")
        return levels
    if args.concurrency is not None and args.concurrency < 1:
        raise BenchError("--concurrency must be at least 1")
    if args.rate is not None and args.rate <= 0:
        raise BenchError("--rate must be positive")
    if args.rate is not None:
        return [args.concurrency]
    return [args.concurrency or 8]


def _check(args: argparse.Namespace) -> None:
    if args.num_requests < 1:
        raise BenchError("--num-requests must be at least 1")
    if args.duration <= 0 or args.request_timeout <= 0:
        raise BenchError("--duration and --request-timeout must be positive")
    parse_length(args.max_tokens)
    if not args.prompt_file:
        parse_length(args.prompt_len)
    if args.chart and not args.sweep:
        raise BenchError("--chart needs --sweep")


async def _run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    levels = _levels(args)
    async with new_client(4, args.request_timeout) as probe:
        model = args.model or await detect_model(probe, base)
        if not model:
            raise BenchError(f"could not ask {base} for its model (is it running?); pass --model")
        maker = TextMaker(load_tokenizer(args.tokenizer or model))
        opts = ApiOptions(api=args.api, chat=args.chat, model=model, ignore_eos=args.ignore_eos,
                          temperature=args.temperature)
        for i in range(args.warmup):
            spec = make_requests(1, "16", "4", maker, seed=10_000 + i, tag=f"warmup{time.time_ns() % 10**6}-{i}")[0]
            res = await send_one(probe, base, opts, spec)
            if not res.ok:
                raise BenchError(f"warm-up request failed: {res.error}")
    runs = []
    run_tag = f"{time.time_ns() % 16 ** 6:06x}"
    for li, level in enumerate(levels):
        specs = make_requests(args.num_requests, args.prompt_len, args.max_tokens, maker, seed=args.seed + li,
                              prompt_file=args.prompt_file, tag=f"{run_tag}{li}")
        cfg = LoadConfig(concurrency=level, rate=args.rate, duration=args.duration,
                         request_timeout=args.request_timeout, seed=args.seed + li)
        progress(f"run {li + 1}/{len(levels)}: concurrency {level or 'unlimited'}"
                 f"{f', rate {args.rate}/s' if args.rate else ''}, {len(specs)} requests")
        la_before = loadavg()
        async with new_client(1, 10) as probe:
            metrics_before = await scrape_metrics(probe, base)
        results, wall, skipped = await run_load(base, opts, specs, cfg)
        async with new_client(1, 10) as probe:
            metrics_after = await scrape_metrics(probe, base)
        summary = summarize(results, wall, skipped=skipped)
        runs.append({"concurrency": level, "rate": args.rate, **summary,
                     "server": server_latencies(metrics_before, metrics_after),
                     "server_peak_rss_mib": server_peak_rss_mib(metrics_after),
                     "loadavg_before": la_before, "loadavg_after": loadavg()})
    return {"model": model, "prompt_lengths_exact": maker.exact, "runs": runs}


def print_report(result: dict[str, Any]) -> None:
    c = result["config"]
    print(f"serving benchmark: {result['label'] or result['url']} ({c['api']}{' chat' if c['chat'] else ''}, "
          f"model {result['model']})")
    print(f"  prompt {c['prompt_file'] or c['prompt_len']} tokens"
          f"{'' if result['prompt_lengths_exact'] else ' (estimated ~0.75 words/token)'}, max tokens "
          f"{c['max_tokens']}{' (EOS ignored)' if c['ignore_eos'] else ''}, "
          f"{'rate ' + str(c['rate']) + '/s' if c['rate'] else 'all at once'}")
    head = (f"{'conc':>5} {'ok':>4} {'err':>4} {'wall s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
            f"{'TTFT ms p50/p95/p99':>22} {'ITL ms p50/p95/p99':>20} {'E2E s p50/p95/p99':>20}")
    print(head)
    for r in result["runs"]:
        t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
        print(f"{r['concurrency'] or '-':>5} {r['num_completed']:>4} {r['num_errors']:>4} {r['duration_s']:>7.1f} "
              f"{r['output_tok_s']:>10.1f} {r['total_tok_s']:>10.1f} "
              f"{fmt(t['p50'], 0) + '/' + fmt(t['p95'], 0) + '/' + fmt(t['p99'], 0):>22} "
              f"{fmt(i['p50'], 1) + '/' + fmt(i['p95'], 1) + '/' + fmt(i['p99'], 1):>20} "
              f"{fmt(e['p50'] / 1000, 2) + '/' + fmt(e['p95'] / 1000, 2) + '/' + fmt(e['p99'] / 1000, 2):>20}")
        if r["errors"]:
            for msg, n in r["errors"].items():
                print(f"      {n} x {msg}")
        if r["num_not_started"]:
            print(f"      {r['num_not_started']} requests not started: --duration ran out")
        if r.get("server") and r["ttft_ms"].get("mean") is not None:
            sv = r["server"]
            print(f"      TTFT mean {fmt(r['ttft_ms']['mean'], 0)} ms at the client; the server's (/metrics) "
                  f"{fmt(sv['ttft_mean_ms'], 0)} ms from intake, {fmt(sv['queue_mean_ms'], 0)} of them queued")
        if r.get("server_peak_rss_mib") is not None:
            print(f"      server's peak RSS so far (/metrics): {fmt(r['server_peak_rss_mib'], 0)} MiB")
    print(f"  tokens counted by: output {result['runs'][-1]['output_tokens_counted_by']}, "
          f"prompt {result['runs'][-1]['prompt_tokens_counted_by']}; loadavg {result['loadavg_end']}")


def main(argv: list[str] | None = None, prog: str = "tokenmill bench serve") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        base = check_loopback(args.url)
        _check(args)
        la = loadavg()
        started = time.time()
        out = asyncio.run(_run(args, base))
    except BenchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    result = {"benchmark": "serve", "url": base, "label": args.label, **out,
              "config": {k: getattr(args, k) for k in ("api", "chat", "concurrency", "rate", "sweep", "num_requests",
                                                       "duration", "prompt_len", "prompt_file", "max_tokens",
                                                       "ignore_eos", "temperature", "seed", "warmup")},
              "started_at": started, "loadavg_start": la, "loadavg_end": loadavg(), "environment": _env()}
    print_report(result)
    if args.chart:
        from tokenmill.bench.chart import sweep_chart

        path = sweep_chart(result["runs"], args.chart,
                           title=f"{args.label or base} {out['model']}: prompt {args.prompt_len}, "
                                 f"max tokens {args.max_tokens}")
        result["chart"] = str(path)
        print(f"  chart: {path}")
    write_json(args.json, result)
    return 0 if all(r["num_completed"] > 0 for r in result["runs"]) else 1


def _env() -> dict[str, Any]:
    try:
        return environment()
    except Exception:  # noqa: BLE001 - torch missing on a client-only machine: not worth failing over
        import os
        import platform

        return {"python": platform.python_version(), "cpu_count": os.cpu_count()}
