"""Single-stream greedy decode: load time and decode tokens/s of one request at a time, tokenmill
next to transformers on the same GGUF and dtype, measured in the same run, with the ratio.

Decode tok/s = (generated tokens - 1) / (time of the last token - time of the first token), so the
prefill (time to the first token) is reported on its own. Per dtype both sides are loaded, each runs
an untimed warm-up, then --repeats timed runs alternating tokenmill / transformers (so a change in
machine load hits both); each side's median run is reported, and the ratio is the median of the
per-pair ratios."""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

from tokenmill.bench.common import (corpus_prompts, environment, fmt, hf_generate, hf_pad_id, load_hf, loadavg,
                                    progress, random_prompt, ratio, set_threads, write_json)


def build_parser(prog: str = "tokenmill bench single-stream") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model name or .gguf path (default: smollm2)")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma-separated, from bf16,fp32 (default: both)")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per side; the median is reported")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="engine KV budget in tokens")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="eager model steps (the server's default compiles them)")
    p.add_argument("--json", metavar="PATH")
    return p


def _summary(runs: list[dict[str, float]], load_s: float, extra: dict[str, Any]) -> dict[str, Any]:
    med = sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]
    return {"load_seconds": load_s, **extra, "decode_tok_s": med["decode_tok_s"], "prefill_tok_s": med["prefill_tok_s"],
            "ttft_ms": med["ttft_ms"], "decode_tok_s_runs": [r["decode_tok_s"] for r in runs],
            "prefill_tok_s_runs": [r["prefill_tok_s"] for r in runs],
            "decode_tok_s_stdev": statistics.pstdev([r["decode_tok_s"] for r in runs])}


def _rates(prompt_len: int, t0: float, first: float, last: float, n: int) -> dict[str, float]:
    return {"decode_tok_s": (n - 1) / (last - first) if n > 1 and last > first else 0.0,
            "prefill_tok_s": prompt_len / (first - t0), "ttft_ms": (first - t0) * 1e3}


class TokenmillSide:
    def __init__(self, gguf_path: str, dtype: str, max_total_tokens: int, compile: bool = True):
        from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams

        self._params = SamplingParams
        start = time.perf_counter()
        self.engine = LLMEngine.from_path(gguf_path, EngineConfig(dtype=dtype, max_total_tokens=max_total_tokens,
                                                                           compile=compile))
        self.init_seconds = time.perf_counter() - start
        self.load_seconds = self.engine.loaded.load_seconds
        self.vocab_size = self.engine.loaded.config.vocab_size

    def once(self, ids: list[int], n: int) -> dict[str, float]:
        times: list[float] = []
        t0 = time.perf_counter()
        self.engine.add_request(ids, self._params(max_tokens=n, temperature=0, ignore_eos=True))
        while self.engine.has_unfinished():
            events = self.engine.step()
            now = time.perf_counter()
            times += [now] * sum(len(ev.token_ids) for ev in events)
        return _rates(len(ids), t0, times[0], times[-1], len(times))


class HFSide:
    def __init__(self, gguf_path: str, dtype: str):
        self.model, self.load_seconds = load_hf(gguf_path, dtype)
        self.pad = hf_pad_id(self.model)
        self.vocab_size = self.model.config.vocab_size

    def once(self, ids: list[int], n: int) -> dict[str, float]:
        res = hf_generate(self.model, [ids], n, self.pad)
        return _rates(len(ids), 0.0, res["first_token_s"], res["last_token_s"], res["new_tokens"])


