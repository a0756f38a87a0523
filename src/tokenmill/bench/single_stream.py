"""Single-stream greedy decode: load time, prefill and decode tokens/s of one request at a time,
tokenmill next to its peers on the same GGUF and token ids, measured in the same run, with the ratios.

Peers (--peer, comma-separated): transformers (the default; same dtype as tokenmill) and llama-cpp
(llama.cpp through llama-cpp-python, on the GGUF's own quantized weights, whatever --dtypes says;
loaded once, n_ctx sized for the prompt, n_batch 512, --threads for both its thread pools).

Decode tok/s = (generated tokens - 1) / (time of the last token - time of the first token), so the
prefill (time to the first token; prefill tok/s = prompt tokens / TTFT) is reported on its own. Per
dtype every side is loaded, each runs an untimed warm-up, then --repeats timed runs alternating the
sides (so a change in machine load hits all of them); each figure's median over the runs is
reported, and each ratio is the median of the per-pair ratios. --skip-tokenmill measures the peers alone.

    tokenmill bench single-stream --peer llama-cpp --threads 2
    tokenmill bench single-stream --peer llama-cpp --skip-tokenmill --prompt-len 7900 --max-tokens 64"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

from tokenmill.bench.common import (corpus_prompts, cpu_flags, environment, fmt, hf_generate, hf_pad_id, load_hf,
                                    loadavg, progress, random_prompt, ratio, resolve_bench_device, set_threads,
                                    write_json)

# --peer names -> the key of each side's figures in the JSON and its name in the report
PEERS = {"transformers": ("hf", "transformers"), "llama-cpp": ("llama_cpp", "llama.cpp")}


def build_parser(prog: str = "tokenmill bench single-stream") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model name or .gguf path (default: smollm2)")
    p.add_argument("--dtypes", default="auto", help="comma-separated tokenmill --dtype values, from "
                   "auto,gguf,bf16,fp32 (default: auto, what the server runs); transformers runs gguf/auto as fp32")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu",
                   help="where tokenmill and transformers run (cuda: the GPU path, CUDA graphs unless --no-compile)")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per side; the median is reported")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="engine KV budget in tokens")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads, and llama.cpp's n_threads/n_threads_batch (default: torch's count)")
    p.add_argument("--peer", default="transformers",
                   help="comma-separated peers from transformers,llama-cpp (default: transformers)")
    p.add_argument("--skip-hf", action="store_true", help="drop transformers from the peers")
    p.add_argument("--skip-tokenmill", action="store_true", help="measure the peers alone")
    p.add_argument("--llama-flash-attn", action="store_true", help="llama.cpp side: flash attention on "
                   "(llama-cpp-python's default is off)")
    p.add_argument("--llama-n-batch", type=int, default=512, help="llama.cpp side: n_batch (default 512)")
    p.add_argument("--no-compile", action="store_true", help="eager model steps (the server's default compiles them)")
    p.add_argument("--speculative", choices=["ngram", "off"], default="ngram",
                   help="tokenmill's speculative decoding: prompt lookup (the server's default) or off, to "
                        "compare plain decoding (the peers never speculate here)")
    p.add_argument("--json", metavar="PATH")
    return p


def parse_peers(text: str, skip_hf: bool = False) -> list[str]:
    """The --peer list, validated and de-duplicated in order; --skip-hf drops transformers."""
    aliases = {"hf": "transformers", "llama.cpp": "llama-cpp", "llamacpp": "llama-cpp"}
    peers: list[str] = []
    for name in (x.strip().lower().replace("_", "-") for x in text.split(",")):
        if name in ("", "none"):
            continue
        name = aliases.get(name, name)
        if name not in PEERS:
            raise SystemExit(f"unknown peer {name!r} (choose from {', '.join(PEERS)})")
        if name not in peers:
            peers.append(name)
    return [p for p in peers if not (skip_hf and p == "transformers")]


def _summary(runs: list[dict[str, float]], load_s: float, extra: dict[str, Any]) -> dict[str, Any]:
    """Each figure's own median over the runs (the upper one for an even count): prefill and decode
    are separate targets (pp512 runs hardly decode), so neither is taken from the other's median run."""
    med = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in ("decode_tok_s", "prefill_tok_s", "ttft_ms")}
    return {"load_seconds": load_s, **extra, **med, "decode_tok_s_runs": [r["decode_tok_s"] for r in runs],
            "prefill_tok_s_runs": [r["prefill_tok_s"] for r in runs],
            "decode_tok_s_stdev": statistics.pstdev([r["decode_tok_s"] for r in runs])}


def _rates(prompt_len: int, t0: float, first: float, last: float, n: int) -> dict[str, float]:
    return {"decode_tok_s": (n - 1) / (last - first) if n > 1 and last > first else 0.0,
            "prefill_tok_s": prompt_len / (first - t0), "ttft_ms": (first - t0) * 1e3}


