"""The HTTP side of engine trouble: observability endpoints answer while a step hangs, a failing
step is a 500 (or an error line on a stream) for its own requests only, repeated failures show on
/health, and a dead engine thread turns new requests away with 503 at once.

Faults are injected through the engine's documented test hook, LLMEngine.step_hook."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from server_helpers import start_server, wait_idle
from tokenmill.engine.health import FAILURES_UNHEALTHY

GEN = {"model": "tiny-llama", "prompt": "hello", "raw": True, "stream": False,
       "options": {"num_predict": 4, "temperature": 0}}


@pytest.fixture
def engine(tiny, monkeypatch):
    eng = tiny[1].current.engine
    monkeypatch.setattr(eng, "step_hook", None)
    return eng


def test_observability_answers_while_a_step_hangs(client, engine):
    release, entered = threading.Event(), threading.Event()

    def hang(batch):
        entered.set()
        release.wait(5)  # a step stuck for 5 s

    engine.step_hook = hang
    worker = threading.Thread(target=lambda: client.post("/api/generate", json=GEN))
    worker.start()
    try:
        assert entered.wait(10)
        for path in ("/health", "/metrics", "/api/ps", "/api/version"):
            start = time.monotonic()
            r = client.get(path, timeout=5)
            assert r.status_code == 200, (path, r.text)
            assert time.monotonic() - start < 1.0, f"{path} waited for the stuck step"
        assert "tokenmill:engine_snapshot_age_seconds" in client.get("/metrics").text
    finally:
        engine.step_hook = None
        release.set()
        worker.join(10)


def fail_next_step(engine):
    def hook(batch):
        engine.step_hook = None
        raise RuntimeError("injected fault")
    engine.step_hook = hook


def test_failed_step_is_a_500_json_and_the_server_goes_on(client, engine):
    fail_next_step(engine)
    r = client.post("/api/generate", json=GEN)
    assert r.status_code == 500 and "injected fault" in r.json()["error"]
    fail_next_step(engine)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    assert client.post("/api/generate", json=GEN).json()["done"] is True


def test_failed_step_ends_a_stream_with_an_error_line(client, engine):
    fail_next_step(engine)
    r = client.post("/api/generate", json={**GEN, "stream": True})
    assert r.status_code == 200
    lines = r.text.strip().splitlines()
    assert "injected fault" in lines[-1] and '"error"' in lines[-1]
    fail_next_step(engine)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                  "max_tokens": 3})
    assert "injected fault" in r.text and r.text.rstrip().endswith("data: [DONE]")


def test_only_the_failing_steps_requests_fail(tiny, client, engine):
    """A step fails in the middle of a long request: that request fails, the next one succeeds, and
    every block comes back (wait_idle)."""
    long_done = {}

    def long_request():
        long_done["r"] = client.post("/api/generate", json={**GEN, "options": {"num_predict": 400}})

    worker = threading.Thread(target=long_request)
    worker.start()
    host = tiny[1]
    deadline = time.monotonic() + 10
    while host.current.engine.num_running() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    fail_next_step(engine)
    worker.join(30)
    assert long_done["r"].status_code == 500
    assert client.post("/api/generate", json=GEN).status_code == 200
    wait_idle(host)


def test_repeated_failures_show_on_health_then_clear(client, engine):
    def always(batch):
        raise RuntimeError("kernel on fire")

    engine.step_hook = always
    for _ in range(FAILURES_UNHEALTHY):
        assert client.post("/api/generate", json=GEN).status_code == 500
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "error" and "kernel on fire" in r.json()["error"]
    assert "tokenmill:engine_healthy 0" in client.get("/metrics").text.replace('{model_name="tiny-llama"}', "")
    engine.step_hook = None
    assert client.post("/api/generate", json=GEN).status_code == 200
    assert client.get("/health").json()["status"] == "ok"


class EngineKiller(BaseException):
    """Escapes every `except Exception`: what kills the engine thread."""


@pytest.fixture
def doomed_server(tiny_gguf):
    server, host = start_server(str(tiny_gguf))
    assert host.wait_ready(60), host.error
    yield server.url, host
    server.stop()


def test_dead_engine_thread_shows_on_health_and_new_requests_fail_fast(doomed_server):
    url, host = doomed_server

    def kill(batch):
        raise EngineKiller("simulated crash")

    host.current.engine.step_hook = kill
    with httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/api/generate", json=GEN)
        assert r.status_code == 500 and "simulated crash" in r.json()["error"]
        health = c.get("/health")
        assert health.status_code == 503 and "crashed" in health.json()["error"]
        for path, body in [("/api/generate", GEN), ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                           ("/api/embed", {"model": "tiny-llama", "input": "x"})]:
            start = time.monotonic()
            r = c.post(path, json=body)
            assert r.status_code == 503 and "engine" in r.text, (path, r.text)
            assert time.monotonic() - start < 2
        assert c.get("/metrics").status_code == 200
