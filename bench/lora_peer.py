"""LoRA adapters against llama.cpp (llama-cpp-python's `lora_path`, which adds B·(A·x) at run time): the
same random adapter on a real model, applied by each. Prints, per model and adapter size:

- agreement: the adapter's effect on the next-token logits of a prompt, tokenmill's (the merged blob
  against the base) against llama.cpp's (with the adapter against without): cosine and norm ratio. An
  adapter too small to move the logits more than llama.cpp's own kernel change does (its adapted
  weights leave the repacked path) says little, so the sizes go up to one that dominates it;
- single-stream greedy decode tokens/s of the base and the adapted model on each side (2 threads by
  default, speculation off), after a warm-up, best of 3 runs.

    PYTHONPATH=src python bench/lora_peer.py --model smollm2 --model gemma3:270m

Benchmark-only (llama-cpp-python is not a test dependency). Writes nothing outside a temp folder."""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from tokenmill.bench.common import set_threads
from tokenmill.gguf.lora import merge, read_adapter, write_adapter
from tokenmill.gguf.reader import open_gguf
from tokenmill.gguf.rewrite import write_replaced
from tokenmill.store import resolve_model

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
PROMPT = "The capital of France is Paris, and the capital of Germany is"


def random_adapter(path: Path, base, rank: int, alpha: float, size: float, seed: int = 3) -> None:
    rng = np.random.default_rng(seed)
    pairs = {}
    for name, t in base.tensors.items():
        if name.startswith("blk.") and name.split(".")[2] in TARGETS:
            outputs, inputs = t.shape
            pairs[name] = (rng.normal(0, size, (rank, inputs)).astype(np.float32),
                           rng.normal(0, size, (outputs, rank)).astype(np.float32))
    write_adapter(path, base.architecture, pairs, alpha)


def tokenmill_side(path: Path, ids: list[int], tokens: int, threads: int) -> tuple[np.ndarray, float]:
    import torch

    from tokenmill.engine import LLM, EngineConfig, SamplingParams
    from tokenmill.kvcache.storage import KVStorage
    from tokenmill.model import AttentionMetadata, ChunkSpec, load_model

    model = load_model(path, "auto").model
    cfg, block = model.config, 16
    blocks = -(-len(ids) // block)
    kv = KVStorage(cfg.n_layers, blocks, block, cfg.n_kv_heads, cfg.head_dim, model.embed.dtype)
    with torch.inference_mode():  # one prefill of the prompt, straight through the model: its last logits
        meta = AttentionMetadata.build([ChunkSpec(list(range(blocks)), 0, len(ids))], block)
        h = model(torch.tensor(ids), torch.arange(len(ids)), meta, kv)
        logits = model.logits(h, torch.tensor([len(ids) - 1]))[0].numpy()
    llm = LLM(str(path), EngineConfig(speculative="off", threads=threads))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=4))
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        llm.generate([ids], params)
        best = max(best, tokens / (time.perf_counter() - start))
    return logits, best


def llama_cpp_side(path: Path, lora: Path | None, ids: list[int], tokens: int,
                   threads: int) -> tuple[np.ndarray, float]:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_threads=threads, n_ctx=512, verbose=False, logits_all=True,
                          lora_path=str(lora) if lora else None)
    llm.eval(ids)
    logits = np.array(llm.scores[len(ids) - 1])
    best = 0.0
    for _ in range(3):
        llm.reset()
        llm.eval(ids)
        start = time.perf_counter()
        for _ in range(tokens):
            llm.eval([llm.sample(temp=0.0, repeat_penalty=1.0)])
        best = max(best, tokens / (time.perf_counter() - start))
    return logits, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help="model names (default: smollm2)")
    ap.add_argument("--sizes", default="0.005,0.02,0.04", help="random A and B entries' std, comma-separated")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    set_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="lora-peer-"))
    for name in args.model or ["smollm2"]:
        path = resolve_model(name)
        base = open_gguf(path)
        import llama_cpp

        ids = llama_cpp.Llama(str(path), vocab_only=True, verbose=False).tokenize(PROMPT.encode(), add_bos=True)
        tm_base, tm_speed = tokenmill_side(path, ids, args.tokens, args.threads)
        lc_base, lc_speed = llama_cpp_side(path, None, ids, args.tokens, args.threads)
        print(f"{name}: base decode tokenmill {tm_speed:.1f} tok/s, llama.cpp {lc_speed:.1f} "
              f"({tm_speed / lc_speed:.2f}x)")
        for size in (float(s) for s in args.sizes.split(",")):
            lora, merged = work / f"{name}-{size}.gguf", work / f"{name}-{size}-merged.gguf"
            random_adapter(lora, base, args.rank, args.alpha, size)
            with open(merged, "wb") as f:
                write_replaced(base, merge(base, [read_adapter(open_gguf(lora))]), f.write)
            tm_logits, tm_lora_speed = tokenmill_side(merged, ids, args.tokens, args.threads)
            lc_logits, lc_lora_speed = llama_cpp_side(path, lora, ids, args.tokens, args.threads)
            ours, theirs = tm_logits - tm_base, lc_logits - lc_base
            cos = float(ours @ theirs / (np.linalg.norm(ours) * np.linalg.norm(theirs)))
            norms = np.linalg.norm(ours) / np.linalg.norm(theirs)
            print(f"  size {size}: effect on the logits (max |change|) tokenmill {np.abs(ours).max():.2f}, llama.cpp "
                  f"{np.abs(theirs).max():.2f}; cosine {cos:.3f}, norm ratio {norms:.3f}; decode tokenmill "
                  f"{tm_lora_speed:.1f} tok/s ({tm_lora_speed / tm_speed:.2f}x its base), llama.cpp "
                  f"{lc_lora_speed:.1f} ({lc_lora_speed / lc_speed:.2f}x); tokenmill/llama.cpp "
                  f"{tm_lora_speed / lc_lora_speed:.2f}x")


if __name__ == "__main__":
    main()
