"""Speed of the GGUF qmatmul kernels on the real models' shapes, against oneDNN bf16 (the dense path
tokenmill uses today) and fp32 F.linear measured alternately in the same run (the machine is shared:
read the ratios, not the absolute times).

    PYTHONPATH=src python bench/qmatmul.py [--threads 2] [--rows 1,8,64,512] [--only smol|gemma] [--variant avx2]

qmatmul's time includes quantizing the activations. Where the CPU has AMX-INT8, the `vnni` column is
the same call with AMX off (the same bits; compare the two speeds). GB/s counts the repacked weight's bytes per call;
at M=1 the last column is a peer for it: torch's max() reading as many bytes, timed in the same rounds.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import gguf
from tokenmill.bench.common import cpu_flags, cpu_model
from tokenmill.kernels import native
from tokenmill.kernels.qmatmul import QuantizedWeight, qmatmul

Q = gguf.GGMLQuantizationType
SHAPES = {  # (name, type, N, K)
    "smol": [("qkv", Q.Q4_1, 960, 576), ("o", Q.Q4_1, 576, 576), ("gate_up", Q.Q4_1, 3072, 576),
             ("down", Q.Q4_1, 576, 1536), ("head", Q.Q8_0, 49152, 576)],
    "gemma": [("q", Q.Q5_0, 1536, 640), ("v", Q.Q8_0, 256, 640), ("attn_out", Q.Q4_K, 640, 1024),
              ("gate_up", Q.Q5_0, 4096, 640), ("down", Q.Q6_K, 640, 2048), ("head", Q.Q8_0, 262144, 640)],
}
QUANTIZE_LIMIT = 1 << 22  # bigger weights get random blocks (gguf's numpy quantizer is slow there)


def random_gguf(t: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[t]
    if n * k <= QUANTIZE_LIMIT and t not in (Q.Q4_K, Q.Q6_K):
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.05, t)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 2e-2, (n, k // block, 2)).astype(np.float16).view(np.uint8)
    if t == Q.Q6_K:
        raw[..., 208:210] = scales[..., :2]
    else:  # d first (and Q4_1's m, Q4_K's dmin next: random bytes there are fine fp16 too, mostly)
        raw[..., 0:2] = scales[..., :2]
        if t in (Q.Q4_1, Q.Q4_K):
            raw[..., 2:4] = scales[..., :2]
    return raw.reshape(n, -1)


def without_amx(fn):
    with native.use_amx(False):
        return fn()


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--only", choices=list(SHAPES))
    ap.add_argument("--variant", help="native variant (default: the best this CPU runs)")
    ap.add_argument("--rounds", type=int, default=7, help="alternations per measurement (the fastest kept: the machine is shared)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"cpu: {cpu_model()}; flags: {cpu_flags()}")
    with native.use_variant(args.variant or native.variant()):
        print(f"qmatmul variant: {native.variant()}, threads {args.threads}; onednn bf16: "
              f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
        amx = native.amx()
        print(f"{'model':6} {'weight':9} {'type':5} {'N x K':>13} {'M':>4} | {'qmatmul':>10} {'GB/s':>6} | "
              f"{'bf16 dnn':>10} {'fp32':>10} | {'vs bf16':>7} {'vs fp32':>7} | {'read GB/s':>9}"
              + (f" | {'vnni':>10} {'amx gain':>8}" if amx else ""))
        for model, shapes in SHAPES.items():
            if args.only and model != args.only:
                continue
            for name, t, n, k in shapes:
                raw = random_gguf(t, n, k, rng)
                w = QuantizedWeight.from_gguf(raw, t, (n, k))
                dense = w.dequantize()
                packed = torch.ops.mkldnn._reorder_linear_weight(dense.to(torch.bfloat16), 64)
                peer = torch.randn(w.nbytes // 4)
                for m in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(m, k)
                    xb = x.to(torch.bfloat16)
                    work = m * n * k
                    reps = max(1, min(200, int(2e9 / max(work, 1)), int(2e9 / w.nbytes)))
                    fns = {"q": lambda: qmatmul(x, w),
                           "bf16": lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], ""),
                           "fp32": lambda: F.linear(x, dense)}
                    if m == 1:
                        fns["read"] = lambda: peer.max()
                    if amx:
                        fns["vnni"] = lambda: without_amx(lambda: qmatmul(x, w))
                    times = {key: [] for key in fns}
                    for _ in range(args.rounds):
                        for key, fn in fns.items():
                            times[key].append(timed(fn, reps))
                    tq, tb, tf = (min(times[key]) for key in ("q", "bf16", "fp32"))
                    print(f"{model:6} {name:9} {t.name:5} {f'{n}x{k}':>13} {m:4} | {tq * 1e6:8.0f}us {w.nbytes / tq / 1e9:6.1f} | "
                          f"{tb * 1e6:8.0f}us {tf * 1e6:8.0f}us | {tb / tq:6.2f}x {tf / tq:6.2f}x | "
                          + (f"{w.nbytes / min(times['read']) / 1e9:9.1f}" if "read" in times else f"{'':9}")
                          + (f" | {min(times['vnni']) * 1e6:8.0f}us {min(times['vnni']) / tq:7.2f}x" if amx else ""),
                          flush=True)
                del dense, packed, peer


if __name__ == "__main__":
    main()
