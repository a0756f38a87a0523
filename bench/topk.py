#!/usr/bin/env python
"""Sampling's top_k: the compiled kernel (kernels.topk) against torch.topk on the same float32 logits,
at the sampler's shapes: 64 sequences x SmolLM2's 49,152 vocabulary (k=40, Ollama's default, and 64),
one sequence at 49,152 and at Gemma 3's 262,144. The two sides are timed alternately in one process
(other work shares the cores) over the same few distinct tensors (so no branch history is learnt from
a repeated row); medians of per-call times, and the ratio torch / kernel (> 1: the kernel is faster).

    PYTHONPATH=src .venv/bin/python bench/topk.py [--threads 2] [--variant avx2] [--rounds 30]
    PYTHONPATH=src .venv/bin/python bench/topk.py --max-k 4096 --cases 64,49152,1024 1,262144,1024
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from tokenmill.kernels import native, topk
from tokenmill.kernels.topk import topk_rows, topk_rows_reference

CASES = [(64, 49152, 40), (64, 49152, 64), (1, 49152, 40), (1, 262144, 40)]
TENSORS = 4


def per_call(fn: Callable[[torch.Tensor], object], tensors: list[torch.Tensor], calls: int) -> float:
    start = time.perf_counter()
    for c in range(calls):
        fn(tensors[c % len(tensors)])
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", default=None, help="avx512 / avx2 / scalar (default: the best this CPU runs)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--cases", nargs="*", default=None, help="rows,cols,k triples, e.g. 64,49152,40")
    ap.add_argument("--max-k", type=int, default=None, help="raise the kernel's k limit (where does it stop paying?)")
    args = ap.parse_args()
    if args.max_k:
        topk.MAX_K = args.max_k
    torch.set_num_threads(args.threads)
    native.set_num_threads(args.threads)
    cases = [tuple(int(v) for v in c.split(",")) for c in args.cases] if args.cases else CASES
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    with native.use_variant(args.variant or native.variant()):
        print(f"variant {native.variant()}, {args.threads} threads, {args.rounds} rounds")
        print(f"cpu flags: {' '.join(flags)}")
        print(f"{'rows x cols':>14} {'k':>4} {'torch.topk us':>14} {'kernel us':>10} {'ratio':>6}")
        for rows, cols, k in cases:
            gen = torch.Generator().manual_seed(rows + cols + k)
            xs = [torch.randn(rows, cols, generator=gen) for _ in range(TENSORS)]
            assert all(torch.equal(topk_rows(x, k)[0], topk_rows_reference(x, k)[0]) for x in xs)
            calls = TENSORS * max(1, int(2e-3 / TENSORS / per_call(lambda x: topk_rows_reference(x, k), xs, TENSORS)))
            ours, theirs = [], []
            for _ in range(args.rounds):
                theirs.append(per_call(lambda x: topk_rows_reference(x, k), xs, calls))
                ours.append(per_call(lambda x: topk_rows(x, k), xs, calls))
            t, o = statistics.median(theirs) * 1e6, statistics.median(ours) * 1e6
            print(f"{f'{rows} x {cols}':>14} {k:>4} {t:>14.1f} {o:>10.1f} {t / o:>6.2f}")


if __name__ == "__main__":
    main()
