#!/usr/bin/env python
"""The matmul floor of one SmolLM2 decode step: the 121 oneDNN-packed bf16 products of a step at
--rows rows (30 layers of qkv, o, gate_up, down, plus the output head), with 30 distinct weight sets
and with one set reused 30 times (hot in cache). Nothing else of the step runs.

    .venv/bin/python bench/linear_floor.py --rows 64
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenmill.bench.common import set_threads

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M per layer
LAYERS, VOCAB, DIM = 30, 49152, 576


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    set_threads(args.threads)
    pack = lambda n, k: torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).bfloat16(), 64)  # noqa: E731
    layers = [[pack(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    head = pack(VOCAB, DIM)
    xs = {k: torch.randn(args.rows, k).bfloat16() for _, k in SHAPES}

    def step(weights):
        for layer in weights:
            for (_, k), w in zip(SHAPES, layer):
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
        torch.ops.mkldnn._linear_pointwise(xs[DIM], head, None, "none", [], "")

    flops = 2 * args.rows * (LAYERS * sum(n * k for n, k in SHAPES) + VOCAB * DIM)
    for name, weights in (("30 distinct layers", layers), ("1 layer x 30 (hot)", [layers[0]] * LAYERS)):
        for _ in range(3):
            step(weights)
        best = min(_timed(step, weights) for _ in range(10))
        print(f"{name}: {best * 1e3:.1f} ms per step, {flops / best / 1e9:.0f} GFLOP/s")
    return 0


def _timed(fn, arg) -> float:
    start = time.perf_counter()
    fn(arg)
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
