#!/usr/bin/env python
"""How much of the output head a greedy row needs computed exactly: the next lever for verification
rows and batched decoding, measured before it is built.

Today the head takes each row's activations as two int8 planes per block of 32 (q1, and q2 its
rounding residual on a 128x finer grid: csrc/qmatmul_layout.h), so each row costs two dot products
per weight step. Greedy sampling only needs the argmax. With q1 alone, x1 = d1 q1 differs from the
two-plane x by at most d1 / 2 per input, so a column's one-plane logit a_n is within
B = sum_b (d1_b / 2) * max_n |w_n|_1,b of its exact one (|w|_1,b: the L1 norm of its block b). Every
column whose a_n is below max(a) - 2B is then certainly not the argmax; the others (the candidates)
would be computed exactly, with the same kernel, bitwise as today. This script counts them on real
hidden states (the bench speculative prompts run through the model: the final norm's output at every
position), and checks that the bound held for every row and column against the head of both planes,
the exact one (in fp64).

    PYTHONPATH=src .venv/bin/python bench/head_bound.py --model smollm2
"""
from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf import quants

BLOCK = 32


def head_weight(path: str) -> np.ndarray:
    """The file's output head as fp64 [vocab, dim] (the tied embedding when it has no output.weight)."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    t = tensors.get("output.weight") or tensors["token_embd.weight"]
    return quants.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0])).astype(np.float64)


def block_l1_max(w: np.ndarray) -> np.ndarray:
    """max over columns of each block's L1 norm: [dim / 32]."""
    vocab, dim = w.shape
    return np.abs(w).reshape(vocab, dim // BLOCK, BLOCK).sum(-1).max(0)


def first_plane(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x1 = d1 q1, d1 per row and block, and the two-plane x the kernels multiply), from the kernels' own
    quantization (kernels/qmatmul.py)."""
    import torch

    from tokenmill.kernels.qmatmul import quantize_activations

    acts = quantize_activations(torch.from_numpy(x).float())
    m, k = x.shape
    d1 = acts.d.double().numpy() * 128  # d = d1 / 128
    q1 = acts.q[:, 0].double().numpy().reshape(m, -1, BLOCK)
    return (q1 * d1[..., None]).reshape(m, k), d1, acts.dequantize().double().numpy()


def candidates(x: np.ndarray, w: np.ndarray, l1max: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per row of x [rows, dim]: (how many candidate columns, the bound B, whether |exact - one-plane| <= B
    held for every column of every row and each row's exact argmax was a candidate), exact being the
    head of the two planes, as the kernels compute it."""
    x1, d1, x2 = first_plane(x)
    approx, exact = x1 @ w.T, x2 @ w.T
    bound = (d1 / 2 * l1max).sum(-1)
    chosen = approx >= (approx.max(-1) - 2 * bound)[:, None]
    held = bool((np.abs(exact - approx) <= bound[:, None] * (1 + 1e-9)).all()
                and chosen[np.arange(len(x)), exact.argmax(-1)].all())
    return chosen.sum(-1), bound, held


def hidden_states(path: str, texts: list[str]) -> np.ndarray:
    """The final norm's output at every position of each text (as a chat message), fp64 [positions, dim]."""
    import torch

    from tokenmill.bench.speculative import encode_chat
    from tokenmill.engine import EngineConfig, LLMEngine
    from tokenmill.kvcache.storage import KVStorage
    from tokenmill.model import ChunkSpec
    from tokenmill.model.paged_batch import PagedBatch

    engine = LLMEngine.from_path(path, EngineConfig(max_total_tokens=4096))
    model, cfg = engine.runner.model, engine.runner.model.config
    out = []
    for text in texts:
        ids = encode_chat(engine.tokenizer, text)
        blocks = -(-len(ids) // 16)
        kv = KVStorage(cfg.n_layers, blocks, 16, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16, lazy=True)
        with torch.inference_mode():
            h = model(torch.tensor(ids), torch.arange(len(ids)),
                      PagedBatch.build([ChunkSpec(list(range(blocks)), 0, len(ids))], 16), kv)
            out.append(model.norm(h).double().numpy())
    return np.concatenate(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model name or .gguf path")
    p.add_argument("--texts", nargs="*", help="texts to run (default: bench speculative's prompts)")
    args = p.parse_args(argv)
    from tokenmill.store import resolve_model

    path = str(resolve_model(args.model))
    if args.texts:
        texts = args.texts
    else:
        from tokenmill.bench.speculative_prompts import all_prompts
        texts = [text for _, text in all_prompts().values()]
    w = head_weight(path)
    x = hidden_states(path, texts)
    count, bound, held = candidates(x, w, block_l1_max(w))
    vocab = w.shape[0]
    print(f"{args.model}: head {vocab} x {w.shape[1]}, {len(count)} positions; bound B median {np.median(bound):.3f} "
          f"logits (p90 {np.percentile(bound, 90):.3f}); the bound held everywhere: {held}")
    for q in (50, 75, 90, 99):
        c = np.percentile(count, q)
        print(f"  candidates p{q}: {c:.0f} columns ({100 * c / vocab:.2f}% of the vocabulary)")
    return 0 if held else 1


if __name__ == "__main__":
    raise SystemExit(main())
