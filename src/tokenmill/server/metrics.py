"""GET /metrics in Prometheus' text format, under vLLM's metric names where one exists so existing
dashboards work, and tokenmill:* for the rest. The numbers come from the snapshot the engine thread
publishes after every step: consistent with each other, and a scrape never waits for a step (a
scrape that timed out while the server was busiest would hide exactly the moment that matters)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from tokenmill import cpu_threads, gpu_info, process_stats
from tokenmill.cpu_threads import ThreadChoice
from tokenmill.engine.stats import HistogramSnapshot, StatsSnapshot
from tokenmill.gpu_info import DeviceMemory
from tokenmill.server.model_loads import served_gpu
from tokenmill.server.served_model import ServedModel

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) and not float(v).is_integer() else str(int(v))


class Writer:
    def __init__(self, labels: dict[str, str]):
        self.lines: list[str] = []
        self.base = labels

    def _labels(self, extra: dict[str, str] | None = None) -> str:
        labels = {**self.base, **(extra or {})}
        return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}" if labels else ""

    def metric(self, name: str, kind: str, help_: str, value: float, extra: dict[str, str] | None = None) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{self._labels(extra)} {_fmt(value)}"]

    def labelled(self, name: str, kind: str, help_: str, values: dict[str, float], label: str) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for key, value in sorted(values.items()):
            self.lines.append(f"{name}{self._labels({label: key})} {_fmt(value)}")

    def series(self, name: str, kind: str, help_: str, rows: list[tuple[dict[str, str], float]]) -> None:
        """One metric with a sample per label set (its HELP and TYPE once)."""
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        self.lines += [f"{name}{self._labels(labels)} {_fmt(value)}" for labels, value in rows]

    def histogram(self, name: str, help_: str, h: HistogramSnapshot) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        for bound, count in h.buckets:
            self.lines.append(f"{name}_bucket{self._labels({'le': _fmt(bound)})} {count}")
        self.lines.append(f"{name}_sum{self._labels()} {h.sum!r}")
        self.lines.append(f"{name}_count{self._labels()} {h.count}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


@dataclass
class EngineCounters:
    """How the engine thread is doing, beside its statistics snapshot."""
    healthy: bool
    failed_steps: int
    slow_steps: int
    snapshot_age: float  # seconds since the engine last published (grows while a step hangs)


def render_process(p: process_stats.ProcessStats) -> str:
    """The process collector's metrics of Prometheus' client libraries (what vLLM's /metrics carries),
    plus the peak RSS: a memory bound is judged by its peak, which a scrape of the current RSS misses.
    No model label: they are the process's, whichever models it holds."""
    w = Writer({})
    w.metric("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.",
             p.cpu_seconds)
    w.metric("tokenmill:peak_resident_memory_bytes", "gauge", "The most resident memory the process has held, "
             "in bytes.", p.peak_resident_bytes)
    optional = [("process_resident_memory_bytes", "Resident memory size in bytes.", p.resident_bytes),
                ("process_virtual_memory_bytes", "Virtual memory size in bytes.", p.virtual_bytes),
                ("process_open_fds", "Number of open file descriptors.", p.open_fds),
                ("process_max_fds", "Maximum number of open file descriptors.", p.max_fds),
                ("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", p.start_time)]
    for name, help_, value in optional:
        if value is not None:
            w.metric(name, "gauge", help_, value)
    return w.text()


def render_threads(choice: ThreadChoice | None, torch_threads: int) -> str:
    """The compute threads the process runs (cpu_threads.py) and why; no model label, they are the
    process's. The reason is an info-style metric: a label on a constant 1."""
    w = Writer({})
    if choice is not None:
        w.metric("tokenmill:threads", "gauge", "Threads the compiled core runs, for every model of the process.",
                 choice.count)
        w.metric("tokenmill:threads_info", "gauge", "Why the thread count is what it is (labels; always 1).", 1,
                 {"reason": choice.reason, "source": "requested" if choice.explicit else "default"})
    w.metric("tokenmill:torch_threads", "gauge", "torch's intra-op threads (1 while the compiled core runs every "
             "model step).", torch_threads)
    return w.text()


@dataclass
class GPUState:
    """One GPU that loaded models use: its memory now, and what each model there holds."""
    device: str                        # cuda:0
    name: str                          # NVIDIA H100 80GB HBM3
    memory: DeviceMemory
    models: dict[str, int]             # model name -> bytes of weights + KV cache there


def gpu_states(models: list[ServedModel]) -> list[GPUState]:
    """The GPUs of the loaded models; [] when every model is on the CPU (nothing asks CUDA then)."""
    states: dict[str, GPUState] = {}
    for m in models:
        device = served_gpu(m)
        if device is None:
            continue
        if device not in states:
            states[device] = GPUState(device, gpu_info.gpu_name(device), gpu_info.device_memory(device), {})
        states[device].models[m.name] = m.gpu_bytes
    return [states[d] for d in sorted(states)]


def render_gpus(states: list[GPUState]) -> str:
    """GPU memory per device (the driver's view: every process; and this process's allocator), and per
    model; only where a model is on a GPU. KV usage is vllm:kv_cache_usage_perc, as on the CPU."""
    if not states:
        return ""
    w = Writer({})
    dev = [({"device": g.device}, g) for g in states]
    w.series("tokenmill:gpu_info", "gauge", "The GPUs loaded models use (labels; always 1).",
             [({"device": g.device, "name": g.name}, 1) for g in states])
    w.series("tokenmill:gpu_memory_total_bytes", "gauge", "The GPU's memory in bytes.",
             [(labels, g.memory.total_bytes) for labels, g in dev])
    w.series("tokenmill:gpu_memory_used_bytes", "gauge", "GPU memory in use by every process (total less free), in "
             "bytes.", [(labels, g.memory.used_bytes) for labels, g in dev])
    w.series("tokenmill:gpu_memory_reserved_bytes", "gauge", "GPU memory this process's allocator holds, in bytes.",
             [(labels, g.memory.reserved_bytes) for labels, g in dev])
    w.series("tokenmill:gpu_memory_allocated_bytes", "gauge", "GPU memory in this process's live tensors, in bytes.",
             [(labels, g.memory.allocated_bytes) for labels, g in dev])
    w.series("tokenmill:model_gpu_memory_bytes", "gauge", "A loaded model's weights and KV cache on the GPU, in "
             "bytes (/api/ps size_vram).",
             [({"device": g.device, "model_name": name}, size)
              for g in states for name, size in sorted(g.models.items())])
    return w.text()


def render(snap: StatsSnapshot | None, model: str | None, in_flight: int, rejected: int, status: str,
           engine: EngineCounters | None = None) -> str:
    w = Writer({"model_name": model} if model else {})
    w.metric("tokenmill:requests_in_flight", "gauge", "Admitted HTTP generation/embedding requests.", in_flight)
    w.metric("tokenmill:requests_rejected_total", "counter", "Requests turned away with 503.", rejected)
    w.metric("tokenmill:model_ready", "gauge", "1 when a model is loaded and serving.", status == "ok")
    if engine is not None:
        w.metric("tokenmill:engine_healthy", "gauge", "1 unless the engine thread died or steps keep failing.",
                 engine.healthy)
        w.metric("tokenmill:engine_failed_steps_total", "counter", "Engine steps that raised (their requests "
                 "failed).", engine.failed_steps)
        w.metric("tokenmill:engine_slow_steps_total", "counter", "Engine steps that ran past the watchdog limit.",
                 engine.slow_steps)
        w.metric("tokenmill:engine_snapshot_age_seconds", "gauge", "Seconds since the engine thread last "
                 "published these numbers.", engine.snapshot_age)
    if snap is None:
        return w.text()
    w.metric("vllm:num_requests_running", "gauge", "Sequences in the running batch.", snap.num_running)
    w.metric("vllm:num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", snap.num_waiting)
    w.metric("vllm:kv_cache_usage_perc", "gauge", "KV cache usage (1 = full).", snap.kv_usage)
    w.metric("vllm:gpu_cache_usage_perc", "gauge", "KV cache usage (1 = full); older vLLM name.", snap.kv_usage)
    w.metric("tokenmill:kv_cache_used_blocks", "gauge", "KV blocks referenced by sequences.", snap.num_used_blocks)
    w.metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
             snap.prefix_queries)
    w.metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", snap.prefix_hits)
    w.metric("vllm:num_preemptions_total", "counter", "Sequences preempted (recomputed later).", snap.num_preemptions)
    w.metric("vllm:prompt_tokens_total", "counter", "Prompt tokens computed.", snap.num_prompt_tokens)
    w.metric("tokenmill:prompt_tokens_cached_total", "counter", "Prompt tokens taken from the prefix cache.",
             snap.num_cached_prompt_tokens)
    w.metric("vllm:generation_tokens_total", "counter", "Tokens generated.", snap.num_generation_tokens)
    w.metric("tokenmill:engine_steps_total", "counter", "Engine steps run.", snap.num_steps)
    # Speculative decoding, vLLM's spec_decode family under tokenmill's prefix: acceptance rate is
    # accepted / draft tokens, mean accepted length 1 + accepted / drafts.
    w.metric("tokenmill:spec_decode_num_drafts_total", "counter", "Verifications of proposed tokens (speculative "
             "decoding).", snap.spec_num_drafts)
    w.metric("tokenmill:spec_decode_num_draft_tokens_total", "counter", "Tokens proposed.", snap.spec_num_draft_tokens)
    w.metric("tokenmill:spec_decode_num_accepted_tokens_total", "counter", "Proposed tokens accepted.",
             snap.spec_num_accepted_tokens)
    if snap.spec_accepted_per_position:
        w.series("tokenmill:spec_decode_num_accepted_tokens_per_pos_total", "counter", "Proposed tokens accepted, "
                 "by position in the proposal (0 = first).",
                 [({"position": str(i)}, n) for i, n in enumerate(snap.spec_accepted_per_position)])
    w.labelled("vllm:request_success_total", "counter", "Finished sequences by finish reason.", snap.finished,
               "finished_reason")
    for name, help_, key in HISTOGRAMS:
        w.histogram(name, help_, snap.histograms[key])
    return w.text()


async def metrics(request: Request) -> Response:
    host = request.app.state.host
    # The default model's engine; other loaded models show in /api/ps.
    served = host.current or next(iter(host.loaded_models()), None)
    snap = counters = None
    if served is not None:
        aengine = served.aengine
        snap = aengine.snapshot
        counters = EngineCounters(aengine.health().ok, served.engine.faults.num_failed,
                                  aengine.watchdog.num_slow_steps, time.monotonic() - snap.taken_at)
    text = render(snap, served.name if served else None, host.admission.in_flight, host.admission.num_rejected,
                  host.status, counters) + render_process(process_stats.read()) \
        + render_threads(cpu_threads.current_threads(), cpu_threads.torch_threads()) \
        + render_gpus(gpu_states(host.loaded_models()))
    return PlainTextResponse(text, media_type=CONTENT_TYPE)


def routes() -> list[Route]:
    return [Route("/metrics", metrics, methods=["GET"])]
