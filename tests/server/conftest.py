"""Live servers for the HTTP tests: one tiny-model server shared by the session (cheap to load,
enough for protocol behaviour), and a SmolLM2 one for the few real-model checks."""
from __future__ import annotations

import httpx
import pytest

from server_helpers import start_server, wait_idle
from tiny_model import TinyLlamaSpec, write_tiny_llama


@pytest.fixture(scope="session")
def tiny_server(tiny_gguf):
    server, host = start_server(str(tiny_gguf))
    assert host.wait_ready(60), host.error
    yield server, host
    server.stop()


@pytest.fixture
def tiny(tiny_server):
    """(base url, ModelHost) of the shared tiny server; checks nothing leaked after each test."""
    server, host = tiny_server
    yield server.url, host
    wait_idle(host)


@pytest.fixture
def client(tiny):
    with httpx.Client(base_url=tiny[0], timeout=30) as c:
        yield c


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A models directory (TOKENMILL_HOME) holding two different tiny models, tiny-a and tiny-b."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    write_tiny_llama(models / "tiny-a.gguf", TinyLlamaSpec(seed=1))
    write_tiny_llama(models / "tiny-b.gguf", TinyLlamaSpec(seed=2))
    return models


@pytest.fixture(scope="session")
def smol_server(smollm2_path):
    server, host = start_server(str(smollm2_path), dtype="bf16", kv_size=4096)
    assert host.wait_ready(180), host.error
    yield server, host
    server.stop()


@pytest.fixture
def added(tiny, monkeypatch):
    """Every Sequence the tiny server's scheduler is handed, as the engine took it (after truncation)."""
    scheduler = tiny[1].current.engine.scheduler
    seqs = []
    add = scheduler.add

    def spy(seq):
        seqs.append(seq)
        return add(seq)

    monkeypatch.setattr(scheduler, "add", spy)
    return seqs
