"""Offline throughput: N prompts of P tokens, M new tokens each (EOS ignored), all submitted at once
to the engine; then the same token ids through transformers' batched `generate` in a child process
(so each side's peak RSS is its own), and the ratio.

Definitions
  output tok/s   N*M / wall time from submitting the first request to the last token.
  prefill tok/s  prompt tokens / time until every request has its first token (on both sides).
  step times     wall time of each engine.step(); "decode" steps are the ones with no prefill tokens.
"""
from __future__ import annotations

import argparse
import gc
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from tokenmill.bench.common import (corpus_prompts, environment, fmt, hf_generate, hf_pad_id, load_hf, loadavg,
                                    percentiles, progress, random_prompt, ratio, resolve_bench_device, set_threads,
                                    write_json)
from tokenmill.process_stats import peak_rss_bytes


def build_parser(prog: str = "tokenmill bench offline") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model name or .gguf path (default: smollm2)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=100, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (EOS ignored)")
    p.add_argument("--dtype", choices=["auto", "gguf", "bf16", "fp32"], default="auto")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu",
                   help="where both sides run (cuda: tokenmill's GPU path, transformers on the same GPU)")
    p.add_argument("--n-batch", type=int, default=512, help="engine token budget per step")
    p.add_argument("--n-ubatch", type=int, default=None, help="engine micro-batch (default: = --n-batch)")
    p.add_argument("--parallel", type=int, default=64, help="engine: most sequences running at once")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="engine KV budget in tokens")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="eager model steps (the server's default compiles them)")
    p.add_argument("--warmup-tokens", type=int, default=4, help="tokens of an untimed warm-up request (0 = none)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: torch's)")
    p.add_argument("--skip-hf", action="store_true", help="only run tokenmill")
    p.add_argument("--hf-batch", type=int, default=0, help="transformers batch size (0 = all prompts at once)")
    p.add_argument("--hf-dtype", choices=["bf16", "fp32"], default=None,
                   help="default: --dtype if it is bf16 or fp32, else fp32 (transformers has no GGUF-block mode); "
                   "bf16 on a GPU")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p


