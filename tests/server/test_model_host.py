"""Loading in the background: /health while loading, after a failed load (the server stays up),
and switching models with /load."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from server_helpers import start_server, wait_idle
from tokenmill import kernels
from tokenmill.server.model_host import default_loader


def poll_health(c: httpx.Client, status: str, timeout: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = c.get("/health")
        if r.json()["status"] == status or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


@pytest.fixture
def gated_server(tiny_gguf):
    """A server whose model load waits for a gate, so the loading state can be observed."""
    gate = threading.Event()

    def loader(spec, report):
        report(0.25)
        gate.wait(30)
        return default_loader(spec, report)

    server, host = start_server(str(tiny_gguf), loader=loader)
    yield server, host, gate
    gate.set()
    server.stop()


def test_health_while_loading_then_ok(gated_server, store):
    server, host, gate = gated_server
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading", "progress": 0.25}
        # A request for the loading model waits for it, as Ollama's do, instead of failing.
        waiting = {}
        request = threading.Thread(target=lambda: waiting.update(r=httpx.post(
            f"{server.url}/api/generate", json={"model": "tiny-llama", "prompt": "x", "stream": False,
                                                "options": {"num_predict": 2, "temperature": 0}}, timeout=30)))
        request.start()
        time.sleep(0.3)
        assert request.is_alive() and c.get("/").status_code == 200
        assert c.post("/load", json={"model": "tiny-a"}).status_code == 409
        gate.set()
        r = poll_health(c, "ok")
        assert r.status_code == 200 and r.json() == {"status": "ok", "kernels": kernels.variant()}
        request.join(30)
        assert waiting["r"].status_code == 200 and waiting["r"].json()["eval_count"] == 2


def test_failed_load_sets_error_and_the_server_stays_up(store):
    server, host = start_server("")
    try:
        with httpx.Client(base_url=server.url, timeout=10) as c:
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "error"
            # Requests name models, never files: a broken file in the store is loaded by its name.
            (store / "corrupt.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
            r = c.post("/load", json={"model": "corrupt"})
            assert r.status_code == 202 and r.json()["status"] == "loading"
            r = poll_health(c, "error")
            assert r.status_code == 503 and "corrupt" in r.json()["error"]
            assert str(store) not in r.text  # where the store is stays the server's business
            assert c.get("/").text == "Ollama is running"
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 503 and "failed" in r.json()["error"]["message"]
            # A good load afterwards recovers.
            assert c.post("/load", json={"model": "tiny-a", "kv_size": 2048}).status_code == 202
            assert poll_health(c, "ok").status_code == 200
            assert c.post("/completion", json={"prompt": "hi", "n_predict": 2, "ignore_eos": True}).json()["tokens_predicted"] == 2
    finally:
        server.stop()


def test_load_switches_models_and_retires_the_old_engine(tiny_gguf, store):
    from tiny_model import TinyLlamaSpec, write_tiny_llama

    write_tiny_llama(store / "other-tiny.gguf", TinyLlamaSpec(seed=5, context_length=128))
    server, host = start_server(str(tiny_gguf))
    try:
        assert host.wait_ready(30)
        old = host.current
        with httpx.Client(base_url=server.url, timeout=10) as c:
            assert c.post("/load", json={"model": "other-tiny", "num_ctx": 64, "parallel": 4}).status_code == 202
            assert poll_health(c, "ok").status_code == 200
            assert host.current is not old and host.current.engine.max_model_len == 64
            assert host.current.name == "other-tiny"
            assert c.post("/api/generate", json={"model": old.name, "prompt": "x"}).status_code == 404
            r = c.post("/api/generate", json={"model": "other-tiny", "prompt": "x", "stream": False,
                                              "options": {"num_predict": 2, "temperature": 0}})
            assert r.status_code == 200 and r.json()["eval_count"] == 2
            bad = c.post("/load", json={"model": "other-tiny", "dtype": "fp8"})
            assert bad.status_code == 400 and "dtype" in bad.json()["error"]
        deadline = time.monotonic() + 10
        while old.aengine._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not old.aengine._thread.is_alive()
        wait_idle(host)
    finally:
        server.stop()