class TokenmillSide:
    def __init__(self, gguf_path: str, dtype: str, max_total_tokens: int, compile: bool = True,
                 device: str = "cpu", speculative: str = "ngram"):
        from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams

        self._params = SamplingParams
        start = time.perf_counter()
        self.engine = LLMEngine.from_path(gguf_path, EngineConfig(dtype=dtype, max_total_tokens=max_total_tokens,
                                                                  compile=compile, device=device,
                                                                  speculative=speculative))
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
    def __init__(self, gguf_path: str, dtype: str, device: str = "cpu"):
        self.model, self.load_seconds = load_hf(gguf_path, dtype, device)
        self.pad = hf_pad_id(self.model)
        self.vocab_size = self.model.config.vocab_size

    def once(self, ids: list[int], n: int) -> dict[str, float]:
        res = hf_generate(self.model, [ids], n, self.pad)
        return _rates(len(ids), 0.0, res["first_token_s"], res["last_token_s"], res["new_tokens"])


class LlamaCppSide:
    """llama.cpp on the GGUF's own weights; timed as TokenmillSide: t0 before the prompt goes in, one
    timestamp per token as soon as its id is known."""

    # llama.cpp reserves its compute buffers for the worst case when the context is created, so a
    # full-length warm-up (minutes for an 8k prompt on 2 cores) would only repeat what one batch does.
    warmup_prompt_cap = 512

    def __init__(self, gguf_path: str, threads: int, n_ctx: int, n_batch: int, flash_attn: bool):
        from tokenmill.bench.llama_cpp_peer import LlamaCppModel

        self.model = LlamaCppModel(gguf_path, threads=threads, n_ctx=n_ctx, n_batch=n_batch, flash_attn=flash_attn)
        self.load_seconds = self.model.load_seconds
        self.vocab_size = self.model.vocab_size

    def once(self, ids: list[int], n: int) -> dict[str, float]:
        g = self.model.greedy(ids, n)
        return _rates(len(ids), g.t0, g.token_times[0], g.token_times[-1], len(g.token_times))


def run_dtype(gguf_path: str, prompts: list[list[int]], dtype: str, args: argparse.Namespace,
              shared: dict[str, Any]) -> dict[str, Any]:
    """Every side loaded at once (`shared` holds sides loaded once for all dtypes, i.e. llama.cpp),
    timed runs alternating between them, so a change in machine load hits all; each ratio is the
    median of the per-pair ratios."""
    entry: dict[str, Any] = {"loadavg_start": loadavg()}
    sides: list[tuple[str, Any]] = []
    tm = None
    if not args.skip_tokenmill:
        progress(f"loading tokenmill {dtype}")
        tm = TokenmillSide(gguf_path, dtype, args.max_total_tokens, compile=not args.no_compile,
                           device=args.device, speculative=args.speculative)
        sides.append(("tokenmill", tm))
    if "transformers" in args.peers:
        progress(f"loading transformers {dtype}")
        hf_dtype = dtype if dtype in ("bf16", "fp32") else "fp32" if args.device == "cpu" else "bf16"
        sides.append(("hf", HFSide(gguf_path, hf_dtype, args.device)))
    sides += list(shared.items())
    for _, side in sides:  # warm-up, untimed; random ids never share a prefix with the measured prompts
        n = min(len(prompts[0]), getattr(side, "warmup_prompt_cap", len(prompts[0])))
        side.once(random_prompt(side.vocab_size, n, seed=99), 8)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in sides}
    # One prompt per repeat, each a different corpus window: a repeated prompt would hit the prefix cache.
    for i, p in enumerate(prompts):
        progress(f"{dtype} run {i + 1}/{len(prompts)}")
        for name, side in sides:
            runs[name].append(side.once(p, args.max_tokens))
    by_name = dict(sides)
    entry["tokenmill"] = None
    if tm is not None:
        entry["tokenmill"] = _summary(runs["tokenmill"], tm.load_seconds,
                                      {"engine_init_seconds": tm.init_seconds, "dtype": dtype})
    for key, _ in PEERS.values():
        side = by_name.get(key)
        entry[key] = None
        if side is not None:
            extra = {"dtype": dtype, "attn_implementation": side.model.config._attn_implementation} if key == "hf" \
                else {"weights": "gguf", "n_ctx": side.model.n_ctx, "flash_attn": side.model.flash_attn}
            entry[key] = _summary(runs[key], side.load_seconds, extra)
        ra: dict[str, Any] = {"decode_tok_s": None, "prefill_tok_s": None, "load_seconds": None}
        if side is not None and tm is not None:
            pairs = lambda k: sorted(ratio(a[k], b[k]) or 0.0 for a, b in zip(runs["tokenmill"], runs[key]))  # noqa: E731,B023
            ra = {"decode_tok_s": statistics.median(pairs("decode_tok_s")),
                  "prefill_tok_s": statistics.median(pairs("prefill_tok_s")),
                  "decode_tok_s_pairs": pairs("decode_tok_s"),
                  "load_seconds": ratio(tm.load_seconds, side.load_seconds)}
        entry[f"ratio_tokenmill_over_{key}"] = ra
    entry["loadavg_end"] = loadavg()
    del tm, sides, by_name
    gc.collect()
    return entry


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.gguf import open_gguf
    from tokenmill.store import resolve_model
    from tokenmill.tokenizer import Tokenizer

    set_threads(args.threads)
    args.device = resolve_bench_device(args.device)
    gguf_path = str(resolve_model(args.model))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in ("auto", "gguf", "bf16", "fp32"):
            raise SystemExit(f"unknown dtype {d!r} (choose from auto, gguf, bf16, fp32)")
    if args.repeats < 1 or args.max_tokens < 2 or args.prompt_len < 1:
        raise SystemExit("need --repeats >= 1, --max-tokens >= 2, --prompt-len >= 1")
    args.peers = parse_peers(args.peer, args.skip_hf)
    if args.skip_tokenmill and not args.peers:
        raise SystemExit("--skip-tokenmill leaves nothing to measure: name a --peer")
    if args.skip_tokenmill and "transformers" not in args.peers:
        dtypes = ["gguf"]  # llama.cpp alone: it runs the GGUF's own weights, tokenmill's dtypes do not apply
    if not args.skip_tokenmill and args.max_total_tokens < args.prompt_len + args.max_tokens:
        raise SystemExit(f"--max-total-tokens {args.max_total_tokens} is below prompt + new tokens "
                         f"({args.prompt_len + args.max_tokens})")
    shared: dict[str, Any] = {}
    env = environment()
    if "llama-cpp" in args.peers:
        import torch

        from tokenmill.bench.llama_cpp_peer import LlamaCppMissing, context_size, describe

        try:
            env["llama_cpp"] = describe()
        except LlamaCppMissing as exc:
            raise SystemExit(str(exc)) from None
        progress("loading llama.cpp")
        shared["llama_cpp"] = LlamaCppSide(gguf_path, args.threads or torch.get_num_threads(),
                                           context_size(args.prompt_len, args.max_tokens), args.llama_n_batch,
                                           args.llama_flash_attn)
    tok = Tokenizer.from_gguf_metadata(open_gguf(gguf_path).metadata)
    prompts = corpus_prompts(tok.encode, args.repeats, args.prompt_len)
    result: dict[str, Any] = {
        "benchmark": "single_stream", "model": gguf_path, "env": env,
        "config": {"prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats,
                   "peers": args.peers, "skip_tokenmill": args.skip_tokenmill, "device": args.device,
                   "speculative": args.speculative},
        "loadavg_start": loadavg(), "runs": {},
    }
    for d in dtypes:
        result["runs"][d] = run_dtype(gguf_path, prompts, d, args, shared)
    for side in shared.values():
        side.model.close()
    result["loadavg_end"] = loadavg()
    return result


