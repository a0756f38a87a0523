"""`tokenmill bench speculative`: what speculative decoding (prompt lookup) buys, and that it changes
nothing.

Fixed prompts (bench/speculative_prompts.py): input-grounded ones (code edits, extraction, summaries)
whose answers repeat their input, and open-ended ones whose answers do not. For each, one stream greedy
with speculation off and on (the same engine, switched per request; the sides alternate, each run
repeated, medians reported): decode tokens/s, the ratio, the acceptance rate (accepted / proposed) and
tokens per verification. Then a burst of 16 requests (the prompts in turn) submitted at once: output
tokens/s from submission to the last token, off and on. The greedy tokens of every prompt, on against
off, are compared, and a mismatch is reported loudly (and fails the run). llama.cpp's own prompt-lookup
speculation (llama-cpp-python's LlamaPromptLookupDecoding) runs in the same process when
llama_cpp is importable; otherwise its column says n/a.

On a shared machine, other processes' load moves every figure: the repeats alternate the sides and the
medians are compared; each run's process CPU time is reported too (tokens per CPU second), which
contention moves less.

--predicted adds a side: speculation on, with each prompt's own answer as the request's predicted output
(OpenAI's `prediction`, looked up as the context is): what a right prediction adds to prompt lookup.

--bound then says what this machine allows (tokenmill.bench.speculative_bound): what a step of 1 to k+1
rows costs here, and each prompt's greedy answer replayed at those costs with the engine's policy and
with proposals cut to exactly what the answer accepts, beside the measured ratio."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bench.common import cpu_flags, cpu_model, huge_pages_state, loadavg, set_threads
from tokenmill.bench.speculative_bound import COST_PROMPT, STEP_COST_STEPS, bounds, step_costs
from tokenmill.bench.speculative_prompts import all_prompts

BURST = 16
LLAMA_CPP_PRED_TOKENS = 10


def build_parser(prog: str = "tokenmill bench speculative") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model name or .gguf path (default: smollm2)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (greedy; EOS ends one earlier)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side and prompt; medians are reported")
    p.add_argument("--burst-repeats", type=int, default=2, help="timed bursts per side")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: physical cores)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="the engine's cap (default: its own)")
    p.add_argument("--spec-ngram-min", type=int, default=None)
    p.add_argument("--spec-ngram-max", type=int, default=None)
    p.add_argument("--only", default="", help="comma-separated prompt names (default: all)")
    p.add_argument("--skip-burst", action="store_true")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--bound", action="store_true",
                   help="also time steps of 1..k+1 rows here and replay each prompt's greedy answer at those costs, "
                        "with the engine's policy and with each lookup's proposal cut to exactly what the answer "
                        "accepts (perfect length), beside the measured ratio")
    p.add_argument("--predicted", action="store_true",
                   help="also each prompt with its own answer as the request's predicted output (OpenAI's "
                        "`prediction`): what a right prediction adds to prompt lookup")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


@dataclass
class Run:
    tokens: list[int]
    decode_tok_s: float       # (n - 1) / (last token - first token), wall clock
    cpu_tok_s: float          # the same tokens over the process CPU time between them
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0


@dataclass
class PromptResult:
    name: str
    kind: str
    prompt_tokens: int
    off: list[Run] = field(default_factory=list)
    on: list[Run] = field(default_factory=list)
    predicted: list[Run] = field(default_factory=list)  # on, with the answer as the predicted output
    llama_off: float | None = None
    llama_on: float | None = None

    @property
    def same(self) -> bool:
        return all(r.tokens == self.off[0].tokens for r in self.off + self.on + self.predicted)

    def median(self, side: str, attr: str = "decode_tok_s") -> float:
        return statistics.median(getattr(r, attr) for r in getattr(self, side))

    def acceptance(self) -> tuple[float, float]:
        """(accepted / proposed, tokens per verification) over the runs with speculation."""
        drafts = sum(r.drafts for r in self.on)
        proposed = sum(r.draft_tokens for r in self.on)
        accepted = sum(r.accepted for r in self.on)
        return (accepted / proposed if proposed else 0.0), (1 + accepted / drafts if drafts else 0.0)


def encode_chat(tokenizer, text: str) -> list[int]:
    """text as a user's message in the model's chat template, as token ids."""
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return tokenizer.encode(rendered, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - a model without a chat template gets the text itself
        return tokenizer.encode(text)


class Side:
    """One engine; requests choose speculation on or off."""

    def __init__(self, path: str, args: argparse.Namespace):
        from tokenmill.engine import EngineConfig, LLMEngine

        spec = {k: v for k, v in (("num_speculative_tokens", args.num_speculative_tokens),
                                  ("spec_ngram_min", args.spec_ngram_min),
                                  ("spec_ngram_max", args.spec_ngram_max)) if v is not None}
        if "spec_ngram_max" in spec and "spec_ngram_min" not in spec:  # as serve: the minimum follows it down
            spec["spec_ngram_min"] = min(EngineConfig.spec_ngram_min, spec["spec_ngram_max"])
        self.engine = LLMEngine.from_path(path, EngineConfig(max_total_tokens=32768, **spec))
        if self.engine.scheduler.speculator is None:
            raise SystemExit("this model does not run on the native kernels here (GGUF weights with the compiled "
                             "core): the engine does not speculate, nothing to compare")
        self.tokenizer = self.engine.tokenizer

    def encode_chat(self, text: str) -> list[int]:
        return encode_chat(self.tokenizer, text)

    def _params(self, n: int, spec: bool, prediction: tuple[int, ...] = ()):
        from tokenmill.engine import SamplingParams

        return SamplingParams(max_tokens=n, temperature=0, speculative=spec, prediction_ids=prediction)

    def once(self, ids: list[int], n: int, spec: bool, prediction: tuple[int, ...] = ()) -> Run:
        e = self.engine
        c = e.stats.spec
        before = (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)
        e.add_request(ids, self._params(n, spec, prediction))
        out: list[int] = []
        first = first_cpu = None
        while e.has_unfinished():
            events = e.step()
            for ev in events:
                if ev.token_ids and first is None:
                    first, first_cpu = time.perf_counter(), time.process_time()
                out += ev.token_ids
        last, last_cpu = time.perf_counter(), time.process_time()
        n_out = len(out) - 1
        return Run(out, n_out / (last - first) if n_out > 0 else 0.0,
                   n_out / (last_cpu - first_cpu) if n_out > 0 and last_cpu > first_cpu else 0.0,
                   c.num_drafts - before[0], c.num_draft_tokens - before[1], c.num_accepted_tokens - before[2])

    def burst(self, prompts: list[list[int]], n: int, spec: bool) -> tuple[float, float, list[list[int]]]:
        """All at once; (output tokens/s wall, per CPU second, each request's tokens)."""
        e = self.engine
        t0, c0 = time.perf_counter(), time.process_time()
        rids = [e.add_request(p, self._params(n, spec)) for p in prompts]
        outs: dict[str, list[int]] = {r: [] for r in rids}
        while e.has_unfinished():
            for ev in e.step():
                outs[ev.request_id] += ev.token_ids
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        total = sum(len(v) for v in outs.values())
        return total / wall, total / cpu, [outs[r] for r in rids]


def llama_cpp_rates(path: str, prompts: list[tuple[str, list[int]]], n: int, k: int, threads: int | None,
                    repeats: int) -> dict[str, tuple[float, float]] | str:
    """Per prompt name, llama.cpp's decode tokens/s without and with its prompt-lookup draft model
    (medians), or why there are none."""
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as exc:
        return f"n/a (llama_cpp not importable: {exc})"
    import os

    from tokenmill.bench.llama_cpp_peer import without_extra_buffer_types

    threads = threads or os.cpu_count() or 1
    n_ctx = max(len(ids) for _, ids in prompts) + n + 64
    common = dict(model_path=path, n_ctx=-(-n_ctx // 256) * 256, n_threads=threads, n_threads_batch=threads,
                  verbose=False, logits_all=False)
    # Without llama.cpp's extra buffer types (weight repacking, its AMX matmul), on every CPU: the AMX
    # path crashes a build with AMX on this kind of CPU (README, llama.cpp as the peer), and SmolLM2's
    # Q4_1 weights are not repacked on AVX-512 anyway.
    with without_extra_buffer_types():
        models = {"off": llama_cpp.Llama(**common),
                  "on": llama_cpp.Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))}

    def rate(llm, ids) -> float:
        llm.reset()
        times = []
        for _ in llm.create_completion(prompt=ids, max_tokens=n, temperature=0.0, top_k=1, stream=True):
            times.append(time.perf_counter())
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0

    out = {}
    for name, ids in prompts:
        rates = {side: [] for side in models}
        for r in range(repeats):
            for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
                rates[side].append(rate(models[side], ids))
        out[name] = (statistics.median(rates["off"]), statistics.median(rates["on"]))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.store import resolve_model

    set_threads(args.threads)
    path = str(resolve_model(args.model))
    side = Side(path, args)
    prompts = {name: (kind, side.encode_chat(text)) for name, (kind, text) in all_prompts().items()
               if not args.only or name in args.only.split(",")}
    # Warm-up: the first steps pay for allocations and page faults.
    side.once(prompts[next(iter(prompts))][1], 8, True)
    results: list[PromptResult] = []
    for name, (kind, ids) in prompts.items():
        res = PromptResult(name, kind, len(ids))
        for r in range(args.repeats):
            for spec in ((False, True) if r % 2 == 0 else (True, False)):
                (res.on if spec else res.off).append(side.once(ids, args.max_tokens, spec))
            if args.predicted:
                res.predicted.append(side.once(ids, args.max_tokens, True, tuple(res.off[0].tokens)))
        results.append(res)
        print(f"  {name}: {res.median('off'):.1f} -> {res.median('on'):.1f} tok/s", file=sys.stderr, flush=True)
    burst: dict[str, Any] | None = None
    if not args.skip_burst:
        ids = [v[1] for v in prompts.values()]
        batch = [ids[i % len(ids)] for i in range(BURST)]
        walls = {False: [], True: []}
        cpus = {False: [], True: []}
        tokens = {}
        for r in range(args.burst_repeats):
            for spec in ((False, True) if r % 2 == 0 else (True, False)):
                wall, cpu, outs = side.burst(batch, args.max_tokens, spec)
                walls[spec].append(wall)
                cpus[spec].append(cpu)
                tokens.setdefault(spec, outs)
        burst = {"off_tok_s": statistics.median(walls[False]), "on_tok_s": statistics.median(walls[True]),
                 "off_cpu_tok_s": statistics.median(cpus[False]), "on_cpu_tok_s": statistics.median(cpus[True]),
                 "same": tokens[False] == tokens[True],
                 "mismatched_requests": [i for i, (a, b) in enumerate(zip(tokens[False], tokens[True])) if a != b]}
    # llama.cpp's own proposal length (LlamaPromptLookupDecoding's default, 10) unless one was asked
    # for: it proposes all k every step, so tokenmill's cap (16, of which its policy uses what pays)
    # would handicap it.
    llama_k = args.num_speculative_tokens or LLAMA_CPP_PRED_TOKENS
    llama = None if args.skip_llama_cpp else llama_cpp_rates(
        path, [(r.name, ids) for r, (_, ids) in zip(results, prompts.values())], args.max_tokens,
        llama_k, args.threads, args.repeats)
    if isinstance(llama, dict):
        for r in results:
            r.llama_off, r.llama_on = llama[r.name]
    bound = _bound(side, results, prompts) if args.bound else None
    return {"results": results, "burst": burst, "llama_cpp": llama if isinstance(llama, str) else "ran", "bound": bound,
            "env": {"cpu": cpu_model(), "flags": cpu_flags(), "loadavg": loadavg(),
                    "threads": side.engine.threads.count, "model": args.model, "max_tokens": args.max_tokens,
                    "repeats": args.repeats, "spec": vars(side.engine.cfg.spec_config()),
                    "llama_cpp_pred_tokens": llama_k, "huge_pages": huge_pages_state()}}


