#!/usr/bin/env python
"""Profile engine decode steps at a given batch size with torch.profiler.

Fills the engine with --batch requests of --prompt-len tokens, runs until every request is past its
prefill (plus a few warm decode steps), then profiles --steps decode steps and prints the ops by
self CPU time, as a share of the profiled wall time.

    .venv/bin/python bench/profile_step.py --batch 64
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tokenmill.bench.common import corpus_prompts, loadavg, set_threads
from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams
from tokenmill.engine.config import KV_DTYPES
from tokenmill.store import resolve_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--dtype", choices=["auto", "gguf", "bf16", "fp32"], default="auto")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto", help="KV cache dtype (the server's --kv-dtype)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warm-steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens per KV cache block")
    p.add_argument("--compile", action="store_true", help="decode through the compiled graphs (the server default)")
    p.add_argument("--kernel-profile", action="store_true",
                   help="with --compile: name each inductor kernel in the profile (compiles graphs of its own)")
    p.add_argument("--trace", metavar="PATH", help="also write a Chrome trace")
    p.add_argument("--native-phases", action="store_true",
                   help="time the native decoder step's phases (matmuls, attention, ...) instead of torch.profiler")
    p.add_argument("--speculative", default="off",
                   help="the engine's speculative decoding (off by default here, so that every profiled step has "
                        "--batch rows: with prompt lookup a step may verify proposals, and a request may end early)")
    args = p.parse_args()
    set_threads(args.threads)
    if args.kernel_profile:
        torch._inductor.config.cpp.enable_kernel_profile = True

    engine = LLMEngine.from_path(resolve_model(args.model), EngineConfig(dtype=args.dtype, kv_dtype=args.kv_dtype,
                                                                                parallel=max(64, args.batch),
                                                                                compile=args.compile,
                                                                                block_size=args.block_size,
                                                                                speculative=args.speculative))
    params = SamplingParams(max_tokens=args.warm_steps + args.steps + 50, temperature=0, ignore_eos=True)
    for ids in corpus_prompts(engine.tokenizer.encode, args.batch, args.prompt_len):
        engine.add_request(ids, params)
    while any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(args.warm_steps):
        engine.step()
    print(f"batch {len(engine.scheduler.running)} decoding; torch threads {torch.get_num_threads()}; "
          f"loadavg {loadavg()}")

    plain = []
    for _ in range(args.steps):
        s = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - s)
    print("unprofiled decode step ms:", " ".join(f"{x * 1e3:.1f}" for x in plain))

    if args.native_phases:
        return native_phases(engine, args.steps)

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            with record_function("engine.step"):
                engine.step()
        wall = time.perf_counter() - t0
    print(f"profiled {args.steps} steps: {wall / args.steps * 1e3:.1f} ms/step (profiler overhead included)")

    events = [e for e in prof.key_averages() if e.key != "engine.step"]
    total_us = wall * 1e6
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"\n{'op':44}{'self ms/step':>13}{'% of step':>10}{'calls/step':>11}")
    for e in events[:args.rows]:
        print(f"{e.key[:43]:44}{e.self_cpu_time_total / 1e3 / args.steps:13.2f}"
              f"{100 * e.self_cpu_time_total / total_us:10.1f}{e.count / args.steps:11.0f}")
    covered = sum(e.self_cpu_time_total for e in events)
    print(f"{'(all ops, self time)':44}{covered / 1e3 / args.steps:13.2f}{100 * covered / total_us:10.1f}")
    print("\nby input shape (top 12):")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12,
                                                             max_name_column_width=30, max_shapes_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    print(f"loadavg {loadavg()}")
    return 0




def native_phases(engine: LLMEngine, steps: int) -> int:
    """Where a step's time goes inside the native decoder step, and outside it (the output head,
    sampling, the scheduler, Python)."""
    native_steps = engine.runner.model.native_steps.built()
    if not native_steps:
        print("the native decoder step is not in use (no native kernels, or a dense model)")
        return 1
    for s in native_steps:
        s.set_profiling(True)
        s.take_profile()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    phases: dict[str, float] = {}
    for s in native_steps:
        s.set_profiling(False)
        for name, sec in s.take_profile().items():
            phases[name] = phases.get(name, 0.0) + sec / steps
    phases["outside the layers (head, sampling, scheduler)"] = wall - sum(phases.values())
    print(f"\n{steps} steps: {wall * 1e3:.2f} ms/step")
    print(f"{'phase':48}{'ms/step':>9}{'% of step':>10}")
    for name, sec in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"{name:48}{sec * 1e3:9.2f}{100 * sec / wall:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
