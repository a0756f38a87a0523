#!/usr/bin/env python
"""Prompt processing: one prompt of --prompt-len tokens (corpus text), prefilled in one step and a
single sampled token, repeated; prints tok/s (median and best after one warm-up run). The analogue
of llama-bench's pp512. On the PyTorch path steps are compiled, as `tokenmill serve` runs them, unless --no-compile.

    .venv/bin/python bench/prefill.py --prompt-len 512
"""
from __future__ import annotations

import argparse
import statistics
import time

from tokenmill.bench.common import corpus_prompts, loadavg, set_threads
from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams
from tokenmill.store import resolve_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=["auto", "gguf", "bf16", "fp32"], default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-compile", action="store_true", help="eager steps (the server compiles by default)")
    args = p.parse_args()
    set_threads(args.threads)
    engine = LLMEngine.from_path(resolve_model(args.model),
                                 EngineConfig(dtype=args.dtype, enable_prefix_caching=False,
                                              compile=not args.no_compile,
                                              n_batch=max(512, args.prompt_len), n_ubatch=max(512, args.prompt_len)))
    n = args.prompt_len
    prompt = sum(corpus_prompts(engine.tokenizer.encode, -(-n // 100) + 1, 100), [])[:n]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for _ in range(args.repeats + 1):
        engine.add_request(prompt, params)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - start)
    times = times[1:]
    print(f"prefill {n} tokens: {n / statistics.median(times):.0f} tok/s median, {n / min(times):.0f} best "
          f"({args.repeats} runs; loadavg {loadavg()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
