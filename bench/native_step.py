#!/usr/bin/env python
"""The native decoder step (model/native_step.py) against the per-op path it replaces, on a real
model driven directly (no engine): --seqs sequences of --context tokens, then decode steps with the
output head, alternating the two paths in one process so machine drift hits both. Prints the median
step time of each and their ratio.

    PYTHONPATH=src .venv/bin/python bench/native_step.py --model smollm2 --seqs 1 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.bench.common import cpu_flags, loadavg, set_threads
from tokenmill.kernels import native
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model import ChunkSpec, load_model, native_step
from tokenmill.model.paged_batch import PagedBatch
from tokenmill.store import resolve_model

BLOCK = 16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--seqs", type=int, default=1)
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--steps", type=int, default=20, help="decode steps per timed round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    set_threads(args.threads)
    model = load_model(resolve_model(args.model), "gguf").model
    cfg = model.config
    per_seq = -(-(args.context + args.rounds * args.steps * 2 + 8) // BLOCK)
    kv = KVStorage(cfg.n_layers, per_seq * args.seqs, BLOCK, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16, lazy=True)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(args.seqs)]
    gen = torch.Generator().manual_seed(0)
    pos = args.context
    with torch.inference_mode():
        for table in tables:
            ids = torch.randint(100, 5000, (args.context,), generator=gen)
            model(ids, torch.arange(args.context), PagedBatch.build([ChunkSpec(table, 0, args.context)], BLOCK), kv)

        def step() -> None:
            nonlocal pos
            meta = PagedBatch.build([ChunkSpec(t, pos, 1) for t in tables], BLOCK)
            h = model(torch.randint(100, 5000, (args.seqs,), generator=gen), torch.full((args.seqs,), pos), meta, kv)
            model.logits(h)
            pos += 1

        times: dict[str, list[float]] = {"native step": [], "per-op": []}
        for _ in range(args.rounds):
            for name in times:
                with native_step.disabled() if name == "per-op" else torch.inference_mode():
                    step()  # untimed: the first step after a switch
                    t = time.perf_counter()
                    for _ in range(args.steps - 1):
                        step()
                    times[name].append((time.perf_counter() - t) / (args.steps - 1))
    print(f"{args.model}: {args.seqs} sequences at ~{args.context} tokens, decode steps with the head; "
          f"kernels {native.variant()}, threads {torch.get_num_threads()}; cpu flags: {cpu_flags()}; "
          f"loadavg {loadavg()}")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, m in med.items():
        print(f"  {name:12} {m * 1e3:7.2f} ms/step  {args.seqs / m:8.1f} tok/s")
    print(f"  per-op / native step: {med['per-op'] / med['native step']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