def run_dtype(gguf_path: str, prompts: list[list[int]], dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both sides loaded at once, timed runs alternating tokenmill / transformers, so a change in
    machine load hits both; the ratio is the median of the per-pair ratios."""
    entry: dict[str, Any] = {"loadavg_start": loadavg()}
    progress(f"loading tokenmill {dtype}")
    tm = TokenmillSide(gguf_path, dtype, args.max_total_tokens, compile=not args.no_compile)
    hf = None
    if not args.skip_hf:
        progress(f"loading transformers {dtype}")
        hf = HFSide(gguf_path, dtype)
    sides = [("tokenmill", tm)] + ([("hf", hf)] if hf else [])
    for _, side in sides:  # warm-up, untimed; random ids never share a prefix with the measured prompts
        side.once(random_prompt(side.vocab_size, len(prompts[0]), seed=99), 8)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in sides}
    # One prompt per repeat, each a different corpus window: a repeated prompt would hit the prefix cache.
    for i, p in enumerate(prompts):
        progress(f"{dtype} run {i + 1}/{len(prompts)}")
        for name, side in sides:
            runs[name].append(side.once(p, args.max_tokens))
    entry["tokenmill"] = _summary(runs["tokenmill"], tm.load_seconds,
                                  {"engine_init_seconds": tm.init_seconds, "dtype": dtype})
    entry["hf"] = None
    if hf:
        entry["hf"] = _summary(runs["hf"], hf.load_seconds,
                               {"dtype": dtype, "attn_implementation": hf.model.config._attn_implementation})
        pairs = lambda k: sorted(ratio(a[k], b[k]) or 0.0 for a, b in zip(runs["tokenmill"], runs["hf"]))  # noqa: E731
        entry["ratio_tokenmill_over_hf"] = {
            "decode_tok_s": statistics.median(pairs("decode_tok_s")),
            "prefill_tok_s": statistics.median(pairs("prefill_tok_s")),
            "decode_tok_s_pairs": pairs("decode_tok_s"),
            "load_seconds": ratio(tm.load_seconds, hf.load_seconds),
        }
    else:
        entry["ratio_tokenmill_over_hf"] = {"decode_tok_s": None, "prefill_tok_s": None, "load_seconds": None}
    entry["loadavg_end"] = loadavg()
    del tm, hf, sides
    gc.collect()
    return entry


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.gguf import open_gguf
    from tokenmill.store import resolve_model
    from tokenmill.tokenizer import Tokenizer

    set_threads(args.threads)
    gguf_path = str(resolve_model(args.model))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in ("bf16", "fp32"):
            raise SystemExit(f"unknown dtype {d!r} (choose from bf16, fp32)")
    if args.repeats < 1 or args.max_tokens < 2 or args.prompt_len < 1:
        raise SystemExit("need --repeats >= 1, --max-tokens >= 2, --prompt-len >= 1")
    tok = Tokenizer.from_gguf_metadata(open_gguf(gguf_path).metadata)
    prompts = corpus_prompts(tok.encode, args.repeats, args.prompt_len)
    result: dict[str, Any] = {
        "benchmark": "single_stream", "model": gguf_path, "env": environment(),
        "config": {"prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats},
        "loadavg_start": loadavg(), "runs": {},
    }
    for d in dtypes:
        result["runs"][d] = run_dtype(gguf_path, prompts, d, args)
    result["loadavg_end"] = loadavg()
    return result


def report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [f"single stream: prompt {c['prompt_len']} tokens, {c['max_tokens']} new tokens, greedy, EOS ignored; "
             f"median of {c['repeats']} alternating runs; torch {r['env']['torch']} threads={r['env']['torch_threads']}",
             f"model {r['model']}", ""]
    lines.append(f"{'dtype':6}{'side':14}{'load s':>8}{'prefill tok/s':>15}{'TTFT ms':>9}{'decode tok/s':>14}"
                 f"  {'runs'}")
    for d, e in r["runs"].items():
        for side, name in (("tokenmill", "tokenmill"), ("hf", "transformers")):
            s = e[side]
            if s is None:
                continue
            runs = ",".join(f"{x:.1f}" for x in s["decode_tok_s_runs"])
            lines.append(f"{d:6}{name:14}{s['load_seconds']:8.2f}{s['prefill_tok_s']:15.1f}{s['ttft_ms']:9.0f}"
                         f"{s['decode_tok_s']:14.1f}  {runs}")
        ra = e["ratio_tokenmill_over_hf"]
        if e["hf"] is not None:
            pairs = ",".join(f"{x:.2f}" for x in ra["decode_tok_s_pairs"])
            lines.append(f"{d:6}{'ratio tm/hf':14}{fmt(ra['load_seconds'], 2):>8}{fmt(ra['prefill_tok_s'], 2):>15}"
                         f"{'':9}{fmt(ra['decode_tok_s'], 2):>14}  {pairs} (per pair)")
        lines.append(f"       loadavg {e['loadavg_start']} -> {e['loadavg_end']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "tokenmill bench single-stream") -> int:
    args = build_parser(prog).parse_args(argv)
    result = run(args)
    print(report(result), flush=True)
    write_json(args.json, result)
    return 0
