#!/usr/bin/env python
"""The compiled paged-attention kernel (kernels.attention.paged_attention) on decode and prefill.

Decode: --seqs sequences, one query row each, at each --contexts length, blocks scattered over the
cache; reports the K/V bytes read per second against this machine's read speed (a torch sum over
512 MB, timed in the same rounds as the kernel: read speed on these shared machines swings 2x from
minute to minute), alternating with today's eager decode (model.attention.decode_attention).
Prefill: one --prefill-token chunk with no earlier context, against today's paths on the same data
(scaled_dot_product_attention with enable_gqa, and causal_pieces, which the engine uses from 512
tokens), alternating. Shapes: SmolLM2 (9 q heads, 3 kv heads, dim 64) and Gemma 3 270M (4, 1, 256);
caches f16 (the default), bf16 and int8. Timings are medians; ratios compare runs interleaved in this process. On a
shared machine the wall-clock fraction of read speed mostly measures time slicing, so decode also
reports bytes per CPU-second (all threads) against the sum's.

    PYTHONPATH=src .venv/bin/python bench/paged_attention.py --threads 2
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F

from tokenmill.bench.common import cpu_flags, cpu_model
from tokenmill.engine.config import EngineConfig
from tokenmill.kernels import native
from tokenmill.kernels.attention import paged_attention, write_kv
from tokenmill.model.attention import DecodeGroup, causal_pieces, decode_attention

BLOCK_SIZE = EngineConfig.block_size  # tokens per KV block: the engine's default (--block-size)
SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}


def timed(fn, reps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call; CPU time sums all threads of this process."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps, (time.process_time() - c0) / reps


def alternate(fns: dict, rounds: int, reps: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds per call of each fn, measured round-robin so load noise hits all alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timed(fn, reps))
    return {name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for name, t in times.items()}


@functools.cache
def read_buffer() -> torch.Tensor:
    """512 MB, well out of cache; made on first use, so a prefill-only run never pays for it."""
    return torch.ones(128 << 20)


def read_sum() -> None:
    read_buffer().sum()


def read_gbs(wall_cpu: tuple[float, float]) -> tuple[float, float]:
    """GB/s of read_sum from its (wall, CPU) seconds: per wall second, and per CPU second."""
    n = read_buffer().numel() * 4
    return n / wall_cpu[0] / 1e9, n / wall_cpu[1] / 1e9


def make_cache(h_kv: int, d: int, num_blocks: int, dtype: torch.dtype, bs: int):
    slots = num_blocks * bs
    k_cache = torch.empty(h_kv, slots, d, dtype=dtype)
    v_cache = torch.empty(h_kv, slots, d, dtype=dtype)
    scales = (torch.empty(h_kv, slots), torch.empty(h_kv, slots)) if dtype == torch.int8 else (torch.empty(0),) * 2
    # Fill through write_kv so int8 values and scales are realistic; 64k slots at a time.
    for s0 in range(0, slots, 65536):
        n = min(65536, slots - s0)
        write_kv(torch.randn(n, h_kv, d), torch.randn(n, h_kv, d), k_cache, v_cache, *scales,
                 torch.arange(s0, s0 + n))
    return k_cache, v_cache, scales


def bench_decode(name, dtype, seqs, context, rounds, bs):
    h, h_kv, d = SHAPES[name]
    blocks_per_seq = -(-context // bs)
    num_blocks = seqs * blocks_per_seq + 1
    k_cache, v_cache, (k_scale, v_scale) = make_cache(h_kv, d, num_blocks, dtype, bs)
    tables = (torch.randperm(num_blocks - 1)[:seqs * blocks_per_seq] + 1).view(seqs, blocks_per_seq).to(torch.int32)
    q = torch.randn(seqs, h, d)
    cu = torch.arange(seqs + 1, dtype=torch.int32)
    start = torch.full((seqs,), context - 1, dtype=torch.int32)
    scale = d ** -0.5
    fns = {"kernel": lambda: paged_attention(q, k_cache, v_cache, k_scale, v_scale, cu, start, tables, bs, scale),
           "read": read_sum}
    if dtype != torch.int8:
        group = DecodeGroup(slice(0, seqs), tables.view(-1).long(), seqs, blocks_per_seq, None)
        qd = q.to(dtype)
        fns["torch"] = lambda: decode_attention(qd, k_cache, v_cache, group, bs, scale)
    both = alternate(fns, rounds, 3)
    t = {name: wall for name, (wall, _) in both.items()}
    mem_gbs = read_gbs(both["read"])
    elem = k_cache.element_size()
    bytes_read = 2 * seqs * context * h_kv * (d * elem + (4 if dtype == torch.int8 else 0))
    gbs, gbs_cpu = bytes_read / t["kernel"] / 1e9, bytes_read / both["kernel"][1] / 1e9
    line = (f"decode  {name:8s} {str(dtype).split('.')[-1]:9s} {seqs:3d} seqs x {context:5d}: kernel {t['kernel'] * 1e3:7.2f} ms "
            f"{gbs:5.1f} GB/s = {gbs / mem_gbs[0]:4.0%} of read speed ({mem_gbs[0]:4.1f}); per CPU-second {gbs_cpu:5.1f} GB/s = "
            f"{gbs_cpu / mem_gbs[1]:4.0%} of the sum's")
    if "torch" in t:
        line += f" | torch decode {t['torch'] * 1e3:7.2f} ms ({t['torch'] / t['kernel']:.2f}x kernel)"
    print(line, flush=True)


def bench_prefill(name, dtype, tokens, rounds, bs):
    h, h_kv, d = SHAPES[name]
    blocks = -(-tokens // bs)
    k_cache, v_cache, (k_scale, v_scale) = make_cache(h_kv, d, blocks + 8, dtype, bs)
    tables = (torch.randperm(blocks + 7)[:blocks] + 1).view(1, blocks).to(torch.int32)
    q = torch.randn(tokens, h, d)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    start = torch.zeros(1, dtype=torch.int32)
    scale = d ** -0.5
    # Today's path attends the chunk's fresh K/V (no earlier context): same values, token-major.
    pos = torch.arange(tokens)
    slots = tables[0].long()[pos // bs] * bs + pos % bs
    deq = (lambda c, s: c[:, slots].float() * s[:, slots, None]) if dtype == torch.int8 else (lambda c, s: c[:, slots])
    act = torch.bfloat16
    k_fresh, v_fresh = deq(k_cache, k_scale).to(act), deq(v_cache, v_scale).to(act)   # [Hkv, T, D]
    q_act = q.to(act)
    out = torch.empty(tokens, h, d, dtype=act)

    def sdpa():
        F.scaled_dot_product_attention(q_act.transpose(0, 1)[None], k_fresh[None], v_fresh[None], is_causal=True,
                                       scale=scale, enable_gqa=True)

    fns = {"kernel": lambda: paged_attention(q, k_cache, v_cache, k_scale, v_scale, cu, start, tables, bs, scale),
           "sdpa": sdpa,
           "pieces": lambda: causal_pieces(q_act, k_fresh, v_fresh, scale, out)}
    t = {name: wall for name, (wall, _) in alternate(fns, rounds, 2).items()}
    flops = 4 * h * d * tokens * (tokens + 1) / 2
    print(f"prefill {name:8s} {str(dtype).split('.')[-1]:9s} {tokens:5d} tokens: kernel {t['kernel'] * 1e3:7.2f} ms "
          f"({flops / t['kernel'] / 1e9:5.1f} GF/s) | sdpa bf16 {t['sdpa'] * 1e3:7.2f} ms ({t['sdpa'] / t['kernel']:.2f}x kernel)"
          f" | causal_pieces bf16 {t['pieces'] * 1e3:7.2f} ms ({t['pieces'] / t['kernel']:.2f}x kernel)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["f16", "bf16", "int8"], choices=["f16", "bf16", "int8", "fp32"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                   help="tokens per KV block (a block's keys of one head are contiguous; the blocks of a sequence are scattered)")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-prefill", action="store_true")
    args = p.parse_args()
    bs = args.block_size
    torch.set_num_threads(args.threads)
    native.set_num_threads(args.threads)
    dtypes = {"f16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8, "fp32": torch.float32}
    print(f"cpu: {cpu_model()}; flags: {cpu_flags()}")
    print(f"kernel variant: {native.describe()}; torch threads {torch.get_num_threads()}; block size {bs}")
    print(f"read speed: a torch sum over 512 MB, in the same rounds as each decode case (on a shared machine "
          f"the CPU-time ratios are the steadier ones); load average {os.getloadavg()[0]:.1f}")
    for name in args.shapes:
        for dt in args.dtypes:
            if not args.skip_decode:
                for ctx in args.contexts:
                    bench_decode(name, dtypes[dt], args.seqs, ctx, args.rounds, bs)
            if not args.skip_prefill:
                bench_prefill(name, dtypes[dt], args.prefill_tokens, args.rounds, bs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