def report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [f"single stream: prompt {c['prompt_len']} tokens, {c['max_tokens']} new tokens, greedy, EOS ignored; "
             f"median of {c['repeats']} alternating runs; torch {r['env']['torch']} threads={r['env']['torch_threads']}",
             f"model {r['model']}; device {c.get('device', 'cpu')}; tokenmill's speculative decoding: "
             f"{c.get('speculative', 'ngram')} (the peers: none)"]
    if r["env"].get("llama_cpp"):
        lc = r["env"]["llama_cpp"]
        extra = f"; extra buffer types {lc['extra_buffer_types']}" if lc.get("extra_buffer_types") else ""
        lines.append(f"llama-cpp-python {lc['llama_cpp_python']}: {lc['system_info']}{extra}")
    lines += [f"cpu flags: {cpu_flags()}; huge pages: {r['env'].get('huge_pages', '?')}", ""]
    lines.append(f"{'dtype':6}{'side':20}{'load s':>8}{'prefill tok/s':>15}{'TTFT ms':>9}{'decode tok/s':>14}"
                 f"  {'runs'}")
    for d, e in r["runs"].items():
        for key, name in [("tokenmill", "tokenmill")] + list(PEERS.values()):
            s = e.get(key)
            if s is None:
                continue
            runs = (",".join(f"{x:.1f}" for x in s["decode_tok_s_runs"]) + " | prefill "
                    + ",".join(f"{x:.1f}" for x in s["prefill_tok_s_runs"]))
            lines.append(f"{d:6}{name:20}{s['load_seconds']:8.2f}{s['prefill_tok_s']:15.1f}{s['ttft_ms']:9.0f}"
                         f"{s['decode_tok_s']:14.1f}  decode {runs}")
        for key, name in PEERS.values():
            ra = e.get(f"ratio_tokenmill_over_{key}")
            if e.get(key) is None or e.get("tokenmill") is None or not ra:
                continue
            pairs = ",".join(f"{x:.2f}" for x in ra["decode_tok_s_pairs"])
            label = "tm/hf" if key == "hf" else f"tm/{name}"
            lines.append(f"{d:6}{'ratio ' + label:20}{fmt(ra['load_seconds'], 2):>8}{fmt(ra['prefill_tok_s'], 2):>15}"
                         f"{'':9}{fmt(ra['decode_tok_s'], 2):>14}  {pairs} (per pair)")
        lines.append(f"       loadavg {e['loadavg_start']} -> {e['loadavg_end']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "tokenmill bench single-stream") -> int:
    args = build_parser(prog).parse_args(argv)
    result = run(args)
    print(report(result), flush=True)
    write_json(args.json, result)
    return 0
