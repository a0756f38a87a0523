"""Ray Serve benchmark (issue 17): on the same cores, is tokenmill better as one process with T
threads or as T single-thread replicas on Ray Serve, and what does prefix-aware routing buy over
Ray Serve's default router? Three set-ups, each started here on loopback and torn down after:

  single   `tokenmill serve` with --threads T (one engine, one prefix cache)
  prefix   T replicas x 1 thread on a local Ray instance, tokenmill's prefix-aware router
  default  the same replicas with Ray Serve's power-of-two-choices router

and two workloads sent to each (streamed /v1/completions, fixed concurrency):

  shared   G long prefixes (think system prompts or documents) shared by the requests, each
           request one of them + its own short question, in shuffled order;
  unique   prompts of the same length that share nothing.

Reported per set-up and workload: requests/s, output tok/s, TTFT p50/p95, and the prefix hit rate
(prompt tokens served from a cache / prompt tokens, from OpenAI usage.cached_tokens). Every
workload starts with a fresh nonce, so no set-up profits from an earlier one's cache.

    tokenmill bench ray [--model smollm2 --threads 2 --requests 32 --concurrency 8 ...]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from tokenmill.bench.common import fmt, loadavg, progress, write_json
from tokenmill.bench.api_streams import ApiOptions
from tokenmill.bench.loadgen import LoadConfig, RequestSpec, TextMaker, load_tokenizer, new_client, run_load, summarize

SETUPS = ("single", "prefix", "default")
WORKLOADS = ("shared", "unique")


def build_parser(prog: str = "tokenmill bench ray") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2, help="cores to use: threads of the single process, "
                                                          "replicas of the Ray set-ups (default 2)")
    p.add_argument("--requests", type=int, default=32, help="requests per workload (default 32)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="distinct shared prefixes (default 4)")
    p.add_argument("--prefix-len", type=int, default=384, help="tokens of each prompt's long part (default 384)")
    p.add_argument("--question-len", type=int, default=24, help="tokens of each request's own part")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-size", type=int, default=16384, help="KV cache tokens per engine")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of {','.join(SETUPS)}")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def make_workload(kind: str, args: argparse.Namespace, maker: TextMaker, nonce: str) -> list[RequestSpec]:
    rng = random.Random(f"{nonce}-{kind}")
    specs = []
    prefixes = [maker.text(args.prefix_len, rng.randrange(1 << 30), head=f"[{nonce}-doc{g}] ")
                for g in range(args.groups)]
    for i in range(args.requests):
        question = maker.text(args.question_len, rng.randrange(1 << 30), head=f" Question {i}: ")
        if kind == "shared":
            long_part = prefixes[rng.randrange(args.groups)]
        else:
            long_part = maker.text(args.prefix_len, rng.randrange(1 << 30), head=f"[{nonce}-{i}] ")
        text = long_part + question
        specs.append(RequestSpec(text, args.max_tokens, maker.count(text)))
    return specs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not come up")


def _engine_settings(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    return {"model": args.model, "threads": threads, "kv_size": args.kv_size}


class SingleProcess:
    def __init__(self, args: argparse.Namespace):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", args.model, "--threads", str(args.threads),
               "--kv-size", str(args.kv_size), "--port", str(self.port), "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_up(self.url)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


class RayDeployment:
    def __init__(self, args: argparse.Namespace, router: str):
        import ray
        from ray import serve

        from tokenmill.config import load_config
        from tokenmill.ray.app import RayOptions, build

        if not ray.is_initialized():
            ray.init(num_cpus=args.threads, include_dashboard=False, log_to_driver=False)
        self.port = getattr(RayDeployment, "port", None) or _free_port()
        RayDeployment.port = self.port  # Serve's proxy keeps the port it started with
        self.url = f"http://127.0.0.1:{self.port}"
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        settings = load_config(argparse.Namespace(**{k: str(v) for k, v in _engine_settings(args, 1).items()}),
                               env={})
        serve.run(build(settings, RayOptions(replicas=args.threads, router=router)), name="tokenmill",
                  route_prefix="/")
        _wait_up(self.url)

    def close(self) -> None:
        from ray import serve

        serve.delete("tokenmill")


async def _measure(url: str, args: argparse.Namespace, specs: list[RequestSpec]) -> dict[str, Any]:
    opts = ApiOptions(api="openai", chat=False, model=args.model, ignore_eos=True)
    client = new_client(args.concurrency, 600)
    try:
        # One request to warm up (first-call costs) with a prompt that shares nothing.
        await run_load(url, opts, [RequestSpec("warm up " * 8, 4, 16)], LoadConfig(concurrency=1), client)
        results, wall, skipped = await run_load(url, opts, specs, LoadConfig(concurrency=args.concurrency), client)
    finally:
        await client.aclose()
    out = summarize(results, wall, skipped=skipped)
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    out["prefix_hit_rate"] = cached / prompt if prompt else 0.0
    out["router"] = await _router_counters(url)
    return out


async def _router_counters(url: str) -> dict[str, float] | None:
    """The prefix router's decisions so far (None for servers without one)."""
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(url + "/metrics")).text
    found = {m.group(1): float(m.group(2)) for m in
             re.finditer(r'^tokenmill:router_requests_total\{decision="(\w+)"\} (\S+)$', text, re.M)}
    return found or None


def run(args: argparse.Namespace) -> dict[str, Any]:
    maker = TextMaker(load_tokenizer(args.model))
    setups = [s for s in args.setups.split(",") if s]
    results: dict[str, dict[str, Any]] = {}
    for setup in setups:
        progress(f"{setup}: starting")
        server = SingleProcess(args) if setup == "single" else RayDeployment(args, setup)
        try:
            for kind in WORKLOADS:
                nonce = f"{setup}{random.randrange(16 ** 6):06x}"
                progress(f"{setup}: {kind} workload")
                results.setdefault(setup, {})[kind] = asyncio.run(
                    _measure(server.url, args, make_workload(kind, args, maker, nonce)))
        finally:
            server.close()
    return results


def print_report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{args.model}: {args.requests} requests x (prefix {args.prefix_len} + question {args.question_len} "
          f"tokens) -> {args.max_tokens} tokens, concurrency {args.concurrency}, {args.threads} cores")
    print(f"{'setup':8} {'workload':8} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'hit rate':>9} {'errors':>6}")
    for setup, by_kind in results.items():
        for kind, r in by_kind.items():
            print(f"{setup:8} {kind:8} {fmt(r['request_per_s'], 2):>7} {fmt(r['output_tok_s']):>10} "
                  f"{fmt(r['ttft_ms'].get('p50'), 0):>7}ms {fmt(r['ttft_ms'].get('p95'), 0):>7}ms "
                  f"{r['prefix_hit_rate'] * 100:>8.1f}% {r['num_errors']:>6}"
                  + (f"  router so far: {r['router']}" if r.get("router") and setup == "prefix" else ""))


def main(argv: list[str] | None = None, prog: str = "tokenmill bench ray") -> int:
    args = build_parser(prog).parse_args(argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    start_load = loadavg()
    results = run(args)
    print_report(results, args)
    write_json(args.json, {"benchmark": "ray", "config": vars(args), "results": results,
                           "loadavg_start": start_load, "loadavg_end": loadavg()})
    return 0
