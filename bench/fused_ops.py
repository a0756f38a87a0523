#!/usr/bin/env python
"""The fused small ops (kernels.fused) against the eager PyTorch sequences they replace, at SmolLM2-135M
and Gemma 3 270M shapes, one row (a single sequence decoding) and 512 rows (a prefill chunk), fp32.
Each pair is timed alternately in the same run (other work shares the cores), and the ratio
eager / fused is printed (> 1: the fused op is faster).

    PYTHONPATH=src .venv/bin/python bench/fused_ops.py [--threads 2] [--variant avx2] [--rows 1 512]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tokenmill.kernels import fused, native
from tokenmill.model.layers import RMSNorm, RotaryEmbedding

# name: (dim, q heads, kv heads, head_dim, ffn, gemma)
MODELS = {"smollm2": (576, 9, 3, 64, 1536, False), "gemma3": (640, 4, 1, 256, 2048, True)}
MAX_POSITIONS = 8192


def _norm(dim: int, *, weight_in_float32: bool) -> RMSNorm:
    layer = RMSNorm(dim, 1e-6, weight_in_float32=weight_in_float32)
    layer.weight.data.copy_(torch.rand(dim) + 0.5)
    return layer


def cases(model: str, rows: int) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(op, fused call, the eager sequence it replaces), on inputs shaped as in the model."""
    dim, n_q, n_kv, hd, ffn, gemma = MODELS[model]
    norm = _norm(dim, weight_in_float32=gemma)
    x, attn_out = torch.randn(rows, dim), torch.randn(rows, dim)
    residual = torch.randn(rows, dim)
    rope = RotaryEmbedding(hd, 10_000.0, MAX_POSITIONS)
    positions = torch.randint(0, MAX_POSITIONS, (rows,))
    at = rope.at(positions, torch.float32)  # once per step in the model, not per layer
    cos, sin = at.cos, at.sin
    qkv = torch.randn(rows, (n_q + 2 * n_kv) * hd)
    qk = qkv[:, :(n_q + n_kv) * hd].view(rows, n_q + n_kv, hd)
    gate_up = torch.randn(rows, 2 * ffn)

    def eager_add_norm():
        y = residual + attn_out
        return norm(y)

    out = [
        ("rms_norm", lambda: fused.rms_norm(x, norm.weight, norm.eps), lambda: norm(x)),
        ("add_rms_norm", lambda: fused.add_rms_norm(attn_out, residual, norm.weight, norm.eps), eager_add_norm),
        ("rope_qk", lambda: fused.rope_qk(qk, positions, rope.cos, rope.sin),
         lambda: RotaryEmbedding.apply(qk, cos, sin)),
    ]
    if gemma:
        q_norm, k_norm = _norm(hd, weight_in_float32=True), _norm(hd, weight_in_float32=True)
        # The fused op works in place, so it normalises its own output again on every call: weights
        # other than 1 would shrink some dims geometrically into (slow) denormals.
        q_norm.weight.data.fill_(1.0)
        k_norm.weight.data.fill_(1.0)

        def eager_head_norm_rope():
            both = torch.cat([q_norm(qk[:, :n_q]), k_norm(qk[:, n_q:])], dim=1)
            return RotaryEmbedding.apply(both, cos, sin)

        out.append(("head_rms_norm_rope",
                    lambda: fused.head_rms_norm_rope(qk, n_q, q_norm.weight, k_norm.weight, 1e-6, positions,
                                                     rope.cos, rope.sin),
                    eager_head_norm_rope))

        def eager_gelu():
            gate, up = gate_up.split(ffn, dim=-1)
            return F.gelu(gate, approximate="tanh") * up

        out.append(("gelu_tanh_mul", lambda: fused.gelu_tanh_mul(gate_up), eager_gelu))
    else:
        def eager_silu():
            gate, up = gate_up.split(ffn, dim=-1)
            return F.silu(gate) * up

        out.append(("silu_mul", lambda: fused.silu_mul(gate_up), eager_silu))
    return out


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def compare(fused_fn, eager_fn, rows: int, rounds: int) -> tuple[float, float]:
    """Median over rounds of the mean per-call time, fused and eager alternating round by round."""
    calls = 200 if rows == 1 else 20
    for fn in (fused_fn, eager_fn):
        per_call_us(fn, calls)  # warm up
    f, e = [], []
    for _ in range(rounds):
        f.append(per_call_us(fused_fn, calls))
        e.append(per_call_us(eager_fn, calls))
    return statistics.median(f), statistics.median(e)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variant", default=None, help="avx512, avx2, scalar or torch (default: the best built)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 512])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    native.set_num_threads(args.threads)
    with native.use_variant(args.variant or native.variant()):
        print(f"kernels: {native.describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(f"{'model':8} {'rows':>4}  {'op':20} {'fused us':>9} {'eager us':>9} {'eager/fused':>11}")
        for model in MODELS:
            for rows in args.rows:
                torch.manual_seed(0)
                for op, fused_fn, eager_fn in cases(model, rows):
                    f, e = compare(fused_fn, eager_fn, rows, args.rounds)
                    print(f"{model:8} {rows:4}  {op:20} {f:9.2f} {e:9.2f} {e / f:10.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
