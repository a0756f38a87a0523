"""Quality of the engine's weight formats against fp32 (issue 5): on a fixed set of varied prompts,
how often greedy decoding picks the same tokens as fp32, and how far the logits move.

Formats
  fp32       load_model(path, "fp32", int4=False) on the pure PyTorch path (native kernels off): the
             reference.
  bf16       load_model(path, "bf16", int4=False): dense bf16 everywhere.
  bf16-int4  load_model(path, "bf16", int4=True): what `--dtype bf16` serves; steps of at
             most INT4_MAX_ROWS rows (single-sequence decode) use the 4-bit GGUF weights int4-packed.
  gguf       load_model(path, "gguf"): what the server serves by default with the native kernels:
             GGUF blocks, activations as two int8 planes in the matmuls, float32 elsewhere, f16 KV cache.
  gguf-kv8   gguf with the int8 KV cache (--kv-dtype int8).

Per format and prompt
  greedy      the engine's greedy output (one request at a time, so decode steps are single-row and
              int4 is exercised), EOS ignored, --max-tokens tokens; compared with fp32's:
              first divergence index (= max-tokens when none) and % identical positions.
  logits      the model driven directly over a KV cache along fp32's greedy tokens (teacher forcing):
              prefill   last prompt position after the whole-prompt prefill (a many-row step, so
                        bf16-int4 equals bf16 there);
              decode    every single-row decode position (int4 used): max |diff| over positions,
                        and the mean |diff|; top-1 agreement = % positions whose argmax is fp32's
                        (end-of-generation ids excluded, as the engine excludes them here).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

from tokenmill.bench.common import corpus_prompts, environment, fmt, loadavg, progress, set_threads, write_json

MAX_CORPUS_PROMPTS = 64
# name -> (load_model mode, int4, kv_dtype)
FORMATS = {"fp32": ("fp32", False, "auto"), "bf16": ("bf16", False, "auto"), "bf16-int4": ("bf16", True, "auto"),
           "gguf": ("gguf", False, "auto"), "gguf-kv8": ("gguf", False, "int8")}

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain why the sky is blue to a ten-year-old.",
    "List five fruits that are red.",
    "Tell me a short story about a cat who learns to swim.",
    "If a train travels 60 miles in 1.5 hours, what is its average speed?",
    "Translate to French: The weather is nice today and we are going to the park.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]


def build_parser(prog: str = "tokenmill bench quality") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model name or .gguf path (default: smollm2)")
    p.add_argument("--formats", default="gguf,gguf-kv8,bf16-int4",
                   help=f"formats compared with fp32, from {', '.join(FORMATS)} (default: gguf,gguf-kv8,bf16-int4)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS),
                   help=f"first N of the {len(PROMPTS)} prompts (with --prompt-len: N corpus windows, up to "
                        f"{MAX_CORPUS_PROMPTS})")
    p.add_argument("--raw", action="store_true", help="encode prompts as is, without the chat template")
    p.add_argument("--prompt-len", type=int, default=None, metavar="N",
                   help="instead of the chat prompts, windows of N tokens of the benchmark corpus: long prefills "
                        "(from attention.PIECE_FROM tokens, 512, a chunk attends in query pieces)")
    p.add_argument("--compile", action="store_true",
                   help="greedy decoding of the measured formats through the compiled graphs, as `tokenmill serve` "
                        "runs it (the fp32 reference and the teacher-forced logits stay eager)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--peer", choices=["llama-cpp"], default=None,
                   help="also llama.cpp's greedy tokens on the same file (llama-cpp-python; --threads or 2 threads)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p


# --- driving the model directly (as tests/model_helpers.py does) ----------------------------------
class DirectRunner:
    """Prefill then single-row steps over a private paged KV cache; returns float32 logits."""

    def __init__(self, engine, max_tokens: int):
        """Model, cache dtype and attention path as `engine` has them; a private cache."""
        from tokenmill.kvcache.storage import KVStorage

        cfg = engine.loaded.config
        self.model = engine.loaded.model
        self.runner = engine.runner
        bs = engine.kv.block_size  # the runner's attention metadata is built for it
        num_blocks = -(-max_tokens // bs)
        self.kv = KVStorage(cfg.n_layers, num_blocks, bs, cfg.n_kv_heads, cfg.head_dim, engine.kv.dtype)
        self.table = list(reversed(range(num_blocks)))

    def forward(self, ids: list[int], start: int):
        import torch

        from tokenmill.model import ChunkSpec

        meta = self.runner.attention_meta([ChunkSpec(self.table, start, len(ids))])
        h = self.model(torch.tensor(ids), torch.arange(start, start + len(ids)), meta, self.kv)
        return self.model.logits(h, torch.tensor([h.shape[0] - 1]))[0].float()

    def teacher_forced(self, prompt: list[int], forced: list[int]) -> list:
        """Logits at the last prompt position, then after each of forced[:-1] (one row per step)."""
        import torch

        with torch.inference_mode():
            out = [self.forward(prompt, 0)]
            pos = len(prompt)
            for tok in forced[:-1]:
                out.append(self.forward([tok], pos))
                pos += 1
        return out


def greedy_engine(loaded, tokenizer, prompts: list[list[int]], n: int, fmt_name: str, compile: bool = False):
    """An engine that serves one request at a time (single-row decode steps), room for the longest."""
    from tokenmill.engine import EngineConfig, LLMEngine

    mode, _, kv_dtype = FORMATS[fmt_name]
    block = EngineConfig.block_size
    room = -(-(max(len(p) for p in prompts) + n + 1) // block) * block
    return LLMEngine(loaded, tokenizer, EngineConfig(dtype=mode, kv_dtype=kv_dtype, max_total_tokens=max(room, 256),
                                                     parallel=1, enable_prefix_caching=False, compile=compile))


def engine_greedy(eng, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from the engine for one request alone, EOS ignored."""
    from tokenmill.engine import SamplingParams

    rid = eng.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    out: list[int] = []
    while eng.has_unfinished():
        for ev in eng.step():
            if ev.request_id == rid:
                if ev.error:
                    raise RuntimeError(f"engine error: {ev.error}")
                out += ev.token_ids
    return out


