"""The measurements bench/gpu/check.py makes, each on an engine or model it is handed: one greedy
request with every step's logits, single-stream decode speed, a batch of requests submitted at once
(throughput, TTFT, each request's tokens), and transformers' generate on the same prompts. Nothing
here needs CUDA: on the CPU the same code is the check's dry run."""
from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench.common import corpus_prompts, hf_generate, hf_pad_id, load_hf, percentiles, random_prompt
from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams
from tokenmill.model import LoadedModel, load_model
from tokenmill.tokenizer import Tokenizer


def engine_config(**settings) -> EngineConfig:
    """An EngineConfig with speculative decoding off where the engine has it: the check measures and
    compares plain decode steps (one sampled row per sequence and step)."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    if "speculative" in known:
        settings.setdefault("speculative", "off")
    return EngineConfig(**{k: v for k, v in settings.items() if k in known})


def load(path: Path, side: str, device: str) -> LoadedModel:
    """The model as one side of a comparison runs it: "device" (bf16 on `device`; on the CPU the
    dense bf16 path, without int4 copies), "cpu-bf16" (the same bf16 weights on the CPU path) or
    "cpu-fp32" (the reference)."""
    if side == "device":
        if device == "cpu":
            return load_model(path, "bf16", int4=False)
        return load_model(path, "auto", device=device)
    return load_model(path, "bf16" if side == "cpu-bf16" else "fp32", int4=False)


def release(*objects) -> None:
    """Drop engines and models now, and give their GPU memory back to the driver."""
    del objects
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def prompts_for(tokenizer: Tokenizer, num: int, length: int) -> list[list[int]]:
    """`num` prompts of `length` tokens: windows of the bench corpus (no two share a prefix)."""
    return corpus_prompts(tokenizer.encode, num, length)


def greedy_with_logits(loaded: LoadedModel, tokenizer: Tokenizer, cfg: EngineConfig, prompt: list[int],
                       max_tokens: int) -> dict[str, Any]:
    """One greedy request: its tokens and every step's logits (float32, on the CPU), one step at a
    time (decode steps in a row would keep their logits on the device)."""
    if any(f.name == "decode_steps" for f in dataclasses.fields(cfg)):
        cfg = dataclasses.replace(cfg, decode_steps=1)
    engine = LLMEngine(loaded, tokenizer, cfg)
    rows: list[torch.Tensor] = []
    run = engine.runner.run
    engine.runner.picks_greedy_tokens = False  # the CPU runner's logits too, not greedy tokens alone

    def recording(batch):
        out = run(batch)
        if out.logits is not None:
            rows.extend(out.logits.float().cpu().clone())  # a copy: the sampler may change them in place
        return out

    engine.runner.run = recording
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for ev in engine.step():
            tokens += ev.token_ids
    info = {"runner": type(engine.runner).__name__, "graph_steps": getattr(engine.runner, "graph_steps", 0)}
    release(engine)
    return {"tokens": tokens, "logits": rows, **info}


def compare_greedy(ref: dict[str, Any], got: dict[str, Any], tolerance: float, tie: float = 0.02) -> dict[str, Any]:
    """`got`'s greedy run against `ref`'s on the same prompt: the logits of every step until the
    tokens part (the inputs are the same up to there), as the largest absolute difference and that
    relative to the step's largest reference logit. Two models that round differently may part at a
    near tie: a first differing token is accepted when the reference scores the two within `tie` of
    its largest logit. ok: every compared step within `tolerance`, and the tokens equal or parted at
    a near tie."""
    agree, worst_abs, worst_rel, parted = 0, 0.0, 0.0, None
    for step, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])):
        r, g = ref["logits"][step], got["logits"][step]
        finite = r.isfinite() & g.isfinite()
        if not torch.equal(r.isfinite(), g.isfinite()):  # -inf (a masked token) where the other has a number
            worst_abs = worst_rel = float("inf")
        scale = float(r[finite].abs().max()) if finite.any() else 1.0
        diff = float((r - g)[finite].abs().max()) if finite.any() else 0.0
        worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, diff / scale)
        if a != b:
            margin = float(r[a] - r[b]) / scale
            parted = {"step": step, "ref_token": a, "got_token": b, "ref_margin_rel": margin,
                      "near_tie": margin < tie}
            break
        agree += 1
    equal = ref["tokens"] == got["tokens"]
    return {"tokens": len(ref["tokens"]), "tokens_equal": equal, "agreeing_prefix": agree, "parted": parted,
            "max_abs_diff": worst_abs, "max_rel_diff": worst_rel, "tolerance_rel": tolerance,
            "ok": worst_rel <= tolerance and (equal or bool(parted and parted["near_tie"]))}


def single_stream(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Decode tok/s of one request at a time: (tokens - 1) / (last token's time - first's), the
    median over `prompts` (each a different one: no prefix-cache hits), after an untimed warm-up."""
    vocab = engine.loaded.config.vocab_size
    _run_one(engine, random_prompt(vocab, len(prompts[0]), seed=99), 8)
    graphs_before = getattr(engine.runner, "graph_steps", 0)
    runs = [_run_one(engine, p, max_tokens) for p in prompts]
    decode = sorted(r["decode_tok_s"] for r in runs)
    return {"decode_tok_s": statistics.median(decode), "decode_tok_s_runs": [r["decode_tok_s"] for r in runs],
            "ttft_ms": statistics.median(r["ttft_ms"] for r in runs), "prompt_len": len(prompts[0]),
            "max_tokens": max_tokens, "graph_steps": getattr(engine.runner, "graph_steps", 0) - graphs_before}


