"""Structured-output throughput: a batch of N JSON-schema requests, all submitted at once, against
the same batch unconstrained, in the same process; and the grammar's cost per token.

The unconstrained run gets the same prompts, seeds and, per request, exactly as many tokens as its
constrained twin produced (EOS ignored), so both runs compute the same number of tokens and the
ratio measures what the constraint costs (target: >= 0.9x).

Definitions
  output tok/s      output tokens / wall time from submitting the batch to its last token.
  mask us/token     time the mask worker spent computing masks, per constrained token, in the
                    first constrained run (it runs beside the model step, so it only costs when it
                    outlasts the step or takes a core the model wanted).
  compile ms        compiling the schema once (cached after).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from tokenmill.bench.common import environment, fmt, progress, ratio, set_threads, write_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "job": {"enum": ["engineer", "teacher", "doctor", "farmer", "artist"]},
        "city": {"type": "string", "maxLength": 20},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "job", "city", "hobbies"],
    "additionalProperties": False,
}


def build_parser(prog: str = "tokenmill bench structured") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model name or .gguf path (default: smollm2)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=160, help="cap per constrained request")
    p.add_argument("--temperature", type=float, default=0.7, help="request i samples with seed i")
    p.add_argument("--dtype", choices=["auto", "gguf", "bf16", "fp32"], default="auto")
    p.add_argument("--parallel", type=int, default=64, help="engine: most sequences running at once")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="engine KV budget in tokens")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each batch, alternating which goes first; the medians are reported")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p


def _prompts(engine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    out = []
    for i in range(n):
        text = f"Invent person number {i} (name, age, job, city, hobbies) and answer in JSON."
        if tok.chat_template is not None:
            out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                                  add_special_tokens=False))
        else:
            out.append(tok.encode(text))
    return out


def _run(engine, requests) -> dict[str, Any]:
    """Submit every (prompt, params) at once and step to the end; per-request output lengths."""
    ids = [engine.add_request(p, q) for p, q in requests]
    lengths = dict.fromkeys(ids, 0)
    reasons: dict[str, str] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for ev in engine.step():
            lengths[ev.request_id] += len(ev.token_ids)
            if ev.finished:
                reasons[ev.request_id] = ev.finish_reason.value
    elapsed = time.perf_counter() - start
    tokens = sum(lengths.values())
    return {"elapsed_seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "lengths": [lengths[r] for r in ids], "finish_reasons": [reasons[r] for r in ids]}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]
    return {**best, "runs_output_tok_s": [r["output_tok_s"] for r in runs]}


class _MaskTimer:
    """Counts the mask worker's time by wrapping the function it runs (masks.compute_masks)."""

    def __init__(self) -> None:
        from tokenmill.structured import masks

        self.module = masks
        self.original = masks.compute_masks
        self.seconds = 0.0
        self.rows = 0

    def __enter__(self) -> "_MaskTimer":
        def timed(constraints):
            start = time.perf_counter()
            try:
                return self.original(constraints)
            finally:
                self.seconds += time.perf_counter() - start
                self.rows += len(constraints)

        self.module.compute_masks = timed
        return self

    def __exit__(self, *exc) -> None:
        self.module.compute_masks = self.original


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams
    from tokenmill.store import resolve_model
    from tokenmill.structured import GrammarCompiler, GrammarSpec, grammar_tokenizer

    set_threads(args.threads)
    path = str(resolve_model(args.model))
    # No prefix cache: the second run would otherwise find every prompt computed by the first.
    cfg = EngineConfig(dtype=args.dtype, parallel=args.parallel, max_total_tokens=args.max_total_tokens,
                       enable_prefix_caching=False)
    engine = LLMEngine.from_path(path, cfg)
    start = time.perf_counter()
    grammar_tokenizer(engine.tokenizer)
    vocab_s = time.perf_counter() - start
    start = time.perf_counter()
    grammar = GrammarCompiler(engine.tokenizer).compile_now(GrammarSpec("json_schema", SCHEMA))
    compile_s = time.perf_counter() - start
    prompts = _prompts(engine, args.num_requests)

    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)  # keep first-call costs out
    _run(engine, [(prompts[0], warm)])

    constrained_reqs = [(p, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i,
                                           constraint=grammar)) for i, p in enumerate(prompts)]
    progress(f"constrained: {args.num_requests} requests")
    with _MaskTimer() as timer:
        runs_c = [_run(engine, constrained_reqs)]
    # Seeded, so every run of the same batch writes the same tokens.
    plain_reqs = [(p, SamplingParams(max_tokens=n, temperature=args.temperature, seed=i, ignore_eos=True))
                  for i, (p, n) in enumerate(zip(prompts, runs_c[0]["lengths"]))]
    runs_u = []
    for k in range(args.repeats):
        # Alternate the order (C U U C C U ...) so a drift in machine load hits both alike.
        order = ("u", "c") if k % 2 == 0 else ("c", "u")
        for kind in order:
            if kind == "u":
                progress("unconstrained: the same prompts and seeds, the same number of tokens each")
                runs_u.append(_run(engine, plain_reqs))
            elif len(runs_c) < args.repeats:
                progress(f"constrained: {args.num_requests} requests")
                runs_c.append(_run(engine, constrained_reqs))
    constrained = _median_run(runs_c)
    plain = _median_run(runs_u)
    constrained["mask_seconds"] = timer.seconds
    constrained["mask_us_per_token"] = timer.seconds / max(timer.rows, 1) * 1e6
    constrained["num_valid"] = sum(r == "stop" for r in constrained["finish_reasons"])
    return {"benchmark": "structured", "model": args.model, "environment": environment(),
            "num_requests": args.num_requests, "schema": SCHEMA, "vocab_build_seconds": vocab_s,
            "compile_seconds": compile_s, "constrained": constrained, "unconstrained": plain,
            "ratio_constrained_over_unconstrained": ratio(constrained["output_tok_s"], plain["output_tok_s"])}


def main(argv: list[str] | None = None, prog: str = "tokenmill bench structured") -> int:
    args = build_parser(prog).parse_args(argv)
    r = run(args)
    c, u = r["constrained"], r["unconstrained"]
    print(f"structured output, {r['num_requests']} JSON-schema requests at once ({r['model']})")
    print(f"  grammar vocabulary   {r['vocab_build_seconds'] * 1e3:8.0f} ms (once per model)")
    print(f"  schema compile       {r['compile_seconds'] * 1e3:8.1f} ms (once per schema)")
    runs = ", ".join(fmt(x) for x in c["runs_output_tok_s"])
    print(f"  constrained          {fmt(c['output_tok_s'])} output tok/s  ({c['output_tokens']} tokens, "
          f"{c['num_valid']}/{r['num_requests']} complete; runs {runs})")
    runs = ", ".join(fmt(x) for x in u["runs_output_tok_s"])
    print(f"  unconstrained        {fmt(u['output_tok_s'])} output tok/s  ({u['output_tokens']} tokens; runs {runs})")
    print(f"  ratio                {fmt(r['ratio_constrained_over_unconstrained'], 2)}x  (target >= 0.9x)")
    print(f"  mask                 {c['mask_us_per_token']:8.0f} us per constrained token "
          f"({c['mask_seconds'] * 1e3:.0f} ms in all, beside the model steps)")
    write_json(args.json, {k: v for k, v in r.items()} | {"schema": json.dumps(SCHEMA)})
    return 0
