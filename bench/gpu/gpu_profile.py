"""Where a GPU decode step's time goes (bench/gpu/check.py's `profile` step): for one sequence and
for a batch, the engine step's wall time against the CUDA graph's replay alone, the engine's Python
functions (cProfile, by own time) and the torch ops it launches outside the graph (torch.profiler).
The figures say how much of a step is the GPU's work and how much the host's."""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from typing import Any

import torch

from tokenmill.engine import LLMEngine, SamplingParams


def _sync(engine: LLMEngine) -> None:
    if engine.kv.device.type == "cuda":
        torch.cuda.synchronize(engine.kv.device)


def _decoding(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> None:
    """Adds the prompts and steps until every sequence decodes (its prompt computed)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(50):
        engine.step()
        if engine.num_waiting() == 0 and all(s.num_computed_tokens >= len(s.prompt_ids)
                                             for s in engine.scheduler.running):
            break


def _replay_ms(engine: LLMEngine, bucket: int, reps: int = 200) -> float | None:
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is None or bucket not in graphs.buckets:
        return None
    graphs.replay(bucket)
    _sync(engine)
    start = time.perf_counter()
    for _ in range(reps):
        graphs.replay(bucket)
    _sync(engine)
    return (time.perf_counter() - start) / reps * 1e3


def _step_ms(engine: LLMEngine, steps: int) -> tuple[list[float], int]:
    """Each engine step's wall time, and the tokens the steps made (a step of decode steps in a row,
    engine/decode_steps.py, makes several per sequence)."""
    out, tokens = [], 0
    for _ in range(steps):
        start = time.perf_counter()
        events = engine.step()
        out.append((time.perf_counter() - start) * 1e3)
        tokens += sum(len(ev.token_ids) for ev in events)
    return out, tokens


def _cprofile(engine: LLMEngine, steps: int, top: int = 28) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def _torch_profile(engine: LLMEngine, steps: int, top: int = 30) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.kv.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        _sync(engine)
    averages = prof.key_averages()
    text = f"{steps} engine steps, by host time\n{averages.table(sort_by='self_cpu_time_total', row_limit=top)}"
    if engine.kv.device.type == "cuda":  # the kernels a step runs (a graph's too), with their counts
        text += f"\nby GPU time\n{averages.table(sort_by='self_device_time_total', row_limit=top)}"
    return text


def profile_decode(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """len(prompts) sequences decoding together: step times, graph replay, profiles."""
    n = len(prompts)
    _decoding(engine, prompts, new_tokens)
    timed, tokens = _step_ms(engine, 40)
    bucket = None
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None:
        bucket = next((b for b in graphs.buckets if b >= n), None)
    replay = _replay_ms(engine, bucket) if bucket else None
    cprof = _cprofile(engine, 30)
    tprof = _torch_profile(engine, 10)
    median = statistics.median(timed)
    per_token_step = sum(timed) / max(tokens / n, 1)  # ms for one token of every sequence
    return {"sequences": n, "step_ms_median": median, "step_ms_min": min(timed), "bucket": bucket,
            "tokens_per_step": tokens / n / len(timed), "token_step_ms": per_token_step,
            "graph_replay_ms": replay, "tok_s": tokens / sum(timed) * 1e3,
            "host_share": None if replay is None else max(0.0, 1 - replay / per_token_step),
            "cprofile": cprof, "torch_profile": tprof}