def encode_prompts(tokenizer, texts: list[str], raw: bool, limit: int) -> list[list[int]]:
    out = []
    for t in texts:
        if not raw and tokenizer.chat_template is not None:
            text = tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(t)
        out.append(ids[-limit:] if len(ids) > limit else ids)
    return out


def _load(path, fmt_name: str):
    from tokenmill.model import load_model

    mode, int4, _ = FORMATS[fmt_name]
    return load_model(path, mode, int4=int4)


def _count_int4(model) -> int:
    from tokenmill.model.linear import Linear

    return sum(1 for m in model.modules() if isinstance(m, Linear) and m.int4 is not None)


def agreement(tokens: list[int], ref: list[int]) -> tuple[int, float]:
    """First divergence from fp32's greedy tokens (= len(ref) when none) and % identical positions."""
    same = [a == b for a, b in zip(tokens, ref)]
    first = next((j for j, s in enumerate(same) if not s), len(ref))
    return first, 100 * sum(same) / max(1, len(ref))


def peer_agreement(path, prompts: list[list[int]], ref_tokens: list[list[int]], n: int, suppress: list[int],
                   threads: int) -> dict[str, Any]:
    """llama.cpp's greedy tokens on the same file and prompt ids, against fp32's: what the peer's own
    quantized path (Q8 activations, f16 KV) keeps. Only the greedy columns: no teacher-forced logits."""
    from tokenmill.bench.llama_cpp_peer import LlamaCppModel, describe

    model = LlamaCppModel(str(path), threads=threads, n_ctx=max(len(p) for p in prompts) + n + 8)
    t0 = time.perf_counter()
    try:
        rows = [agreement(model.greedy(ids, n, suppress).token_ids, ref) for ids, ref in zip(prompts, ref_tokens)]
    finally:
        model.close()
    firsts = [f for f, _ in rows]
    return {"seconds": time.perf_counter() - t0, "peer": describe(),
            "identical_pct": statistics.fmean(p for _, p in rows), "first_divergence_min": min(firsts),
            "first_divergence_median": statistics.median(firsts), "prompts_fully_identical": sum(f >= n for f in firsts)}