def _run_one(engine: LLMEngine, ids: list[int], n: int) -> dict[str, float]:
    times: list[float] = []
    t0 = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        times += [now] * sum(len(ev.token_ids) for ev in events)
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
    return {"decode_tok_s": decode, "ttft_ms": (times[0] - t0) * 1e3}


def batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Every prompt submitted at once, greedy, EOS ignored: output tok/s (all new tokens / wall time
    from the first submission to the last token), TTFT from submission, each request's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    steps_before = engine.stats.num_steps
    graphs_before = getattr(engine.runner, "graph_steps", 0)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {r: [] for r in ids}
    first: dict[str, float] = {}
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        for ev in events:
            if ev.error:
                raise RuntimeError(f"request {ev.request_id} failed: {ev.error}")
            if ev.token_ids:
                outputs[ev.request_id] += ev.token_ids
                first.setdefault(ev.request_id, now)
    elapsed = time.perf_counter() - t0
    produced = sum(len(v) for v in outputs.values())
    return {"requests": len(prompts), "prompt_len": len(prompts[0]), "max_tokens": max_tokens,
            "output_tokens": produced, "elapsed_seconds": elapsed, "output_tok_s": produced / elapsed,
            "ttft_ms": percentiles([(t - t0) * 1e3 for t in first.values()]),
            "steps": engine.stats.num_steps - steps_before,
            "graph_steps": getattr(engine.runner, "graph_steps", 0) - graphs_before,
            "outputs": [outputs[r] for r in ids]}


def warm_up(engine: LLMEngine, num: int, length: int) -> None:
    """An untimed batch of `num` random prompts (4 tokens each): the step shapes, kernels and decode
    graphs the measured batch uses are compiled and captured by then."""
    vocab = engine.loaded.config.vocab_size
    batch(engine, [random_prompt(vocab, length, seed=1000 + i) for i in range(num)], 4)


def transformers_generate(path: Path, prompts: list[list[int]], batches: list[int], max_tokens: int, device: str,
                          save) -> dict[str, Any]:
    """transformers on the same GGUF (bf16, eager attention, on `device`): batched greedy generate of
    the first b prompts for each b in `batches`; `save(result)` after each, so a run cut short keeps
    what it measured."""
    model, load_s = load_hf(path, "bf16", device, attn="eager")
    pad = hf_pad_id(model)
    result: dict[str, Any] = {"load_seconds": load_s, "dtype": "bf16", "device": str(model.device),
                              "attn_implementation": model.config._attn_implementation, "batches": {}}
    hf_generate(model, [random_prompt(model.config.vocab_size, len(prompts[0]), 1234)], 4, pad)  # warm-up
    for b in batches:
        r = hf_generate(model, prompts[:b], max_tokens, pad)
        result["batches"][str(b)] = {"output_tok_s": r["new_tokens"] / r["seconds"],
                                     "ttft_ms": r["first_token_s"] * 1e3, "seconds": r["seconds"],
                                     "new_tokens": r["new_tokens"]}
        save(result)
    return result
