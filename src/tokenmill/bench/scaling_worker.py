"""One side of `tokenmill bench scaling` at one thread count, in a process of its own (thread settings
are process-wide, and a crash or hang stays here): `python -m tokenmill.bench.scaling_worker SPEC`,
where SPEC is a JSON file the parent wrote (scaling.WorkerSpec) and the result goes to spec["out"].

Both sides run the same token ids (the parent tokenized them):
  tg     single-stream greedy decode of `tg_tokens` new tokens after a short prompt, EOS ignored;
         decode tok/s = (tokens - 1) / (last token - first token), the median over the repeats
  pp     prefill of a `pp_tokens` prompt: prompt tokens / time to the first token, the median
  batch  `batch` sequences of a short prompt decoding together: the tokens of `batch_tokens` decode
         steps in which every sequence decodes, over their wall time
tokenmill's side also reads, over the decode steps of tg and batch, what the compiled core's pool
did (kernels.native.pool_stats: regions, inline calls, join wait, OpenMP regions) and, when the
parent preloaded gomp_shim, every OpenMP fork-join in the process."""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tokenmill.bench.gomp_shim import openmp_runtimes, read_count

POOL_KEYS = ("regions", "inline", "join_wait_ns", "worker_sleeps", "omp_regions")
N_BATCH = 512  # the engine's token budget per step (the server's default), as llama.cpp's n_ubatch


# --- what the compiled core's pool and OpenMP did ----------------------------------------------------

def _pool_stats() -> dict[str, int] | None:
    """kernels.native.pool_stats(), or None where this build has no pool counters (yet)."""
    from tokenmill.kernels import native

    fn = getattr(native, "pool_stats", None)
    try:
        stats = fn() if fn is not None else None
    except Exception:  # noqa: BLE001 - a counter that fails must not fail the benchmark
        return None
    return dict(stats) if stats else None


def snapshot() -> dict[str, Any]:
    return {"pool": _pool_stats(), "gomp": read_count()}


def proxy(before: dict[str, Any], after: dict[str, Any], tokens: int, steps: int) -> dict[str, Any]:
    """Per decoded token and per step: the pool's synchronisations (regions), inline calls, join
    wait, worker sleeps, the core's OpenMP regions, and all fork-joins seen by the shim."""
    counts: dict[str, float | None] = {k: None for k in POOL_KEYS}
    if before["pool"] is not None and after["pool"] is not None:
        counts.update({k: after["pool"][k] - before["pool"][k] for k in POOL_KEYS
                       if k in after["pool"] and k in before["pool"]})
    counts["gomp_fork_joins"] = (after["gomp"] - before["gomp"]
                                 if before["gomp"] is not None and after["gomp"] is not None else None)
    per = lambda n: {k: (None if v is None else v / n) for k, v in counts.items()}  # noqa: E731
    return {"tokens": tokens, "steps": steps, "totals": counts, "per_token": per(max(tokens, 1)),
            "per_step": per(max(steps, 1)), "pool_threads": (after["pool"] or {}).get("threads")}


# --- tokenmill -----------------------------------------------------------------------------------

def _greedy(engine, ids: list[int], n: int) -> tuple[float, list[float], dict | None, dict | None]:
    """(t0, one time per token, snapshots around the decode steps) of one greedy request."""
    from tokenmill.engine import SamplingParams

    times: list[float] = []
    first = last = None
    t0 = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        times += [now] * sum(len(ev.token_ids) for ev in events)
        if first is None and times:
            first = snapshot()  # the first token came with the prefill: decode steps start here
    last = snapshot()
    return t0, times, first, last


