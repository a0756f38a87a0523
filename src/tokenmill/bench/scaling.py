"""Thread scaling: tokenmill next to llama.cpp at 1, 2, 4, ..., N threads on the same GGUF and token ids.

Per thread count, three figures on each side, each side in a fresh process (thread settings are
process-wide; a crash or a hang stays there, under --timeout):
  single-stream decode  a 16-token prompt, --tg-tokens new tokens (tg128), greedy, EOS ignored
  prefill               a --pp-tokens prompt (pp512): prompt tokens / time to the first token
  N-sequence decode     --batch sequences (64) of a short prompt decoding together: tokens per second
                        of the steps in which all of them decode (batched-bench's S_TG)
llama.cpp runs through llama-cpp-python (tg/pp through `eval`, the batch through `llama_decode` of a
64-sequence llama_batch), or through llama.cpp's own binaries when given: --llama-bench (tg/pp,
`-o json`), --llama-batched-bench (S_TG of -npl BATCH). Ratios are tokenmill / llama.cpp. tokenmill's
speculative decoding is off unless --speculative ngram: one token per sequence and step on both sides.

Also the proxy that a machine with few cores can show: per decoded token, what the compiled core's
thread pool did (synchronisations, inline calls, time waiting at joins; kernels.native.pool_stats,
"n/a" on a build without them), and every OpenMP fork-join in the process, torch's too, counted by an
LD_PRELOAD shim compiled with gcc on the fly (bench/gomp_shim.py; skipped without a compiler).

    tokenmill bench scaling --model smollm2                          # 1,2,4,..,default threads
    tokenmill bench scaling --threads 1,2,4,8,16 --llama-bench ~/llama.cpp/build/bin/llama-bench \\
        --llama-batched-bench ~/llama.cpp/build/bin/llama-batched-bench --json scaling.json"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.bench.common import (corpus_prompts, cpu_flags, cpu_model, loadavg, progress, random_prompt, ratio,
                                    write_json)

SCALING_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")
TESTS = ("tg", "pp", "batch")


def build_parser(prog: str = "tokenmill bench scaling") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model name or .gguf path (default: smollm2)")
    p.add_argument("--threads", default=None, help="comma-separated thread counts, run in this order; 'default' "
                   "is the count tokenmill would choose (default: powers of two up to it, and it)")
    p.add_argument("--tests", default=",".join(TESTS), help="comma-separated, from tg,pp,batch (default: all)")
    p.add_argument("--tg-tokens", type=int, default=128, help="new tokens of the single-stream decode (tg128)")
    p.add_argument("--tg-prompt-len", type=int, default=16, help="prompt of the single-stream decode")
    p.add_argument("--pp-tokens", type=int, default=512, help="prompt tokens of the prefill test (pp512)")
    p.add_argument("--batch", type=int, default=64, help="sequences decoding at once")
    p.add_argument("--batch-prompt-len", type=int, default=32, help="prompt tokens of each batched sequence")
    p.add_argument("--batch-tokens", type=int, default=32, help="timed decode steps of the batch")
    p.add_argument("--repeats", type=int, default=3, help="timed tg and pp runs per side (median reported)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per step: one side at one thread count")
    p.add_argument("--dtype", choices=["auto", "gguf", "bf16", "fp32"], default="auto", help="tokenmill's weights")
    p.add_argument("--compile", action="store_true", help="tokenmill: compiled model steps (the server default)")
    p.add_argument("--speculative", choices=["off", "ngram"], default="off", help="tokenmill's speculative "
                   "decoding (default off: one token per sequence and step, as llama-bench and batched-bench)")
    p.add_argument("--skip-llama-cpp", action="store_true", help="tokenmill alone")
    p.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench binary for tg and pp")
    p.add_argument("--llama-batched-bench", metavar="PATH", help="llama.cpp's llama-batched-bench for the batch")
    p.add_argument("--no-gomp-count", action="store_true", help="do not preload the OpenMP fork-join counter")
    p.add_argument("--json", metavar="PATH", help="write everything as JSON (rewritten after each thread count)")
    p.add_argument("--from-json", metavar="PATH", help="print the report of a saved --json result, run nothing")
    return p


# --- the machine ---------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    """CPU model, logical and physical cores, the thread count tokenmill would choose, the flags."""
    info: dict[str, Any] = {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "flags": cpu_flags(SCALING_FLAGS)}
    try:
        from tokenmill.cpu_threads import affinity_cpus, default_threads, physical_cores

        cpus = affinity_cpus()
        choice = default_threads()
        info.update(affinity_cpus=len(cpus), physical_cores=physical_cores(cpus), default_threads=choice.count,
                    default_threads_reason=choice.reason)
    except ImportError:  # an older tree without cpu_threads: every CPU, as torch counts
        info.update(affinity_cpus=None, physical_cores=None, default_threads=os.cpu_count() or 1,
                    default_threads_reason="os.cpu_count()")
    return info


def default_thread_counts(default: int) -> list[int]:
    """1, 2, 4, ... below `default`, then `default` itself."""
    counts, n = [], 1
    while n < default:
        counts.append(n)
        n *= 2
    return counts + [max(1, default)]


def parse_counts(text: str, default: int) -> list[int]:
    try:
        counts = [default if x.strip() == "default" else int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--threads wants comma-separated integers or 'default', got {text!r}") from None
    if not counts or min(counts) < 1:
        raise SystemExit("--threads wants at least one count, each >= 1")
    return list(dict.fromkeys(counts))


def parse_tests(text: str) -> list[str]:
    tests = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tests if t not in TESTS]
    if bad or not tests:
        raise SystemExit(f"--tests: choose from {','.join(TESTS)} (got {text!r})")
    return tests


# --- running one side at one thread count ----------------------------------------------------------

def run_worker(spec: dict[str, Any], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """scaling_worker in a fresh process; its result, or {"error": ...}."""
    with tempfile.TemporaryDirectory(prefix="tm-scaling-") as tmp:
        spec = {**spec, "out": str(Path(tmp, "result.json"))}
        path = Path(tmp, "spec.json")
        path.write_text(json.dumps(spec))
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "tokenmill.bench.scaling_worker", str(path)], env=env,
                                  capture_output=True, text=True, timeout=timeout, errors="replace")
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        out = Path(spec["out"])
        if done.returncode != 0 or not out.exists():
            tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-3:]
            return {"error": f"exited with {done.returncode}: " + " | ".join(tail)}
        result = json.loads(out.read_text())
        result["wall_seconds"] = time.perf_counter() - start
        return result


def _python_peer_available() -> str | None:
    """None if llama-cpp-python is importable, else why not."""
    return None if importlib.util.find_spec("llama_cpp") else "llama-cpp-python is not installed"


def llama_plan(args: argparse.Namespace, tests: list[str]) -> dict[str, Any]:
    """Where each llama.cpp figure comes from: 'llama-bench', 'llama-batched-bench', 'llama-cpp-python',
    or None with the reason."""
    plan: dict[str, Any] = {"tg_pp": None, "batch": None, "notes": []}
    if args.skip_llama_cpp:
        plan["notes"].append("skipped (--skip-llama-cpp)")
        return plan
    missing = _python_peer_available()
    for key, binary, name in (("tg_pp", args.llama_bench, "llama-bench"),
                              ("batch", args.llama_batched_bench, "llama-batched-bench")):
        wanted = ("tg" in tests or "pp" in tests) if key == "tg_pp" else "batch" in tests
        if not wanted:
            continue
        if binary:
            if not os.access(binary, os.X_OK):
                raise SystemExit(f"--{name}: {binary} is not an executable file")
            plan[key] = name
        elif missing is None:
            plan[key] = "llama-cpp-python"
        else:
            plan["notes"].append(f"{key}: {missing}")
    return plan


def llama_side(args: argparse.Namespace, spec: dict[str, Any], plan: dict[str, Any], threads: int,
               tests: list[str]) -> dict[str, Any]:
    from tokenmill.bench.llama_cpp_tools import ToolError, run_batched_bench, run_llama_bench

    out: dict[str, Any] = {"errors": []}
    peer_tests = [t for t in tests if (plan["tg_pp"] == "llama-cpp-python" and t in ("tg", "pp"))
                  or (plan["batch"] == "llama-cpp-python" and t == "batch")]
    if peer_tests:
        r = run_worker({**spec, "side": "llama-cpp", "threads": threads, "tests": peer_tests}, args.timeout)
        if "error" in r:
            out["errors"].append(f"llama-cpp-python: {r['error']}")
        out.update({k: r[k] for k in ("tg", "pp", "batch", "llama_cpp_python", "system_info") if k in r})
    try:
        if plan["tg_pp"] == "llama-bench":
            # 0 tokens: llama-bench leaves that test out
            r = run_llama_bench(args.llama_bench, spec["model"], threads, args.pp_tokens if "pp" in tests else 0,
                                args.tg_tokens if "tg" in tests else 0, args.repeats, args.timeout)
            out["llama_bench_command"] = r["command"]
            if "tg" in tests and r["tg_tok_s"] is not None:
                out["tg"] = {"decode_tok_s": r["tg_tok_s"], "stddev": r["tg_stddev"]}
            if "pp" in tests and r["pp_tok_s"] is not None:
                out["pp"] = {"prefill_tok_s": r["pp_tok_s"], "stddev": r["pp_stddev"]}
    except ToolError as exc:
        out["errors"].append(str(exc))
    try:
        if plan["batch"] == "llama-batched-bench":
            r = run_batched_bench(args.llama_batched_bench, spec["model"], threads, args.batch,
                                  args.batch_prompt_len, args.batch_tokens, args.timeout)
            out["batched_bench_command"] = r["command"]
            out["batch"] = {"decode_tok_s": r["batch_tok_s"], "prefill_tok_s": r["batch_prefill_tok_s"]}
    except ToolError as exc:
        out["errors"].append(str(exc))
    return out


def tokenmill_side(args: argparse.Namespace, spec: dict[str, Any], threads: int, tests: list[str],
                   shim) -> dict[str, Any]:
    from tokenmill.bench.gomp_shim import preload_env

    job = {**spec, "side": "tokenmill", "threads": threads, "tests": tests}
    r = run_worker(job, args.timeout, preload_env(shim))
    if "error" in r and shim.available and "timed out" not in r["error"]:
        # the shim is the one unusual thing in that process: try once without it
        retry = run_worker(job, args.timeout)
        retry["note"] = f"failed with the fork-join counter preloaded ({r['error']}); ran without it"
        r = retry
    return r


# --- the whole benchmark -------------------------------------------------------------------------

def make_spec(args: argparse.Namespace, gguf_path: str) -> dict[str, Any]:
    """What every worker gets: the model and the token ids (the same on both sides)."""
    from tokenmill.gguf import open_gguf
    from tokenmill.tokenizer import Tokenizer

    meta = open_gguf(gguf_path).metadata
    tok = Tokenizer.from_gguf_metadata(meta)
    vocab = tok.vocab_size
    prompts = lambda n, length: corpus_prompts(tok.encode, n, length)  # noqa: E731
    return {"model": gguf_path, "dtype": args.dtype, "compile": args.compile, "speculative": args.speculative,
            "tg_tokens": args.tg_tokens, "pp_tokens": args.pp_tokens, "batch": args.batch,
            "batch_prompt_len": args.batch_prompt_len, "batch_tokens": args.batch_tokens,
            "warmup_prompt": random_prompt(vocab, args.tg_prompt_len, seed=99),
            "pp_warmup_prompt": random_prompt(vocab, args.pp_tokens, seed=98),
            "tg_prompts": prompts(args.repeats, args.tg_prompt_len),
            "pp_prompts": prompts(args.repeats, args.pp_tokens),
            "batch_prompts": prompts(args.batch, args.batch_prompt_len)}


def _check(args: argparse.Namespace) -> None:
    for name in ("tg_tokens", "tg_prompt_len", "pp_tokens", "batch", "batch_prompt_len", "batch_tokens", "repeats"):
        if getattr(args, name) < (2 if name == "tg_tokens" else 1):
            raise SystemExit(f"--{name.replace('_', '-')} is too small")
    if args.timeout <= 0:
        raise SystemExit("--timeout must be positive")


def ratios(tm: dict[str, Any], lc: dict[str, Any]) -> dict[str, float | None]:
    get = lambda side, test, key: (side.get(test) or {}).get(key)  # noqa: E731
    return {"tg": ratio(get(tm, "tg", "decode_tok_s"), get(lc, "tg", "decode_tok_s")),
            "pp": ratio(get(tm, "pp", "prefill_tok_s"), get(lc, "pp", "prefill_tok_s")),
            "batch": ratio(get(tm, "batch", "decode_tok_s"), get(lc, "batch", "decode_tok_s"))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.bench.gomp_shim import Shim, build_shim
    from tokenmill.store import resolve_model

    _check(args)
    tests = parse_tests(args.tests)
    box = machine()
    default = box["default_threads"]
    counts = parse_counts(args.threads, default) if args.threads else default_thread_counts(default)
    gguf_path = str(resolve_model(args.model))
    plan = llama_plan(args, tests)
    spec = make_spec(args, gguf_path)
    result: dict[str, Any] = {
        "benchmark": "scaling", "model": gguf_path, "machine": box, "tests": tests, "thread_counts": counts,
        "config": {k: getattr(args, k) for k in ("tg_tokens", "tg_prompt_len", "pp_tokens", "batch",
                                                 "batch_prompt_len", "batch_tokens", "repeats", "timeout",
                                                 "dtype", "compile", "speculative")},
        "llama_cpp": plan, "gomp_shim": None, "rows": []}
    with tempfile.TemporaryDirectory(prefix="tm-gomp-") as tmp:
        shim = Shim(None, "off (--no-gomp-count)") if args.no_gomp_count else build_shim(tmp)
        result["gomp_shim"] = shim.reason
        for n in counts:
            progress(f"tokenmill, {n} threads")
            tm = tokenmill_side(args, spec, n, tests, shim)
            lc: dict[str, Any] = {}
            if plan["tg_pp"] or plan["batch"]:
                progress(f"llama.cpp, {n} threads")
                lc = llama_side(args, spec, plan, n, tests)
            result["rows"].append({"threads": n, "tokenmill": tm, "llama_cpp": lc, "ratio": ratios(tm, lc),
                                   "loadavg": loadavg()})
            write_json(args.json, result)  # so far: a run cut short still leaves what it measured
    return result


def main(argv: list[str] | None = None, prog: str = "tokenmill bench scaling") -> int:
    from tokenmill.bench.scaling_report import report

    args = build_parser(prog).parse_args(argv)
    if args.from_json:
        print(report(json.loads(Path(args.from_json).read_text())))
        return 0
    result = run(args)
    print(report(result), flush=True)
    write_json(args.json, result)
    return 0 if any("error" not in r["tokenmill"] for r in result["rows"]) else 1

