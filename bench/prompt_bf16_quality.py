#!/usr/bin/env python
"""What prompt rows on bf16 would cost in accuracy: `tokenmill bench quality --formats gguf` with every
multi-row step's projections computed as an AMX-BF16 kernel would (weights dequantized and rounded
to bf16, activations rounded to bf16, products summed in fp32), while single-row steps keep the GGUF
int8 kernels. In the quality bench prompts are the only multi-row steps, so this emulates "prompt
rows on bf16, generated rows on GGUF": a way to speed up prefill (oneDNN's bf16 matmul runs 512 rows
3.5-4x faster than the GGUF kernel here) whose price is this report. An emulation on the per-op
path (the native decoder step is off), for accuracy only: its speed means nothing.

    .venv/bin/python bench/prompt_bf16_quality.py [--model gemma3] [other bench quality options]
"""
from __future__ import annotations

import os
import sys

os.environ["TOKENMILL_NATIVE_STEP"] = "0"  # the per-op path, whose matmuls this replaces

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tokenmill.cli import main  # noqa: E402
from tokenmill.model import quantized  # noqa: E402


def emulate_prompt_bf16() -> dict[str, int]:
    """Patch QuantizedParts so that multi-row calls take bf16-rounded operands; returns call counts."""
    calls = {"bf16": 0, "gguf": 0}
    init, matmul = quantized.QuantizedParts.__init__, quantized.QuantizedParts.matmul

    def patched_init(self, parts):
        init(self, parts)
        self.bf16_weight = torch.cat([p.dequantize() for p in parts]).bfloat16().float()

    def patched_matmul(self, x):
        if x.shape[0] > 1:
            calls["bf16"] += 1
            return F.linear(x.bfloat16().float(), self.bf16_weight)
        calls["gguf"] += 1
        return matmul(self, x)

    quantized.QuantizedParts.__init__ = patched_init
    quantized.QuantizedParts.matmul = patched_matmul
    return calls


if __name__ == "__main__":
    calls = emulate_prompt_bf16()
    rc = main(["bench", "quality", "--formats", "gguf", *sys.argv[1:]])
    print(f"projection calls: {calls['bf16']} multi-row on bf16, {calls['gguf']} single-row on GGUF")
    raise SystemExit(rc)