def run(path, formats: list[str], n: int, num_prompts: int, raw: bool, compile: bool = False,
        prompt_len: int | None = None, peer_threads: int | None = None) -> dict[str, Any]:
    from tokenmill.kernels import use_variant
    from tokenmill.tokenizer import Tokenizer

    progress("loading fp32 reference (PyTorch path, native kernels off)")
    with use_variant("torch"):
        ref = _load(path, "fp32")
    tok = Tokenizer.from_gguf_metadata(ref.gguf.metadata)
    ctx = ref.config.context_length
    if prompt_len is None:
        labels = PROMPTS[:num_prompts]
        prompts = encode_prompts(tok, labels, raw, max(1, ctx - n - 1))
    else:
        prompts = corpus_prompts(tok.encode, num_prompts, min(prompt_len, ctx - n - 1), stride=97)
        labels = [f"corpus window {i} ({len(p)} tokens)" for i, p in enumerate(prompts)]
    ref_tokens, ref_logits = [], []
    t0 = time.perf_counter()
    with use_variant("torch"):
        ref_engine = greedy_engine(ref, tok, prompts, n, "fp32")  # the reference stays eager
        for ids in prompts:
            toks = engine_greedy(ref_engine, ids, n)
            ref_tokens.append(toks)
            ref_logits.append(DirectRunner(ref_engine, len(ids) + n).teacher_forced(ids, toks))
    stop = sorted(t for t in tok.stop_ids if 0 <= t < ref.config.vocab_size)

    def argmax(lg) -> int:
        # The engine suppresses the model's end-of-generation ids (EOS ignored): so does this.
        if stop:
            lg = lg.clone()
            lg[stop] = float("-inf")
        return int(lg.argmax())

    # Sanity: the direct path's argmax along fp32's tokens is the engine's next token.
    consistent = [sum(argmax(lg) == t for lg, t in zip(lgs, toks)) / max(1, len(toks))
                  for lgs, toks in zip(ref_logits, ref_tokens)]
    results: dict[str, Any] = {"fp32": {"seconds": time.perf_counter() - t0, "int4_layers": 0,
                                        "direct_argmax_matches_engine_pct": 100 * statistics.fmean(consistent)}}
    del ref, ref_engine
    gc.collect()

    for name in formats:
        progress(f"{name}: loading and decoding")
        loaded = _load(path, name)
        eng = greedy_engine(loaded, tok, prompts, n, name, compile)
        t0 = time.perf_counter()
        rows = []
        for i, ids in enumerate(prompts):
            toks = engine_greedy(eng, ids, n)
            lgs = DirectRunner(eng, len(ids) + n).teacher_forced(ids, ref_tokens[i])
            first, identical = agreement(toks, ref_tokens[i])
            diffs = [(a - b).abs() for a, b in zip(lgs, ref_logits[i])]
            dec = diffs[1:]
            top1 = [argmax(a) == argmax(b) for a, b in zip(lgs, ref_logits[i])]
            rows.append({
                "prompt": labels[i], "prompt_tokens": len(ids), "tokens": len(toks),
                "first_divergence": first, "identical_pct": identical,
                "prefill_logit_max_abs": float(diffs[0].max()), "prefill_logit_mean_abs": float(diffs[0].mean()),
                "decode_logit_max_abs": max((float(d.max()) for d in dec), default=0.0),
                "decode_logit_mean_abs": statistics.fmean(float(d.mean()) for d in dec) if dec else 0.0,
                "top1_agree_pct": 100 * sum(top1) / len(top1),
                "text": tok.decode(toks, skip_special_tokens=True),
            })
        firsts = [r["first_divergence"] for r in rows]
        results[name] = {
            "seconds": time.perf_counter() - t0,
            "int4_layers": _count_int4(loaded.model),
            "compiled_steps": eng.runner.graph_steps + eng.runner.step_graph_steps,
            "identical_pct": statistics.fmean(r["identical_pct"] for r in rows),
            "first_divergence_min": min(firsts),
            "first_divergence_median": statistics.median(firsts),
            "prompts_fully_identical": sum(1 for f in firsts if f >= n),
            "top1_agree_pct": statistics.fmean(r["top1_agree_pct"] for r in rows),
            "prefill_logit_max_abs": max(r["prefill_logit_max_abs"] for r in rows),
            "prefill_logit_mean_abs": statistics.fmean(r["prefill_logit_mean_abs"] for r in rows),
            "decode_logit_max_abs": max(r["decode_logit_max_abs"] for r in rows),
            "decode_logit_mean_abs": statistics.fmean(r["decode_logit_mean_abs"] for r in rows),
            "per_prompt": rows,
        }
        del loaded, eng
        gc.collect()
    if peer_threads is not None:
        progress("llama.cpp: decoding the same prompt ids")
        results["llama.cpp"] = peer_agreement(path, prompts, ref_tokens, n, stop, peer_threads)
    return {"num_prompts": len(prompts), "max_tokens": n, "formats": results,
            "fp32_texts": [tok.decode(t, skip_special_tokens=True) for t in ref_tokens]}


