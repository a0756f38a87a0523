#!/usr/bin/env python
"""Checks tokenmill's CUDA path on one GPU (issue 37 item 8): correctness first, then the targets,
with transformers measured in the same run. bench/gpu/check.sh runs each step in its own process
under `timeout`; every step writes OUT/<step>.json (and the summary OUT/summary.{txt,json}).

Steps (--steps, comma-separated, in the order given):
  env           the GPU, driver, torch/triton/CUDA versions, whether the CPU path runs compiled
  correctness   SmolLM2 and Gemma 3 (random weights) greedy on the GPU (CUDA graphs, and eager)
                against the CPU path on the same GGUF (fp32, the reference; and bf16, the same
                weights): greedy tokens and every step's logits
  kernel-tests  pytest tests/kernels/gpu tests/engine/gpu tests/model/gpu (on CUDA there)
  kernel-bench  bench/gpu_kernels.py --quick (its output goes to the log)
  decode        single-stream decode tok/s (CUDA graphs) of SmolLM2 and Gemma 3
  concurrency   64 and 256 requests at once (100-token prompts, 128 new, EOS ignored): output
                tok/s and TTFT through the engine, the median of 3 bursts
  invariance    one prompt's greedy tokens alone, in a batch of 64 copies, and among 63 others
  anchor        transformers (eager, bf16) on SmolLM2's GGUF at batch 1, 64 and 256, same device
  profile       where a decode step's time goes: engine step vs graph replay, cProfile, torch.profiler
  summary       the table of targets, met or not (gpu_report.py)

    python bench/gpu/check.py --model smollm2=/tmp/smollm2.gguf --model gemma3=/tmp/gemma3.gguf
    python bench/gpu/check.py --device cpu --small --model smollm2=... --out /tmp/dry   # plumbing only

--device cpu is a dry run: the "device" side is the CPU's dense bf16 path, nothing is measured on a
GPU and the summary says so."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import gpu_report as report  # noqa: E402
import gpu_runs as runs  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    correctness_prompt: int = 64
    correctness_tokens: int = 32
    prompt_len: int = 100            # the targets' prompts
    new_tokens: int = 128
    decode_repeats: int = 5
    concurrency: tuple[int, ...] = (64, 256)
    # A burst is over in a second, and one run of it is a noisy figure (256 requests: 40,199 then 33,516
    # out tok/s after a change that made the step faster, on another H200): the median of 3, each with
    # its own prompts.
    concurrency_repeats: int = 3
    invariance_batch: int = 64
    anchor_batches: tuple[int, ...] = (1, 64, 256)
    # A step's token budget (and micro-batch): 0 = the engine's automatic one, what a server user gets
    # (engine/config.py GPU_STEP_SIZES: 8192 on a GPU, 64 prompts of 100 tokens prefilled in one step).
    n_batch: int = 0


FULL = Sizes()
SMALL = Sizes(correctness_prompt=12, correctness_tokens=4, prompt_len=12, new_tokens=6, decode_repeats=2,
              concurrency=(3, 5), concurrency_repeats=2, invariance_batch=3, anchor_batches=(1, 2), n_batch=256)

# Logits within bf16 tolerance, as tests/engine/gpu holds the GPU path: of the step's largest logit,
# 3% against the CPU's bf16 path (the same weights, attention rounded differently) and 10% against fp32.
TOLERANCE = {"cpu-bf16": 0.03, "cpu-fp32": 0.10}


@dataclass
class Check:
    device: str
    models: dict[str, Path]
    out: Path
    sizes: Sizes
    pytest_args: list[str]
    timeout: float

    def save(self, step: str, data: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{step}.json.tmp"
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        tmp.replace(self.out / f"{step}.json")  # a step killed mid-write leaves the last whole result

    def model(self, name: str) -> Path:
        if name not in self.models:
            raise SystemExit(f"no --model {name}=PATH given")
        return self.models[name]

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"


def log(msg: str) -> None:
    print(f"[check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tokenizer_of(path: Path):
    from tokenmill.gguf import open_gguf
    from tokenmill.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(open_gguf(path).metadata)


# --- the steps ---------------------------------------------------------------------------------

def step_env(c: Check) -> dict[str, Any]:
    from tokenmill.kernels import native

    env: dict[str, Any] = {"device": c.device, "torch": torch.__version__, "cuda": torch.version.cuda,
                           "python": platform.python_version(), "cpu_count": os.cpu_count(),
                           "native": native.describe(),
                           "commit": _commit(), "sizes": asdict(c.sizes)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if c.on_gpu:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", nvidia_smi=_run_text(
                       ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv"]))
    else:
        env["gpu"] = "none (dry run on the CPU)"
    try:
        from importlib.metadata import version

        env["transformers"] = version("transformers")
    except Exception:  # noqa: BLE001 - the anchor step then says what is missing
        env["transformers"] = None
    return env


def _commit() -> str:
    carried = ROOT / ".carry-gpu" / "COMMIT"
    if carried.exists():
        return carried.read_text().strip()
    return _run_text(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "unknown"


def _run_text(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def step_correctness(c: Check) -> dict[str, Any]:
    """Per model: the CPU references' greedy runs, then the device's (graphs and eager); saved after
    each model."""
    s = c.sizes
    result: dict[str, Any] = {"prompt_len": s.correctness_prompt, "tokens": s.correctness_tokens, "models": {}}
    for name in [n for n in ("smollm2", "gemma3") if n in c.models]:
        path = c.model(name)
        tok = tokenizer_of(path)
        prompt = runs.prompts_for(tok, 1, s.correctness_prompt)[0]
        common = dict(max_total_tokens=4096, parallel=8, n_batch=512, n_ubatch=512)
        refs = {}
        for side in ("cpu-fp32", "cpu-bf16"):
            log(f"correctness {name}: {side}")
            loaded = runs.load(path, side, c.device)
            refs[side] = runs.greedy_with_logits(loaded, tok, runs.engine_config(**common), prompt,
                                                 s.correctness_tokens)
            runs.release(loaded)
        loaded = runs.load(path, "device", c.device)
        got = {}
        for mode, compile_ in (("graphs", True), ("eager", False)):
            if mode == "graphs" and not c.on_gpu:
                continue  # CUDA graphs are the GPU's; the dry run's device side is eager
            log(f"correctness {name}: device {mode}")
            cfg = runs.engine_config(**common, device=c.device, compile=compile_)
            got[mode] = runs.greedy_with_logits(loaded, tok, cfg, prompt, s.correctness_tokens)
        runs.release(loaded)
        comparisons = {}
        for mode, g in got.items():
            for side, ref in refs.items():
                comparisons[f"{c.device}-{mode} vs {side}"] = {
                    **runs.compare_greedy(ref, g, TOLERANCE[side]), "runner": g["runner"],
                    "graph_steps": g["graph_steps"]}
        result["models"][name] = comparisons
        result["ok"] = all(x["ok"] for m in result["models"].values() for x in m.values())
        c.save("correctness", result)
    return result


def step_kernel_tests(c: Check) -> dict[str, Any]:
    # instafail.py (beside this file) prints each failure as it happens: a run cut short keeps them
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "instafail", *c.pytest_args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    log(" ".join(cmd))
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=c.timeout, env=env)
        output, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        rc = 124
    print(output[-6000:], flush=True)
    return {"rc": rc, "seconds": time.perf_counter() - start, "args": c.pytest_args, **pytest_counts(output),
            "tail": output[-3000:]}


def pytest_counts(output: str) -> dict[str, Any]:
    """The counts of pytest's last summary line ("3 failed, 40 passed, 2 skipped in 12.3s")."""
    lines = [ln for ln in output.strip().splitlines()
             if re.search(r"\d+ (passed|failed|errors?|skipped)\b", ln) and " in " in ln]
    if not lines:  # cut short: count the progress marks of -q (". F E s") so far
        marks = "".join(m.group(1) for m in re.finditer(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?\s*$", output, re.M))
        counts = {"passed": marks.count("."), "failed": marks.count("F"), "errors": marks.count("E"),
                  "skipped": marks.count("s")}
        return {"summary": f"cut short after {len(marks)} tests", **{k: v for k, v in counts.items() if v}}
    last = lines[-1].strip("= ")
    counts: dict[str, Any] = {"summary": last}
    for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", last):
        counts["errors" if word.startswith("error") else word] = int(n)
    return counts


def step_kernel_bench(c: Check) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_kernels.py"), "--quick", "--reps", "20", "--device", c.device]
    log(" ".join(cmd))
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=c.timeout)
        output, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired:
        output, rc = "timed out", 124
    print(output, flush=True)
    return {"rc": rc, "seconds": time.perf_counter() - start, "output": output[-8000:]}


def step_decode(c: Check) -> dict[str, Any]:
    from tokenmill.engine import LLMEngine

    s = c.sizes
    result: dict[str, Any] = {}
    for name in [n for n in ("smollm2", "gemma3") if n in c.models]:
        path = c.model(name)
        log(f"decode {name}")
        start = time.perf_counter()
        engine = LLMEngine.from_path(path, runs.engine_config(device=c.device, compile=c.on_gpu, parallel=8,
                                                              max_total_tokens=16384))
        init = time.perf_counter() - start
        prompts = runs.prompts_for(engine.tokenizer, s.decode_repeats, s.prompt_len)
        result[name] = {**runs.single_stream(engine, prompts, s.new_tokens), "engine_init_seconds": init,
                        "decode_steps": getattr(engine, "decode_steps", 1)}
        # The same with one step at a time, where the default runs several in a row (engine/decode_steps.py):
        # what the runs are worth, on the same box.
        if name == "smollm2" and getattr(engine, "decode_steps", 1) > 1:
            engine.decode_steps = 1
            result[f"{name}-one-step"] = {**runs.single_stream(engine, prompts, s.new_tokens), "decode_steps": 1}
        runs.release(engine)
        c.save("decode", result)
    return result


def _batch_engine(c: Check, path: Path, parallel: int, prefix_caching: bool = True):
    from tokenmill.engine import LLMEngine

    s = c.sizes
    return LLMEngine.from_path(path, runs.engine_config(
        device=c.device, compile=c.on_gpu, parallel=parallel, n_batch=s.n_batch, n_ubatch=s.n_batch,
        max_total_tokens=max(4096, parallel * (s.prompt_len + s.new_tokens) * 2),
        enable_prefix_caching=prefix_caching))


def step_concurrency(c: Check) -> dict[str, Any]:
    s = c.sizes
    path = c.model("smollm2")
    tok = tokenizer_of(path)
    result: dict[str, Any] = {}
    for n in s.concurrency:
        log(f"concurrency {n}")
        engine = _batch_engine(c, path, n)
        runs.warm_up(engine, n, s.prompt_len)
        prompts = runs.prompts_for(tok, n * s.concurrency_repeats, s.prompt_len)  # no two share a prefix
        done = [runs.batch(engine, prompts[i * n:(i + 1) * n], s.new_tokens) for i in range(s.concurrency_repeats)]
        r = sorted(done, key=lambda d: d["output_tok_s"])[len(done) // 2]  # the median run, reported whole
        r.pop("outputs")
        result[str(n)] = {**r, "runs_output_tok_s": [d["output_tok_s"] for d in done],
                          "kv_cache_bytes": engine.kv.nbytes, "n_batch": engine.cfg.n_batch}
        runs.release(engine)
        c.save("concurrency", result)
    return result


def step_invariance(c: Check) -> dict[str, Any]:
    """Prefix caching off: a copy would otherwise reuse the first one's cached prompt and compute only
    its last token, which is a different computation (chunking), not the batch's effect."""
    s = c.sizes
    n = s.invariance_batch
    path = c.model("smollm2")
    engine = _batch_engine(c, path, n, prefix_caching=False)
    prompts = runs.prompts_for(engine.tokenizer, n, s.prompt_len)
    runs.warm_up(engine, n, s.prompt_len)
    log("invariance: alone")
    alone = runs.batch(engine, prompts[:1], s.new_tokens)["outputs"][0]
    log(f"invariance: {n} copies")
    copies = runs.batch(engine, [prompts[0]] * n, s.new_tokens)["outputs"]
    log(f"invariance: among {n - 1} others")
    mixed = runs.batch(engine, prompts, s.new_tokens)["outputs"][0]
    parted = next((i for i, (a, b) in enumerate(zip(alone, mixed)) if a != b), None)
    runs.release(engine)
    return {"tokens": len(alone), "identical": {"equal": sum(o == alone for o in copies), "of": n},
            "mixed": {"equal": mixed == alone, "of": n, "parted_at": parted}, "prefix_caching": False}


def step_anchor(c: Check) -> dict[str, Any]:
    s = c.sizes
    path = c.model("smollm2")
    prompts = runs.prompts_for(tokenizer_of(path), max(s.anchor_batches), s.prompt_len)
    log(f"anchor: transformers at batch {', '.join(map(str, s.anchor_batches))}")
    return runs.transformers_generate(path, prompts, list(s.anchor_batches), s.new_tokens, c.device,
                                      lambda partial: c.save("anchor", partial))


def step_profile(c: Check) -> dict[str, Any]:
    """Where a decode step's time goes for the targets not yet met on a device: SmolLM2 alone (1,000
    tok/s) and at the largest concurrency (256: 50,000 tok/s), last, so that a profile cut short by its
    limit keeps the first (gpu_profile.py); the profiles' text goes to the log and the JSON."""
    import gpu_profile
    from tokenmill.engine import LLMEngine

    s = c.sizes
    result: dict[str, Any] = {}
    runs_ = [("smollm2", 1), ("smollm2", max(s.concurrency[-1], 1))]
    for name, n in [(m, k) for m, k in runs_ if m in c.models]:
        log(f"profile {name}, {n} sequences")
        engine = LLMEngine.from_path(c.model(name), runs.engine_config(
            device=c.device, compile=c.on_gpu, parallel=max(n, 8), max_total_tokens=max(16384, n * 512)))
        prompts = runs.prompts_for(engine.tokenizer, n, s.prompt_len)
        r = gpu_profile.profile_decode(engine, prompts, 400)  # enough for every timed step
        print(f"== {name}, {n} sequences: step {r['step_ms_median']:.3f} ms (min {r['step_ms_min']:.3f}; "
              f"{r['tokens_per_step']:.2f} tokens a sequence, {r['token_step_ms']:.3f} ms a token step), "
              f"graph replay {r['graph_replay_ms']} ms (bucket {r['bucket']}), {r['tok_s']:.0f} tok/s", flush=True)
        print(r["cprofile"], flush=True)
        print(r["torch_profile"], flush=True)
        result[f"{name}-{n}"] = r
        runs.release(engine)
        c.save("profile", result)
    return result


def step_summary(c: Check) -> dict[str, Any]:
    text, data = report.render(c.out)
    (c.out / "summary.txt").write_text(text)
    print(text, flush=True)
    return data


STEPS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "env": step_env, "correctness": step_correctness, "kernel-tests": step_kernel_tests,
    "kernel-bench": step_kernel_bench, "decode": step_decode, "concurrency": step_concurrency,
    "invariance": step_invariance, "anchor": step_anchor, "profile": step_profile, "summary": step_summary,
}
DEFAULT_TESTS = ["tests/kernels/gpu", "tests/engine/gpu", "tests/model/gpu"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the plumbing")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from {', '.join(STEPS)}")
    p.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                   help="smollm2=PATH and gemma3=PATH: the GGUFs (model skeletons, random weights)")
    p.add_argument("--out", default=os.environ.get("OUT") or "out", help="results folder (default $OUT, else ./out)")
    p.add_argument("--small", action="store_true", help="tiny sizes (a dry run's)")
    p.add_argument("--tests", default=",".join(DEFAULT_TESTS), help="kernel-tests: comma-separated pytest paths")
    p.add_argument("--timeout", type=float, default=300, help="kernel-tests / kernel-bench: seconds for pytest or "
                   "the bench before it is stopped (check.sh also bounds every step)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    steps = [x.strip() for x in args.steps.split(",") if x.strip()]
    unknown = [x for x in steps if x not in STEPS]
    if unknown:
        raise SystemExit(f"unknown steps {unknown} (choose from {', '.join(STEPS)})")
    models = {}
    for spec in args.model:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            raise SystemExit(f"--model wants NAME=PATH, got {spec!r}")
        models[name] = Path(path)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU here (use --device cpu for a dry run)")
    c = Check(args.device, models, Path(args.out), SMALL if args.small else FULL,
              [t for t in args.tests.split(",") if t], args.timeout)
    failed = []
    for name in steps:
        start = time.perf_counter()
        log(f"step {name}")
        try:
            data = STEPS[name](c)
        except Exception as exc:  # noqa: BLE001 - a failed step is reported; the others still run
            log(f"step {name} FAILED: {type(exc).__name__}: {exc}")
            import traceback

            traceback.print_exc()
            failed.append(name)
            continue
        if name != "summary":
            c.save(name, {**data, "step_seconds": time.perf_counter() - start})
        log(f"step {name} done in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
