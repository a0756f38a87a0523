#!/usr/bin/env python
"""The Triton kernels of tokenmill.kernels.gpu against their PyTorch references on a CUDA device, at
the shapes the engine runs: SmolLM2-135M (9 query heads, 3 KV heads, dim 64) and Gemma 3 270M (4, 1,
256; its sliding layers' window 512), bf16 caches of 16-token blocks scattered over the cache.

For each shape it prints the kernel's time, the reference's, the largest difference between them, and
for decode the K/V bytes read per second; then whether a decode row is bitwise the same alone as in
a batch of 64. Each op runs alone (no CUDA graph), so small shapes mostly show launch cost. Without a
CUDA device or triton it says so and exits 0.

    .venv/bin/python bench/gpu_kernels.py            # every shape, ~1-2 minutes on an H100
    .venv/bin/python bench/gpu_kernels.py --quick    # batch 1 and 64, contexts 128 and 2048
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch

from tokenmill.kernels.gpu import (apply_token_bitmask, apply_token_bitmask_reference, force, kv_write,
                                   kv_write_reference, paged_decode_attention, paged_decode_attention_reference,
                                   paged_prefill_attention, paged_prefill_attention_reference, triton_available)

BLOCK = 16
DEVICE = "cuda"  # --device cpu: a dry run of this script (the ops take their references there)


@dataclass(frozen=True)
class Model:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int = 0


MODELS = [Model("smollm2-135m", 9, 3, 64), Model("gemma3-270m", 4, 1, 256),
          Model("gemma3-270m/sliding", 4, 1, 256, window=512)]


def timed(fn, reps: int) -> float:
    """Median seconds per call over `reps` calls, after a warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if DEVICE != "cuda":
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def paged_cache(model: Model, batch: int, context: int):
    """Caches holding batch * context tokens in shuffled blocks, and each sequence's block table."""
    per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * per_seq + 1
    shape = (model.kv_heads, num_blocks * BLOCK, model.head_dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks, device=DEVICE)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    return k_cache, v_cache, tables


