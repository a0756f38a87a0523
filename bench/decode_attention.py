#!/usr/bin/env python
"""Decode attention alone, compiled as the decode graph compiles it: --seqs sequences of --tokens
keys each, blocks scattered over a 64k-slot cache, SmolLM2's heads (9 query, 3 KV, dim 64), bf16.
Times the engine's formulation (attention.fused_decode_attention) against two rewrites, alternating
them in one process, and prints ms per layer and the K/V bytes read per second. A sum over 256 MB
(out of cache, as a real step's 30 layers of K/V are) shows what memory allows.

    .venv/bin/python bench/decode_attention.py --seqs 64 --tokens 272
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.bench.common import loadavg, set_threads
from tokenmill.model.attention import GraphDecodeMeta, fused_decode_attention

H, HKV, D, BS, SLOTS = 9, 3, 64, 16, 65536


def engine_form(q, k_cache, v_cache, k_blocks_t, block_ids, lens):
    return fused_decode_attention(q, k_cache, v_cache, GraphDecodeMeta.build(lens, block_ids, lens, BS))


def _softmax_pv(s, v_blocks, block_ids, lens, q):
    b, h, d = q.shape
    nb = block_ids.shape[1]
    pos = torch.arange(nb * BS, device=block_ids.device).view(nb, BS)
    s = s.masked_fill(~(pos[None] < lens[:, None, None])[None, :, None], float("-inf"))
    e = (s - s.amax((-1, -2), keepdim=True)).exp()
    o = (e[..., None] * v_blocks[:, :, None].float()).sum((3, 4)) / e.sum((-1, -2))[..., None]
    return o.to(q.dtype).transpose(0, 1).reshape(b, h, d)


def block_gather(q, k_cache, v_cache, k_blocks_t, block_ids, lens):
    """Gather whole blocks ([Hkv, B, nb, 16, D]) instead of single slots."""
    b, h, d = q.shape
    kb = k_cache.view(HKV, -1, BS, d)[:, block_ids]
    qg = (q.float() * d ** -0.5).view(b, HKV, h // HKV, d).transpose(0, 1)
    s = (qg[:, :, :, None, None, :] * kb[:, :, None].float()).sum(-1)
    return _softmax_pv(s, v_cache.view(HKV, -1, BS, d)[:, block_ids], block_ids, lens, q)


def k_transposed(q, k_cache, v_cache, k_blocks_t, block_ids, lens):
    """K stored [Hkv, blocks, D, 16], so the scores vectorise over a block's 16 positions."""
    b, h, d = q.shape
    kt = k_blocks_t[:, block_ids]
    qg = (q.float() * d ** -0.5).view(b, HKV, h // HKV, d).transpose(0, 1)
    s = (qg[:, :, :, None, :, None] * kt[:, :, None].float()).sum(-2)
    return _softmax_pv(s, v_cache.view(HKV, -1, BS, d)[:, block_ids], block_ids, lens, q)


FORMS = {"engine": engine_form, "block-gather": block_gather, "k-transposed": k_transposed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--tokens", type=int, default=272, help="keys per sequence (a multiple of 16)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    set_threads(args.threads)
    nb = -(-args.tokens // BS)
    k_cache = torch.randn(HKV, SLOTS, D).bfloat16()
    v_cache = torch.randn(HKV, SLOTS, D).bfloat16()
    k_blocks_t = k_cache.view(HKV, SLOTS // BS, BS, D).transpose(2, 3).contiguous()
    block_ids = torch.randperm(SLOTS // BS)[:args.seqs * nb].view(args.seqs, nb)
    lens = torch.full((args.seqs,), args.tokens)
    q = torch.randn(args.seqs, H, D).bfloat16()
    inputs = (q, k_cache, v_cache, k_blocks_t, block_ids, lens)
    ref = engine_form(*inputs).float()
    compiled = {}
    for name, fn in FORMS.items():
        f = torch.compile(fn, dynamic=False)
        for t in (q, block_ids, lens):
            torch._dynamo.mark_dynamic(t, 0, min=2, max=512)
        torch._dynamo.mark_dynamic(block_ids, 1, min=2, max=256)
        err = (f(*inputs).float() - ref).abs().max().item()
        if err > 0.05:
            raise SystemExit(f"{name} disagrees with the engine's form: max diff {err}")
        compiled[name] = f
    kv_bytes = 2 * HKV * args.seqs * nb * BS * D * 2
    stream = torch.ones(128 << 20, dtype=torch.bfloat16)  # 256 MB
    times: dict[str, list[float]] = {name: [] for name in compiled}
    stream_s: list[float] = []
    for _ in range(args.rounds):
        for name, f in compiled.items():
            f(*inputs)
            start = time.perf_counter()
            for _ in range(10):
                f(*inputs)
            times[name].append((time.perf_counter() - start) / 10)
        start = time.perf_counter()
        stream.sum()
        stream_s.append(time.perf_counter() - start)
    print(f"decode attention: {args.seqs} seqs x {args.tokens} keys, {kv_bytes / 1e6:.1f} MB of K/V per layer; "
          f"torch threads {torch.get_num_threads()}; loadavg {loadavg()}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"  {name:22} {t * 1e3:7.3f} ms/layer  {kv_bytes / t / 1e9:5.1f} GB/s")
    bandwidth = stream.numel() * 2 / statistics.median(stream_s)
    print(f"  memory: {bandwidth / 1e9:.1f} GB/s streaming 256 MB, so {kv_bytes / bandwidth * 1e3:.3f} ms/layer "
          f"to read the K/V once")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