def _decode_tok_s(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


def tokenmill_side(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill.bench.common import set_threads
    from tokenmill.cpu_threads import describe, torch_threads

    set_threads(spec["threads"])
    from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams

    need = max(len(spec["tg_prompts"][0]) + spec["tg_tokens"], spec["pp_tokens"] + 1,
               spec["batch"] * (spec["batch_prompt_len"] + spec["batch_tokens"] + _prefill_steps(spec) + 10))
    cfg = EngineConfig(dtype=spec["dtype"], n_batch=N_BATCH, n_ubatch=N_BATCH, parallel=max(64, spec["batch"]),
                       compile=spec["compile"], speculative=spec.get("speculative", "off"),
                       # twice what the sequences hold: the scheduler keeps headroom (watermark,
                       # lookahead blocks), and a preempted sequence would spoil the batch figure
                       max_total_tokens=-(-2 * need // 1024) * 1024, enable_prefix_caching=False)
    start = time.perf_counter()
    engine = LLMEngine.from_path(spec["model"], cfg)
    out: dict[str, Any] = {"engine_init_seconds": time.perf_counter() - start,
                           "load_seconds": engine.loaded.load_seconds, "threads_chosen": describe(),
                           "torch_threads": torch_threads()}
    _greedy(engine, spec["warmup_prompt"], 8)

    if "tg" in spec["tests"]:
        runs, probes = [], []
        for ids in spec["tg_prompts"]:
            _, times, first, last = _greedy(engine, ids, spec["tg_tokens"])
            runs.append(_decode_tok_s(times))
            probes.append(proxy(first, last, len(times) - 1, len(times) - 1))
        out["tg"] = {"decode_tok_s": statistics.median(runs), "runs": runs}
        out["proxy_tg"] = probes[len(probes) // 2]
    if "pp" in spec["tests"]:
        _greedy(engine, spec["pp_warmup_prompt"], 1)
        runs = []
        for ids in spec["pp_prompts"]:
            t0, times, _, _ = _greedy(engine, ids, 1)
            runs.append(len(ids) / (times[0] - t0))
        out["pp"] = {"prefill_tok_s": statistics.median(runs), "runs": runs}
    if "batch" in spec["tests"]:
        out["batch"], out["proxy_batch"] = _tokenmill_batch(engine, spec, SamplingParams)
    return out


def _prefill_steps(spec: dict[str, Any]) -> int:
    return -(-spec["batch"] * spec["batch_prompt_len"] // N_BATCH)


def _tokenmill_batch(engine, spec: dict[str, Any], params_cls) -> tuple[dict[str, Any], dict[str, Any]]:
    """All sequences in, steps until every one of them decodes, one more untimed step, then
    `batch_tokens` timed decode steps; the requests are left unfinished (the process ends)."""
    n, steps = spec["batch"], spec["batch_tokens"]
    params = params_cls(max_tokens=steps + _prefill_steps(spec) + 10, temperature=0, ignore_eos=True)
    for ids in spec["batch_prompts"]:
        engine.add_request(ids, params)

    def all_decoding() -> bool:
        rec = engine.stats.last_step
        return rec is not None and rec.num_prefill_tokens == 0 and rec.num_decode_seqs == n

    for _ in range(_prefill_steps(spec) + 8):
        engine.step()
        if all_decoding():
            break
    else:
        raise RuntimeError(f"the engine never decoded all {n} sequences in one step")
    engine.step()
    before = snapshot()
    tokens, t0 = 0, time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(ev.token_ids) for ev in engine.step())
        if not all_decoding():
            raise RuntimeError(f"a timed step did not decode all {n} sequences (a preemption: KV cache too small?)")
    elapsed = time.perf_counter() - t0
    after = snapshot()
    return ({"decode_tok_s": tokens / elapsed, "decode_step_ms": elapsed / steps * 1e3, "steps": steps,
             "num_seqs": n}, proxy(before, after, tokens, steps))


# --- llama.cpp through llama-cpp-python ----------------------------------------------------------

def llama_cpp_side(spec: dict[str, Any]) -> dict[str, Any]:
    from tokenmill.bench.llama_cpp_peer import LlamaCppModel, context_size, describe

    out: dict[str, Any] = {"source": "llama-cpp-python", **describe()}
    if "tg" in spec["tests"] or "pp" in spec["tests"]:
        longest = max(len(spec["tg_prompts"][0]), spec["pp_tokens"])
        model = LlamaCppModel(spec["model"], threads=spec["threads"], n_ctx=context_size(longest, spec["tg_tokens"]),
                              n_batch=max(512, spec["pp_tokens"]))
        out["load_seconds"] = model.load_seconds
        model.greedy(spec["warmup_prompt"], 8)
        if "tg" in spec["tests"]:
            runs = []
            for ids in spec["tg_prompts"]:
                runs.append(_decode_tok_s(model.greedy(ids, spec["tg_tokens"]).token_times))
            out["tg"] = {"decode_tok_s": statistics.median(runs), "runs": runs}
        if "pp" in spec["tests"]:
            model.greedy(spec["pp_warmup_prompt"], 1)
            runs = []
            for ids in spec["pp_prompts"]:
                g = model.greedy(ids, 1)
                runs.append(len(ids) / (g.token_times[0] - g.t0))
            out["pp"] = {"prefill_tok_s": statistics.median(runs), "runs": runs}
        model.close()
    if "batch" in spec["tests"]:
        from tokenmill.bench.llama_cpp_batched import LlamaCppBatched

        b = LlamaCppBatched(spec["model"], threads=spec["threads"], num_seqs=spec["batch"],
                            max_len=spec["batch_prompt_len"] + spec["batch_tokens"] + 2)
        b.run(spec["batch_prompts"], 1)  # warm-up
        r = b.run(spec["batch_prompts"], spec["batch_tokens"])
        out["batch"] = {"decode_tok_s": r.decode_tok_s, "decode_step_ms": r.decode_seconds / r.decode_steps * 1e3,
                        "steps": r.decode_steps, "num_seqs": r.num_seqs}
        b.close()
    return out


SIDES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"tokenmill": tokenmill_side,
                                                                 "llama-cpp": llama_cpp_side}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = SIDES[spec["side"]](spec)
    result["openmp_runtimes"] = openmp_runtimes()
    Path(spec["out"]).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