def row(*cells) -> str:
    widths = (20, 6, 8, 11, 11, 9, 10)
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def bench_decode(models, batches, contexts, reps) -> None:
    print("\npaged decode attention (8 parts per sequence and kv head)")
    print(row("model", "batch", "context", "triton ms", "ref ms", "max diff", "K/V GB/s"))
    for model in models:
        for batch in batches:
            for context in contexts:
                if model.window and context <= model.window:
                    continue
                k_cache, v_cache, tables = paged_cache(model, batch, context)
                q = torch.randn(batch, model.heads, model.head_dim, device=DEVICE, dtype=torch.bfloat16)
                lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
                args = (q, k_cache, v_cache, tables, lens, model.head_dim ** -0.5, model.window)
                fast = lambda: paged_decode_attention(*args, block_size=BLOCK)  # noqa: E731
                slow = lambda: paged_decode_attention_reference(*args, block_size=BLOCK)  # noqa: E731
                t_fast = timed(fast, reps)
                t_slow = timed(slow, max(1, reps // 10))
                diff = (fast().float() - slow().float()).abs().max().item()
                keys = min(context, model.window or context)
                kv_bytes = 2 * batch * keys * model.kv_heads * model.head_dim * 2
                print(row(model.name, batch, context, f"{t_fast * 1e3:.3f}", f"{t_slow * 1e3:.2f}", f"{diff:.4f}",
                          f"{kv_bytes / t_fast / 1e9:.0f}"))
                del k_cache, v_cache


def bench_prefill(models, reps) -> None:
    print("\npaged prefill attention (new rows over the cache)")
    print(row("model", "seqs", "cached+new", "triton ms", "ref ms", "max diff", ""))
    for model in models:
        for seqs, cached, new in ((1, 0, 100), (64, 0, 100), (1, 0, 2048), (8, 1024, 256)):
            if model.window and cached + new <= model.window:
                continue
            k_cache, v_cache, tables = paged_cache(model, seqs, cached + new)
            q = torch.randn(seqs * new, model.heads, model.head_dim, device=DEVICE, dtype=torch.bfloat16)
            cu = torch.arange(0, seqs * new + 1, new, device=DEVICE, dtype=torch.int32)
            lens = torch.full((seqs,), cached + new, device=DEVICE, dtype=torch.int32)
            args = (q, k_cache, v_cache, tables, cu, lens, model.head_dim ** -0.5, model.window)
            fast = lambda: paged_prefill_attention(*args, block_size=BLOCK)  # noqa: E731
            slow = lambda: paged_prefill_attention_reference(*args, block_size=BLOCK)  # noqa: E731
            t_fast = timed(fast, reps)
            t_slow = timed(slow, max(1, reps // 10))
            diff = (fast().float() - slow().float()).abs().max().item()
            print(row(model.name, seqs, f"{cached}+{new}", f"{t_fast * 1e3:.3f}", f"{t_slow * 1e3:.2f}", f"{diff:.4f}",
                      ""))


def bench_small_ops(reps) -> None:
    print("\nKV write (SmolLM2 layer) and token bitmask (49,152-token vocabulary)")
    print(row("op", "rows", "", "triton ms", "ref ms", "max diff", ""))
    model = MODELS[0]
    for rows in (1, 64, 256, 6400):
        k_cache, v_cache, _ = paged_cache(model, 1, rows + 16)
        k = torch.randn(rows, model.kv_heads, model.head_dim, device=DEVICE, dtype=torch.bfloat16)
        slots = torch.randperm(k_cache.shape[1], device=DEVICE)[:rows]
        fast = lambda: kv_write(k, k, k_cache, v_cache, slots)  # noqa: E731
        slow = lambda: kv_write_reference(k, k, k_cache, v_cache, slots)  # noqa: E731
        t_fast, t_slow = timed(fast, reps), timed(slow, reps)
        print(row("kv_write", rows, "", f"{t_fast * 1e3:.3f}", f"{t_slow * 1e3:.3f}", "", ""))
    vocab = 49152
    for rows in (1, 64, 256):
        logits = torch.randn(rows, vocab, device=DEVICE)
        mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, vocab // 32), device=DEVICE, dtype=torch.int32)
        fast = lambda: apply_token_bitmask(logits.clone(), mask)  # noqa: E731
        slow = lambda: apply_token_bitmask_reference(logits.clone(), mask)  # noqa: E731
        got, want = logits.clone(), logits.clone()
        apply_token_bitmask(got, mask)
        apply_token_bitmask_reference(want, mask)
        same = "equal" if torch.equal(got, want) else "DIFFER"
        t_fast, t_slow = timed(fast, reps), timed(slow, reps)
        print(row("token_bitmask", rows, "", f"{t_fast * 1e3:.3f}", f"{t_slow * 1e3:.3f}", same, ""))


def check_batch_invariance() -> None:
    model = MODELS[0]
    k_cache, v_cache, tables = paged_cache(model, 64, 1000)
    q = torch.randn(64, model.heads, model.head_dim, device=DEVICE, dtype=torch.bfloat16)
    lens = torch.randint(1, 1000, (64,), device=DEVICE, dtype=torch.int32)
    scale = model.head_dim ** -0.5
    batch = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, block_size=BLOCK)
    same = all(torch.equal(paged_decode_attention(q[b:b + 1], k_cache, v_cache, tables[b:b + 1], lens[b:b + 1], scale,
                                                  block_size=BLOCK)[0], batch[b]) for b in range(64))
    print(f"\nbatch invariance: each of 64 decode rows alone == in the batch: {same}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a dry run of this script's code (the ops run their references)")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: these are GPU kernels; nothing to time here")
        return 0
    if not triton_available():
        print("triton is not installed: the ops would run their references; nothing to compare")
        return 0
    started = time.perf_counter()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU dry run"
    print(f"{name}; torch {torch.__version__}; triton "
          f"{__import__('triton').__version__}; bf16 caches, block size {BLOCK}")
    batches = (1, 64) if args.quick else (1, 64, 256)
    contexts = (128, 2048) if args.quick else (128, 512, 2048)
    with force("auto"):
        bench_decode(MODELS, batches, contexts, args.reps)
        bench_prefill(MODELS, args.reps)
        bench_small_ops(args.reps)
        check_batch_invariance()
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
