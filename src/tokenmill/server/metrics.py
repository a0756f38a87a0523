"""GET /metrics in Prometheus' text format, under vLLM's metric names where one exists so existing
dashboards work, and tokenmill:* for the rest: the server's own series once, every loaded model's
engine series labelled with its name (metrics_engine.py), then the process, threads and GPUs. The
engine numbers come from the snapshot each engine thread publishes after every step: consistent
with each other, and a scrape never waits for a step (a scrape that timed out while the server was
busiest would hide exactly the moment that matters)."""
from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from tokenmill import cpu_threads, gpu_info, process_stats
from tokenmill.cpu_threads import ThreadChoice
from tokenmill.gpu_info import DeviceMemory
from tokenmill.server.metrics_engine import model_engines, render_engines
from tokenmill.server.metrics_writer import Writer  # also the Ray ingress's page writer
from tokenmill.server.model_loads import served_gpu
from tokenmill.server.served_model import ServedModel

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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


def render_server(model: str | None, in_flight: int, rejected: int, status: str) -> str:
    """The server's own series, once whatever it has loaded. They carry the default model's name (or,
    while it is not loaded, the first loaded model's) as they always have, so queries that select by
    model_name keep finding them."""
    w = Writer({"model_name": model} if model else {})
    w.metric("tokenmill:requests_in_flight", "gauge", "Admitted HTTP generation/embedding requests.", in_flight)
    w.metric("tokenmill:requests_rejected_total", "counter", "Requests turned away with 503.", rejected)
    w.metric("tokenmill:model_ready", "gauge", "1 when a model is loaded and serving.", status == "ok")
    return w.text()


async def metrics(request: Request) -> Response:
    host = request.app.state.host
    models = host.loaded_models()
    default = host.current
    engines = model_engines(models, default)
    text = render_server(engines[0].name if engines else None, host.admission.in_flight,
                         host.admission.num_rejected, host.status) \
        + render_engines(engines) + render_process(process_stats.read()) \
        + render_threads(cpu_threads.current_threads(), cpu_threads.torch_threads()) \
        + render_gpus(gpu_states(models))
    return PlainTextResponse(text, media_type=CONTENT_TYPE)


def routes() -> list[Route]:
    return [Route("/metrics", metrics, methods=["GET"])]
