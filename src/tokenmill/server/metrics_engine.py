"""The engine series of /metrics for every loaded model, each sample labelled model_name="<name>" as
vLLM labels its series. Each family is written once with a sample per model (and per bucket,
finish reason or position), so several models never repeat a family's HELP and TYPE. The numbers
are the snapshots the engine threads publish after every step: reading them never waits for a step."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.stats import StatsSnapshot
from tokenmill.server.metrics_writer import Labels, Writer
from tokenmill.server.served_model import ServedModel


@dataclass
class EngineCounters:
    """How the engine thread is doing, beside its statistics snapshot."""
    healthy: bool
    failed_steps: int
    slow_steps: int
    snapshot_age: float  # seconds since the engine last published (grows while a step hangs)


@dataclass
class ModelEngine:
    """One loaded model's engine as a scrape sees it."""
    name: str              # the model_name label
    snapshot: StatsSnapshot
    counters: EngineCounters


def model_engines(models: list[ServedModel], default: ServedModel | None) -> list[ModelEngine]:
    """The loaded models' published numbers, the default model first (a reader taking the first
    sample of a series, as a Ray replica's load report does, gets the default model's as before),
    then the rest by name. A name two loaded files share (x.gguf in two folders) gets #2, #3, so
    that no two samples of a family carry the same labels."""
    ordered = sorted(models, key=lambda m: (m is not default, m.name))
    out: list[ModelEngine] = []
    seen: dict[str, int] = {}
    now = time.monotonic()
    for served in ordered:
        aengine = served.aengine
        snap = aengine.snapshot
        counters = EngineCounters(aengine.health().ok, served.engine.faults.num_failed,
                                  aengine.watchdog.num_slow_steps, now - snap.taken_at)
        seen[served.name] = seen.get(served.name, 0) + 1
        name = served.name if seen[served.name] == 1 else f"{served.name}#{seen[served.name]}"
        out.append(ModelEngine(name, snap, counters))
    return out


# (name, type, help, value); the help texts are what dashboards have seen all along.
HEALTH: list[tuple[str, str, str, Callable[[EngineCounters], float]]] = [
    ("tokenmill:engine_healthy", "gauge", "1 unless the engine thread died or steps keep failing.",
     lambda c: c.healthy),
    ("tokenmill:engine_failed_steps_total", "counter", "Engine steps that raised (their requests failed).",
     lambda c: c.failed_steps),
    ("tokenmill:engine_slow_steps_total", "counter", "Engine steps that ran past the watchdog limit.",
     lambda c: c.slow_steps),
    ("tokenmill:engine_snapshot_age_seconds", "gauge", "Seconds since the engine thread last published these "
     "numbers.", lambda c: c.snapshot_age),
]

# Speculative decoding is vLLM's spec_decode family under tokenmill's prefix: acceptance rate is
# accepted / draft tokens, mean accepted length 1 + accepted / drafts.
SERIES: list[tuple[str, str, str, Callable[[StatsSnapshot], float]]] = [
    ("vllm:num_requests_running", "gauge", "Sequences in the running batch.", lambda s: s.num_running),
    ("vllm:num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", lambda s: s.num_waiting),
    ("vllm:kv_cache_usage_perc", "gauge", "KV cache usage (1 = full).", lambda s: s.kv_usage),
    ("vllm:gpu_cache_usage_perc", "gauge", "KV cache usage (1 = full); older vLLM name.", lambda s: s.kv_usage),
    ("tokenmill:kv_cache_used_blocks", "gauge", "KV blocks referenced by sequences.", lambda s: s.num_used_blocks),
    ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.prefix_queries),
    ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", lambda s: s.prefix_hits),
    ("vllm:num_preemptions_total", "counter", "Sequences preempted (recomputed later).",
     lambda s: s.num_preemptions),
    ("vllm:prompt_tokens_total", "counter", "Prompt tokens computed.", lambda s: s.num_prompt_tokens),
    ("tokenmill:prompt_tokens_cached_total", "counter", "Prompt tokens taken from the prefix cache.",
     lambda s: s.num_cached_prompt_tokens),
    ("vllm:generation_tokens_total", "counter", "Tokens generated.", lambda s: s.num_generation_tokens),
    ("tokenmill:engine_steps_total", "counter", "Engine steps run.", lambda s: s.num_steps),
    ("tokenmill:spec_decode_num_drafts_total", "counter", "Verifications of proposed tokens (speculative "
     "decoding).", lambda s: s.spec_num_drafts),
    ("tokenmill:spec_decode_num_draft_tokens_total", "counter", "Tokens proposed.",
     lambda s: s.spec_num_draft_tokens),
    ("tokenmill:spec_decode_num_accepted_tokens_total", "counter", "Proposed tokens accepted.",
     lambda s: s.spec_num_accepted_tokens),
]

# (name, help, histogram key); several names share data where vLLM renamed a metric over time.
HISTOGRAMS = [
    ("vllm:time_to_first_token_seconds", "Time to first token.", "ttft"),
    ("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", "itl"),
    ("vllm:time_per_output_token_seconds", "Time per output token (same data as inter_token_latency).", "itl"),
    ("vllm:e2e_request_latency_seconds", "End-to-end request latency.", "e2e"),
    ("vllm:request_queue_time_seconds", "Time from arrival to first scheduling.", "queue_time"),
    ("vllm:iteration_tokens_total", "Tokens processed per engine step.", "tokens_per_step"),
    ("tokenmill:batch_tokens_per_step", "Tokens processed per engine step.", "tokens_per_step"),
    ("tokenmill:batch_seqs_per_step", "Sequences in each engine step.", "seqs_per_step"),
]


def render_engines(engines: list[ModelEngine]) -> str:
    """Every engine family with one sample per model; "" with no model loaded (no engine series)."""
    if not engines:
        return ""
    w = Writer({})

    def model(e: ModelEngine, **extra: str) -> Labels:
        return {"model_name": e.name, **extra}

    for name, kind, help_, value in HEALTH:
        w.series(name, kind, help_, [(model(e), value(e.counters)) for e in engines])
    for name, kind, help_, value in SERIES:
        w.series(name, kind, help_, [(model(e), value(e.snapshot)) for e in engines])
    per_position = [(model(e, position=str(i)), n) for e in engines
                    for i, n in enumerate(e.snapshot.spec_accepted_per_position)]
    if per_position:  # only where some model speculates
        w.series("tokenmill:spec_decode_num_accepted_tokens_per_pos_total", "counter", "Proposed tokens accepted, "
                 "by position in the proposal (0 = first).", per_position)
    w.series("vllm:request_success_total", "counter", "Finished sequences by finish reason.",
             [(model(e, finished_reason=reason), n)
              for e in engines for reason, n in sorted(e.snapshot.finished.items())])
    for name, help_, key in HISTOGRAMS:
        w.histograms(name, help_, [(model(e), e.snapshot.histograms[key]) for e in engines])
    return w.text()
