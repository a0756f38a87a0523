#!/usr/bin/env python
"""What prompt rows on bf16 would cost in accuracy: `tokenmill bench quality --formats gguf` with every
multi-row step's projections computed as an AMX-BF16 kernel would (weights dequantized and rounded
to bf16, activations rounded to bf16, products summed in fp32), while single-row steps keep the GGUF
int8 kernels. In the quality bench prompts are the only multi-row steps, so this emulates "prompt
rows on bf16, generated rows on GGUF": a way to speed up prefill (oneDNN's bf16 matmul runs 512 rows
3.5-4x faster than the GGUF kernel here) whose price is this report. An emulation on the per-op
path (the native decoder step is off), for accuracy only: its speed means nothing.

    .venv/bin/python bench/prompt_bf16_quality.py [--bf16x3] [--model gemma3] [other bench quality options]

--bf16x3: each operand as two bf16 values and three products (hi.hi + hi.lo + lo.hi, summed in fp32),
the numerics of a kernel taking three AMX-BF16 products per tile: about fp32's precision for 3x the
tile work of one bf16 product, and still no per-block scaling.
"""
from __future__ import annotations

import os
import sys

os.environ["TOKENMILL_NATIVE_STEP"] = "0"  # the per-op path, whose matmuls this replaces

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tokenmill.cli import main  # noqa: E402
from tokenmill.model import quantized  # noqa: E402


def split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t as a sum of two bf16 values (hi, the rest rounded again), each returned in fp32."""
    hi = t.bfloat16().float()
    return hi, (t - hi).bfloat16().float()


def emulate_prompt_bf16(three: bool) -> dict[str, int]:
    """Patch QuantizedParts so that multi-row calls take bf16-rounded operands (three: each operand as two
    bf16 values, three products: hi.hi + hi.lo + lo.hi, what three AMX-BF16 products per tile would
    give); returns call counts."""
    calls = {"bf16": 0, "gguf": 0}
    init, matmul = quantized.QuantizedParts.__init__, quantized.QuantizedParts.matmul

    def patched_init(self, parts):
        init(self, parts)
        self.bf16_weight = split_bf16(torch.cat([p.dequantize() for p in parts]))

    def patched_matmul(self, x):
        if x.shape[0] > 1:
            calls["bf16"] += 1
            w_hi, w_lo = self.bf16_weight
            x_hi, x_lo = split_bf16(x)
            if not three:
                return F.linear(x_hi, w_hi)
            return F.linear(x_hi, w_hi) + F.linear(x_hi, w_lo) + F.linear(x_lo, w_hi)
        calls["gguf"] += 1
        return matmul(self, x)

    quantized.QuantizedParts.__init__ = patched_init
    quantized.QuantizedParts.matmul = patched_matmul
    return calls


if __name__ == "__main__":
    args = sys.argv[1:]
    three = "--bf16x3" in args
    calls = emulate_prompt_bf16(three)
    rc = main(["bench", "quality", "--formats", "gguf", *(a for a in args if a != "--bf16x3")])
    print(f"projection calls: {calls['bf16']} multi-row on bf16, {calls['gguf']} single-row on GGUF")
    raise SystemExit(rc)