def print_table(r: dict[str, Any]) -> None:
    n = r["max_tokens"]
    print(f"quality vs fp32: {r['model']}, {r['num_prompts']} prompts, {n} greedy tokens each "
          f"(single-sequence decode{', compiled graphs' if r.get('compiled') else ''})")
    env = r["environment"]
    print(f"kernels {env['kernels']}; cpu flags: {env['cpu_flags']}")
    print(f"{'format':10} {'int4 lin':>8} {'identical %':>11} {'1st div min/med':>15} {'all-same':>8} "
          f"{'top1 %':>7} {'prefill logit max/mean':>23} {'decode logit max/mean':>22}")
    for name, f in r["formats"].items():
        if name == "fp32":
            agree = fmt(f["direct_argmax_matches_engine_pct"])
            print(f"{'fp32':10} {0:>8} (reference; direct/engine argmax agree {agree}%)")
            continue
        div = f"{f['first_divergence_min']}/{f['first_divergence_median']:g}"
        if "peer" in f:  # greedy columns only
            print(f"{name:10} {'-':>8} {f['identical_pct']:>11.1f} {div:>15} "
                  f"{str(f['prompts_fully_identical']) + '/' + str(r['num_prompts']):>8} {'-':>7}")
            continue
        print(f"{name:10} {f['int4_layers']:>8} {f['identical_pct']:>11.1f} {div:>15} "
              f"{str(f['prompts_fully_identical']) + '/' + str(r['num_prompts']):>8} {f['top1_agree_pct']:>7.1f} "
              f"{fmt(f['prefill_logit_max_abs'], 3) + ' / ' + fmt(f['prefill_logit_mean_abs'], 4):>23} "
              f"{fmt(f['decode_logit_max_abs'], 3) + ' / ' + fmt(f['decode_logit_mean_abs'], 4):>22}")
    print(f"  (first divergence = {n} means none within {n} tokens; loadavg {r['loadavg_end']})")


def main(argv: list[str] | None = None, prog: str = "tokenmill bench quality") -> int:
    args = build_parser(prog).parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip() and f.strip() != "fp32"]
    bad = [f for f in formats if f not in FORMATS]
    most = len(PROMPTS) if args.prompt_len is None else MAX_CORPUS_PROMPTS
    if (bad or args.max_tokens < 1 or not 1 <= args.num_prompts <= most
            or (args.prompt_len is not None and args.prompt_len < 2)):
        print(f"{prog}: error: formats are {', '.join(FORMATS)}; --max-tokens >= 1; "
              f"--num-prompts 1..{len(PROMPTS)} (1..{MAX_CORPUS_PROMPTS} with --prompt-len); --prompt-len >= 2")
        return 2
    set_threads(args.threads)
    from tokenmill.store import resolve_model

    path = resolve_model(args.model)
    la = loadavg()
    peer_threads = (args.threads or 2) if args.peer else None
    out = run(path, formats, args.max_tokens, args.num_prompts, args.raw, args.compile, args.prompt_len, peer_threads)
    result = {"benchmark": "quality", "model": str(path), "compiled": args.compile, **out, "loadavg_start": la,
              "loadavg_end": loadavg(), "environment": environment()}
    print_table(result)
    write_json(args.json, result)
    return 0