def run_tokenmill(gguf_path: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams

    cfg = EngineConfig(dtype=args.dtype, n_batch=args.n_batch, n_ubatch=args.n_ubatch or args.n_batch,
                       parallel=args.parallel, max_total_tokens=args.max_total_tokens,
                       enable_prefix_caching=not args.no_prefix_caching, compile=not args.no_compile,
                       device=args.device)
    start = time.perf_counter()
    engine = LLMEngine.from_path(gguf_path, cfg)
    init_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    if args.warmup_tokens > 0:  # first calls into torch kernels are slow; keep them out of the timing
        warm = random_prompt(engine.loaded.config.vocab_size, min(len(prompts[0]), 32), seed=1234)
        engine.add_request(warm, SamplingParams(max_tokens=args.warmup_tokens, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    warm_steps = engine.stats.num_steps
    prompt_tokens_before = engine.stats.num_prompt_tokens

    step_s: list[float] = []
    decode_step_s: list[float] = []
    tokens_per_step: list[int] = []
    first_token: dict[str, float] = {}
    out_tokens: dict[str, int] = {}
    kv_peak = 0.0
    t0 = time.perf_counter()
    for ids in prompts:
        rid = engine.add_request(ids, params)
        out_tokens[rid] = 0
    while engine.has_unfinished():
        s = time.perf_counter()
        events = engine.step()
        e = time.perf_counter()
        step_s.append(e - s)
        rec = engine.stats.last_step
        if rec is not None:
            tokens_per_step.append(rec.num_tokens)
            if rec.num_prefill_tokens == 0:
                decode_step_s.append(e - s)
        kv_peak = max(kv_peak, engine.kv_usage())
        for ev in events:
            if ev.token_ids:
                out_tokens[ev.request_id] += len(ev.token_ids)
                first_token.setdefault(ev.request_id, e)
            if ev.error:
                raise RuntimeError(f"request {ev.request_id} failed: {ev.error}")
    elapsed = time.perf_counter() - t0

    n_out = sum(out_tokens.values())
    n_prompt = sum(len(p) for p in prompts)
    prefill_done = max(first_token.values()) - t0 if first_token else elapsed
    result = {
        "load_seconds": engine.loaded.load_seconds,
        "engine_init_seconds": init_s,
        "prompt_tokens": n_prompt,
        "prompt_tokens_computed": engine.stats.num_prompt_tokens - prompt_tokens_before,
        "output_tokens": n_out,
        "expected_output_tokens": len(prompts) * args.max_tokens,
        "elapsed_seconds": elapsed,
        "output_tok_s": n_out / elapsed,
        "total_tok_s": (n_out + n_prompt) / elapsed,
        "prefill_seconds": prefill_done,
        "prefill_tok_s": n_prompt / prefill_done,
        "ttft_ms": percentiles([(t - t0) * 1e3 for t in first_token.values()]),
        "num_steps": engine.stats.num_steps - warm_steps,
        "step_ms": percentiles([x * 1e3 for x in step_s]),
        "decode_step_ms": percentiles([x * 1e3 for x in decode_step_s]),
        "num_decode_steps": len(decode_step_s),
        "mean_tokens_per_step": sum(tokens_per_step) / len(tokens_per_step) if tokens_per_step else 0.0,
        "num_preemptions": engine.stats.num_preemptions,
        "kv_cache_bytes": engine.kv.nbytes,
        "kv_used_peak_bytes": int(kv_peak * engine.kv.nbytes),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    del engine
    gc.collect()
    return result


def run_hf(gguf_path: str, prompts: list[list[int]], max_tokens: int, dtype: str, hf_batch: int,
           threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """The transformers side; runs in a child process (see `run`)."""
    import torch

    set_threads(threads)
    before = loadavg()
    model, load_s = load_hf(gguf_path, dtype, device)
    pad = hf_pad_id(model)
    hf_generate(model, [random_prompt(model.config.vocab_size, min(len(prompts[0]), 32), 1234)], 4, pad)  # warm-up
    batch = hf_batch or len(prompts)
    total = first = 0.0
    n_new = steps = 0
    batches = []
    for i in range(0, len(prompts), batch):
        r = hf_generate(model, prompts[i:i + batch], max_tokens, pad)
        # Prefill "done" for this batch at its first token; batches run one after another.
        first = total + r["first_token_s"]
        total += r["seconds"]
        n_new += r["new_tokens"]
        steps += r["steps"]
        batches.append(r)
    n_prompt = sum(len(p) for p in prompts)
    # With several batches, prefill time is the sum of each batch's time to first token.
    prefill_s = sum(b["first_token_s"] for b in batches) if len(batches) > 1 else first
    decode_s = sum(b["last_token_s"] - b["first_token_s"] for b in batches)
    return {
        "load_seconds": load_s,
        "dtype": dtype,
        "device": str(model.device),
        "batch_size": batch,
        "num_batches": len(batches),
        "torch_threads": torch.get_num_threads(),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "prompt_tokens": n_prompt,
        "output_tokens": n_new,
        "elapsed_seconds": total,
        "output_tok_s": n_new / total,
        "total_tok_s": (n_new + n_prompt) / total,
        "prefill_seconds": prefill_s,
        "prefill_tok_s": n_prompt / prefill_s,
        "decode_step_ms_mean": decode_s / max(1, steps - len(batches)) * 1e3,
        "peak_rss_bytes": peak_rss_bytes(),
        "loadavg_start": before,
        "loadavg_end": loadavg(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.store import resolve_model
    from tokenmill.tokenizer import Tokenizer
    from tokenmill.gguf import open_gguf

    for name in ("num_prompts", "prompt_len", "max_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    set_threads(args.threads)
    args.device = resolve_bench_device(args.device)
    gguf_path = str(resolve_model(args.model))
    tok = Tokenizer.from_gguf_metadata(open_gguf(gguf_path).metadata)
    prompts = corpus_prompts(tok.encode, args.num_prompts, args.prompt_len)
    del tok
    gc.collect()

    result: dict[str, Any] = {
        "benchmark": "offline",
        "model": gguf_path,
        "config": {k: getattr(args, k) for k in ("num_prompts", "prompt_len", "max_tokens", "dtype", "device",
                                                 "n_batch", "n_ubatch", "parallel", "max_total_tokens", "hf_batch",
                                                 "threads")},
        "env": environment(),
        "loadavg_start": loadavg(),
    }
    progress("tokenmill")
    result["tokenmill"] = run_tokenmill(gguf_path, prompts, args)
    result["loadavg_after_tokenmill"] = loadavg()
    if args.skip_hf:
        result["hf"] = None
    else:
        progress("transformers")
        # A fresh process, so its peak RSS is its own and the engine's memory does not linger.
        hf_dtype = args.hf_dtype or (args.dtype if args.dtype in ("bf16", "fp32") else
                                     "fp32" if args.device == "cpu" else "bf16")
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            result["hf"] = pool.submit(run_hf, gguf_path, prompts, args.max_tokens, hf_dtype,
                                       args.hf_batch, args.threads, args.device).result()
    result["loadavg_end"] = loadavg()
    tm, hf = result["tokenmill"], result["hf"] or {}
    result["ratio_tokenmill_over_hf"] = {k: ratio(tm.get(k), hf.get(k)) for k in ("output_tok_s", "prefill_tok_s",
                                                                                "total_tok_s")}
    return result


def report(r: dict[str, Any]) -> str:
    c, tm, hf, ra = r["config"], r["tokenmill"], r["hf"], r["ratio_tokenmill_over_hf"]
    mib = 1024 * 1024
    lines = [
        f"offline: {c['num_prompts']} prompts x {c['prompt_len']} tokens, {c['max_tokens']} new tokens each "
        f"(EOS ignored), {c['dtype']} on {c.get('device', 'cpu')}, n_batch={c['n_batch']}, parallel={c['parallel']}",
        f"model {r['model']}; torch {r['env']['torch']} threads={r['env']['torch_threads']}; "
        f"kernels {r['env']['kernels']}; cpu flags: {r['env']['cpu_flags']}",
        f"loadavg: start {r['loadavg_start']} | after tokenmill {r['loadavg_after_tokenmill']} | end {r['loadavg_end']}",
        "",
        f"{'':24}{'tokenmill':>14}{'transformers':>14}{'ratio':>8}",
    ]

    def row(label, a, b, nd=1, rat=None):
        lines.append(f"{label:24}{fmt(a, nd):>14}{fmt(b, nd):>14}{fmt(rat, 2) if rat is not None else '':>8}")

    hfg = (hf or {}).get
    row("load s", tm["load_seconds"], hfg("load_seconds"), 2)
    row("output tok/s", tm["output_tok_s"], hfg("output_tok_s"), 1, ra["output_tok_s"])
    row("prefill tok/s", tm["prefill_tok_s"], hfg("prefill_tok_s"), 1, ra["prefill_tok_s"])
    row("total tok/s", tm["total_tok_s"], hfg("total_tok_s"), 1, ra["total_tok_s"])
    row("elapsed s", tm["elapsed_seconds"], hfg("elapsed_seconds"), 2)
    row("output tokens", tm["output_tokens"], hfg("output_tokens"), 0)
    row("decode step ms (mean)", tm["decode_step_ms"]["mean"], hfg("decode_step_ms_mean"), 1)
    row("peak RSS MiB", tm["peak_rss_bytes"] / mib, (hfg("peak_rss_bytes") or 0) / mib if hf else None, 0)
    s, d = tm["step_ms"], tm["decode_step_ms"]
    lines += [
        "",
        f"tokenmill steps: {tm['num_steps']} ({tm['num_decode_steps']} decode-only), "
        f"{tm['mean_tokens_per_step']:.1f} tokens/step, preemptions {tm['num_preemptions']}",
        f"  step ms        p50 {s['p50']:.1f}  p95 {s['p95']:.1f}  p99 {s['p99']:.1f}  max {s['max']:.1f}",
        f"  decode step ms p50 {d['p50']:.1f}  p95 {d['p95']:.1f}  p99 {d['p99']:.1f}",
        f"  TTFT ms        p50 {tm['ttft_ms']['p50']:.0f}  p99 {tm['ttft_ms']['p99']:.0f}",
        f"  KV cache {tm['kv_cache_bytes'] / mib:.0f} MiB allocated, peak in use {tm['kv_used_peak_bytes'] / mib:.1f} MiB",
    ]
    if hf:
        lines.append(f"transformers: batch {hf['batch_size']} x {hf['num_batches']}, {hf['dtype']}, "
                     f"attn={hf['attn_implementation']}, loadavg {hf['loadavg_start']} -> {hf['loadavg_end']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "tokenmill bench offline") -> int:
    args = build_parser(prog).parse_args(argv)
    result = run(args)
    print(report(result), flush=True)
    write_json(args.json, result)
    return 0
