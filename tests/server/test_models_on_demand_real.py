"""Models on demand with the real models: a server started on SmolLM2 loads Gemma 3 when a request
names it, serves both, and loading and unloading a model 20 times does not grow the process."""
from __future__ import annotations

import os
import time

import httpx
import pytest

from server_helpers import start_server

pytestmark = pytest.mark.real_model


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def loaded(c: httpx.Client) -> set[str]:
    return {m["name"] for m in c.get("/api/ps").json()["models"]}


@pytest.fixture
def linked_store(smollm2_path, gemma3_path, tmp_path, monkeypatch):
    """A models directory of links to the real files (and their manifests): what the tests create
    or delete stays out of the real store."""
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    for path in (smollm2_path, gemma3_path):
        for f in (path, path.with_name(path.name + ".json")):
            if f.exists():
                (models / f.name).symlink_to(f.resolve())
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    return models


GEMMA_QA = ('FROM gemma3\nTEMPLATE """{{ if .System }}{{ .System }}\n\n{{ end }}Q: {{ .Prompt }}\nA:{{ .Response }}\n"""\n'
            'PARAMETER stop "Q:"\nPARAMETER temperature 0\n')


def test_a_request_for_gemma3_loads_it_beside_smollm2(linked_store, gemma3_path):
    server, host = start_server("smollm2", dtype="auto", kv_size=4096)
    try:
        assert host.wait_ready(120), host.error
        with httpx.Client(base_url=server.url, timeout=120) as c:
            r = c.post("/api/generate", json={"model": "gemma3", "prompt": "The capital of France is",
                                              "raw": True, "stream": False,
                                              "options": {"num_predict": 4, "temperature": 0}})
            assert r.status_code == 200 and r.json()["model"] == "gemma3:270m" and r.json()["eval_count"] == 4
            assert r.json()["response"].strip()
            r = c.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 4, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            ps = {m["name"]: m for m in c.get("/api/ps").json()["models"]}
            assert set(ps) == {"smollm2:135m", "gemma3:270m"}
            assert ps["gemma3:270m"]["size"] > gemma3_path.stat().st_size
            # The README's Modelfile gives the base model a plain question-and-answer template.
            assert c.post("/api/create", json={"model": "gemma-qa", "modelfile": GEMMA_QA}).status_code == 200
            r = c.post("/api/chat", json={"model": "gemma-qa", "stream": False, "options": {"num_predict": 24},
                                          "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            assert r.status_code == 200 and r.json()["model"] == "gemma-qa"
            assert "Paris" in r.json()["message"]["content"], r.json()
    finally:
        server.stop()


@pytest.mark.slow
def test_loading_and_unloading_20_times_keeps_rss_flat(smollm2_path, tiny_gguf):
    server, host = start_server(str(tiny_gguf), dtype="auto", kv_size=2048)
    try:
        assert host.wait_ready(60), host.error
        with httpx.Client(base_url=server.url, timeout=120) as c:
            def cycle():
                assert c.post("/api/generate", json={"model": "smollm2", "prompt": "Hi", "keep_alive": 0,
                                                     "options": {"num_predict": 2}, "stream": False}).status_code == 200
                deadline = time.monotonic() + 30
                # Gone from /api/ps first, then its memory is given back: sample after both.
                while "smollm2:135m" in loaded(c) or host.releasing:
                    assert time.monotonic() < deadline, "smollm2 did not unload"
                    time.sleep(0.05)

            cycle()  # the first load brings in what stays: kernels, allocator arenas
            samples = []
            for _ in range(20):
                cycle()
                samples.append(rss_bytes())
        # Medians of three: one reading swings by ~50 MB with what the allocator happens to hold.
        start, end = sorted(samples[:3])[1], sorted(samples[-3:])[1]
        assert end <= start * 1.10, f"RSS grew from {start / 2**20:.0f} MiB to {end / 2**20:.0f} MiB: {samples}"
    finally:
        server.stop()