def _bound(side: Side, results: list[PromptResult], prompts: dict[str, tuple[str, list[int]]]) -> dict[str, Any]:
    """What this machine allows (tokenmill.bench.speculative_bound): a step's cost by its rows, measured
    last (its forced proposals must not touch the runs), and each prompt's greedy answer (its first run
    without speculation) replayed at those costs."""
    cfg = side.engine.scheduler.speculator.cfg
    cost = step_costs(side.engine, side.encode_chat(all_prompts()[COST_PROMPT][1]), cfg.num_tokens + 1,
                      STEP_COST_STEPS)
    replayed = bounds({r.name: (r.kind, prompts[r.name][1], r.off[0].tokens) for r in results}, cost, cfg)
    return {"step_ms": {rows: 1e3 * sec for rows, sec in sorted(cost.items())},
            "prompts": {name: {"perfect_length": b, "policy": p} for name, (b, p) in replayed.items()}}


def _geomean(values: list[float]) -> float:
    values = [v for v in values if v > 0]
    return statistics.geometric_mean(values) if values else 0.0


def report(r: dict[str, Any]) -> str:
    env = r["env"]
    lines = [f"speculative decoding (prompt lookup), {env['model']}, greedy, {env['max_tokens']} tokens, "
             f"{env['threads']} threads, {env['cpu']} [{env['flags']}], load {env['loadavg']}",
             f"medians of {env['repeats']} alternated runs per side; decode tok/s (wall), and per CPU second; "
             f"huge pages: {env.get('huge_pages', '?')}",
             "", f"{'prompt':18}{'kind':9}{'prompt':>7}{'off':>8}{'on':>8}{'ratio':>7}{'cpu ratio':>10}"
             f"{'accept':>8}{'tok/ver':>8}{'llama.cpp off/on':>18}  same"]
    mismatches = []
    predicted = [res for res in r["results"] if res.predicted]
    if predicted:
        lines[-1] += "  predicted"
    for res in r["results"]:
        off, on = res.median("off"), res.median("on")
        coff, con = res.median("off", "cpu_tok_s"), res.median("on", "cpu_tok_s")
        acc, per = res.acceptance()
        llama = (f"{res.llama_off:.1f}/{res.llama_on:.1f} {res.llama_on / res.llama_off:.2f}x"
                 if res.llama_off else "n/a")
        lines.append(f"{res.name:18}{res.kind:9}{res.prompt_tokens:7d}{off:8.1f}{on:8.1f}{on / off:6.2f}x"
                     f"{con / coff:9.2f}x{acc:8.0%}{per:8.2f}{llama:>18}  {'yes' if res.same else 'NO'}"
                     + (f"{res.median('predicted') / off:10.2f}x" if res.predicted else ""))
        if not res.same:
            mismatches.append(res.name)
    for kind in ("grounded", "open"):
        rs = [x for x in r["results"] if x.kind == kind]
        if rs:
            g = _geomean([x.median("on") / x.median("off") for x in rs])
            gc = _geomean([x.median("on", "cpu_tok_s") / x.median("off", "cpu_tok_s") for x in rs])
            lines.append(f"{kind + ' (geomean)':34}{'':16}{g:6.2f}x{gc:9.2f}x"
                         + (f"{'':40}{_geomean([x.median('predicted') / x.median('off') for x in rs]):10.2f}x"
                            if all(x.predicted for x in rs) else ""))
    if r["burst"]:
        b = r["burst"]
        lines.append(f"\nburst of {BURST} requests at once: output {b['off_tok_s']:.1f} -> {b['on_tok_s']:.1f} tok/s "
                     f"({b['on_tok_s'] / b['off_tok_s']:.2f}x; per CPU second {b['on_cpu_tok_s'] / b['off_cpu_tok_s']:.2f}x)"
                     f", tokens {'identical' if b['same'] else 'DIFFER'}")
        if not b["same"]:
            mismatches.append(f"burst requests {b['mismatched_requests']}")
    if r.get("bound"):
        lines += _bound_report(r)
    if r["llama_cpp"] != "ran":
        lines.append(f"llama.cpp: {r['llama_cpp']}")
    else:
        lines.append(f"llama.cpp: LlamaPromptLookupDecoding(num_pred_tokens={env['llama_cpp_pred_tokens']})")
    if mismatches:
        lines.append(f"\n!!! GREEDY TOKENS DIFFER WITH SPECULATION ON: {', '.join(mismatches)} !!!")
    return "\n".join(lines)


