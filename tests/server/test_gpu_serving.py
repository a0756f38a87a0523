"""What the server says and does about models on a GPU, with the GPU played by fakes (CI has none):
/api/ps's size_vram, models on demand held to the GPU's memory instead of the RAM budget, the GPU
series of /metrics (and none of them while every model is on the CPU), `tokenmill ps`'s PROCESSOR."""
from __future__ import annotations

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import start_server
from tokenmill import gpu_info
from tokenmill.cli_models import processor
from tokenmill.engine import memory as engine_memory
from tokenmill.gpu_info import DeviceMemory
from tokenmill.server import metrics, model_host, model_loads
from tokenmill.server.model_loads import MemoryPool, load_pool

MB = 10**6


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


class FakeGPU:
    """One GPU of `total` bytes: what the host's loaded models hold there is in use, plus `other`
    bytes of some other process."""

    def __init__(self, total: int, other: int = 0):
        self.total, self.other = total, other
        self.host: model_host.ModelHost | None = None
        self.asked: list[str] = []

    def memory(self, device) -> DeviceMemory:
        self.asked.append(str(device))
        held = sum(m.gpu_bytes for m in self.host.loaded_models()) if self.host else 0
        return DeviceMemory(self.total - held - self.other, self.total, held, held + 4096)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Every model the host loads counts as on cuda:0 (the engines themselves run on the CPU)."""
    gpu = FakeGPU(0)
    monkeypatch.setattr(model_host, "load_pool", lambda engine: MemoryPool("cuda:0", engine.gpu_memory_utilization))
    monkeypatch.setattr(model_loads, "served_gpu", lambda served: "cuda:0")
    monkeypatch.setattr(metrics, "served_gpu", lambda served: "cuda:0")
    monkeypatch.setattr(engine_memory, "gpu_bytes", engine_memory.engine_bytes)
    monkeypatch.setattr(gpu_info, "device_memory", gpu.memory)
    monkeypatch.setattr(gpu_info, "gpu_name", lambda device: "Fake H100")
    monkeypatch.setattr(model_loads, "GPU_LOAD_MARGIN", 0)  # tiny models: no 512 MiB workspace
    return gpu


def loaded(c: httpx.Client) -> dict[str, dict]:
    return {m["name"]: m for m in c.get("/api/ps").json()["models"]}


def generate(c: httpx.Client, model: str) -> httpx.Response:
    return c.post("/api/generate", json={"model": model, "prompt": "hi", "stream": False,
                                         "options": {"num_predict": 2, "temperature": 0}})


def test_gpu_models_report_size_vram_evict_by_gpu_memory_and_show_in_metrics(store, fake_gpu):
    # A tiny fp32 model: 0.37 MB file (counted as 4x, its bf16 weights' upper bound), 0.4 MB of
    # weights and 0.26 MB of KV cache for 512 tokens. The GPU's budget (0.9 of it) fits one model
    # loaded whole and the next one's load, not two loaded side by side.
    file = (store / "tiny-a.gguf").stat().st_size
    kv_512 = 262_144
    fake_gpu.total = int((4 * file + kv_512 + 100_000) / 0.9)
    # The RAM budget is far too small for either: it is not what a GPU model is held to.
    server, host = start_server("tiny-a", kv_size=512, max_memory_gb=0.0001)
    fake_gpu.host = host
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert host.wait_ready(30), host.error
            ps = loaded(c)["tiny-a"]
            assert ps["size_vram"] == ps["size"] > file  # weights + KV, all of it on the GPU
            assert host.current.engine.cfg.max_total_tokens == 512  # the budget left the KV cache whole

            got = families(c.get("/metrics").text)
            [total] = got["tokenmill:gpu_memory_total_bytes"].samples
            assert total.labels == {"device": "cuda:0"} and total.value == fake_gpu.total
            assert got["tokenmill:gpu_memory_used_bytes"].samples[0].value == ps["size"]
            assert got["tokenmill:gpu_memory_reserved_bytes"].samples[0].value == ps["size"] + 4096
            assert got["tokenmill:gpu_info"].samples[0].labels == {"device": "cuda:0", "name": "Fake H100"}
            [model] = got["tokenmill:model_gpu_memory_bytes"].samples
            assert model.labels == {"device": "cuda:0", "model_name": "tiny-a"} and model.value == ps["size"]
            assert "vllm:kv_cache_usage_perc" in got  # KV usage: the same series as on the CPU

            # tiny-b does not fit beside tiny-a on the GPU: the idle tiny-a goes, as Ollama evicts.
            assert generate(c, "tiny-b").status_code == 200
            ps = loaded(c)
            assert set(ps) == {"tiny-b"} and ps["tiny-b"]["size_vram"] == ps["tiny-b"]["size"]
            assert set(fake_gpu.asked) == {"cuda:0"}
    finally:
        server.stop()


def test_a_busy_gpu_is_503_naming_the_gpu_budget(store, fake_gpu):
    fake_gpu.total = 10 * MB
    fake_gpu.other = 9 * MB  # another process holds most of it: 0.9 x 1 MB is not enough for a load
    server, host = start_server("", kv_size=512)
    fake_gpu.host = host
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = generate(c, "tiny-a")
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "needs 0.00 GB, more than the cuda:0 memory budget 0.00 GB" in r.json()["error"], r.text
            assert loaded(c) == {}
    finally:
        server.stop()


def test_cpu_models_keep_size_vram_0_and_metrics_without_gpu_series(client):
    [m] = client.get("/api/ps").json()["models"]
    assert m["size_vram"] == 0 and m["size"] > 0
    assert "tokenmill:gpu_" not in client.get("/metrics").text


def test_memory_pools():
    ram, gpu = MemoryPool(), MemoryPool("cuda:0", 0.5)
    assert ram.describe(12 * 10**9) == "memory budget 12.00 GB"
    assert gpu.describe(3 * 10**9) == "cuda:0 memory budget 3.00 GB"
    assert ram.budget(123, held=7) == 123


def test_gpu_budget_is_the_utilization_of_free_plus_held(monkeypatch):
    monkeypatch.setattr(gpu_info, "device_memory", lambda d: DeviceMemory(30 * MB, 80 * MB, 0, 0))
    assert MemoryPool("cuda:0", 0.5).budget(1, held=10 * MB) == 20 * MB


def test_a_load_counts_its_bf16_weights_on_the_gpu(tiny_gguf):
    size = tiny_gguf.stat().st_size
    assert MemoryPool().load_bytes(str(tiny_gguf)) == int(size * 1.1)
    assert MemoryPool("cuda:0").load_bytes(str(tiny_gguf)) == 4 * size + model_loads.GPU_LOAD_MARGIN


def test_load_pool_without_a_gpu_is_ram():
    from tokenmill.engine import EngineConfig

    assert load_pool(EngineConfig(device="cpu")) == MemoryPool()
    if not torch.cuda.is_available():
        assert load_pool(EngineConfig(device="auto")) == MemoryPool()
        assert load_pool(EngineConfig(device="cuda")) == MemoryPool()  # the load itself says why not


def test_load_pool_on_a_gpu(monkeypatch):
    from tokenmill.engine import EngineConfig
    from tokenmill.model.gpu import device

    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_info.torch.cuda, "current_device", lambda: 0)
    assert load_pool(EngineConfig(device="cuda", gpu_memory_utilization=0.8)) == MemoryPool("cuda:0", 0.8)
    assert load_pool(EngineConfig(device="auto")) == MemoryPool("cuda:0", 0.9)


def test_render_gpus_is_valid_prometheus_per_device():
    states = [metrics.GPUState("cuda:0", 'GPU "zero"', DeviceMemory(1, 10, 3, 4), {"a": 5, "b": 2}),
              metrics.GPUState("cuda:1", "GPU one", DeviceMemory(6, 10, 0, 0), {"c": 1})]
    got = families(metrics.render_gpus(states))
    used = {s.labels["device"]: s.value for s in got["tokenmill:gpu_memory_used_bytes"].samples}
    assert used == {"cuda:0": 9, "cuda:1": 4}
    assert got["tokenmill:gpu_info"].samples[0].labels["name"] == 'GPU "zero"'
    per_model = {(s.labels["device"], s.labels["model_name"]): s.value
                 for s in got["tokenmill:model_gpu_memory_bytes"].samples}
    assert per_model == {("cuda:0", "a"): 5, ("cuda:0", "b"): 2, ("cuda:1", "c"): 1}
    assert metrics.render_gpus([]) == ""


@pytest.mark.parametrize(("size", "vram", "shown"), [(100, 0, "100% CPU"), (100, 100, "100% GPU"),
                                                     (100, 48, "52%/48% CPU/GPU"), (0, 0, "100% CPU")])
def test_ps_processor_column(size, vram, shown):
    assert processor(size, vram) == shown
