#!/usr/bin/env python
"""What sampling settings cost a decode step: --batch requests of --prompt-len tokens decode with each
setting in turn (greedy first, the baseline), and the median step is printed with its difference from
greedy. The settings are the common defaults: OpenAI's (temperature 1), Ollama's (0.8, top_k 40,
top_p 0.9, repeat_penalty 1.1 over the last 64 tokens), a plain nucleus (0.7, top_p 0.95), and
OpenAI's with logprobs and the top 5 alternatives. No seeds.

    .venv/bin/python bench/sampling.py [--batch 64] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

from tokenmill.bench.common import corpus_prompts, cpu_flags, loadavg, set_threads
from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams
from tokenmill.store import resolve_model

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1 (OpenAI)": dict(temperature=1.0),
    "0.8, top_k 40, top_p 0.9": dict(temperature=0.8, top_k=40, top_p=0.9),
    "the same, repeat_penalty 1.1 (Ollama)": dict(temperature=0.8, top_k=40, top_p=0.9, repeat_penalty=1.1,
                                                  repeat_last_n=64),
    "0.7, top_p 0.95": dict(temperature=0.7, top_p=0.95),
    "1.0, min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "temperature 1, logprobs, top_logprobs 5": dict(temperature=1.0, logprobs=True, top_logprobs=5),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", help="comma-separated settings to run besides greedy (substrings of their names)")
    p.add_argument("--speculative", default="off",
                   help="the engine's speculative decoding (off by default here: a step that verifies proposals "
                        "has more rows than --batch, and greedy and sampled rows accept differently)")
    args = p.parse_args()
    set_threads(args.threads)
    engine = LLMEngine.from_path(resolve_model(args.model), EngineConfig(parallel=max(64, args.batch),
                                                                         speculative=args.speculative))
    print(f"cpu flags: {cpu_flags()}; loadavg {loadavg()}")
    base = None
    for name, kw in SETTINGS.items():
        if args.only and name != "greedy" and not any(w in name for w in args.only.split(",")):
            continue
        params = SamplingParams(max_tokens=args.steps, ignore_eos=True, **kw)
        for ids in corpus_prompts(engine.tokenizer.encode, args.batch, args.prompt_len):
            engine.add_request(ids, params)
        while any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        times = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        step = statistics.median(times[3:-3]) * 1e3
        base = step if base is None else base
        print(f"{name:36} {step:7.1f} ms a step  ({step - base:+.1f} ms against greedy)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