def _bound_report(r: dict[str, Any]) -> list[str]:
    b = r["bound"]
    lines = ["", f"what this machine allows (--bound): a step of R rows (one sequence at {COST_PROMPT}'s context), ms: "
             + "  ".join(f"{rows}: {ms:.2f}" for rows, ms in b["step_ms"].items()),
             "each prompt's greedy answer replayed at those costs: with the engine's policy, and with each lookup's "
             "proposal cut to exactly what the answer accepts",
             f"{'prompt':18}{'kind':9}{'measured':>10}{'policy replay':>15}{'perfect length':>16}"]
    for res in r["results"]:
        x = b["prompts"][res.name]
        lines.append(f"{res.name:18}{res.kind:9}{res.median('on') / res.median('off'):9.2f}x{x['policy']:14.2f}x"
                     f"{x['perfect_length']:15.2f}x")
    for kind in ("grounded", "open"):
        rs = [x for x in r["results"] if x.kind == kind]
        if rs:
            lines.append(f"{kind + ' (geomean)':27}{_geomean([x.median('on') / x.median('off') for x in rs]):9.2f}x"
                         f"{_geomean([b['prompts'][x.name]['policy'] for x in rs]):14.2f}x"
                         f"{_geomean([b['prompts'][x.name]['perfect_length'] for x in rs]):15.2f}x")
    return lines


def _jsonable(r: dict[str, Any]) -> dict[str, Any]:
    out = dict(r)
    out["results"] = [{"name": x.name, "kind": x.kind, "prompt_tokens": x.prompt_tokens, "same": x.same,
                       "off_tok_s": x.median("off"), "on_tok_s": x.median("on"),
                       "off_cpu_tok_s": x.median("off", "cpu_tok_s"), "on_cpu_tok_s": x.median("on", "cpu_tok_s"),
                       "acceptance": x.acceptance()[0], "tokens_per_verification": x.acceptance()[1],
                       "llama_cpp_off_tok_s": x.llama_off, "llama_cpp_on_tok_s": x.llama_on,
                       "predicted_tok_s": x.median("predicted") if x.predicted else None,
                       "runs": {"off": [r.decode_tok_s for r in x.off], "on": [r.decode_tok_s for r in x.on]}}
                      for x in r["results"]]
    return out


def main(argv: list[str] | None = None, prog: str = "tokenmill bench speculative") -> int:
    args = build_parser(prog).parse_args(argv)
    r = run(args)
    print(report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_jsonable(r), f, indent=2)
    same = all(x.same for x in r["results"]) and (r["burst"] is None or r["burst"]["same"])
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
