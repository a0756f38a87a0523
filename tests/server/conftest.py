"""Live servers for the HTTP tests: one tiny-model server shared by the session (cheap to load,
enough for protocol behaviour), one with a longer context for tool listings, and a SmolLM2 one for
the few real-model checks; and tiny thinking Qwen3s, each module's own (its SPEC)."""
from __future__ import annotations

import httpx
import pytest

from qwen_templates import OPEN_THINK_TEMPLATE, QWEN3_TEMPLATE
from server_helpers import serve_tiny_qwen3, start_server, wait_idle
from tokenmill.server.commands import bind_socket
from tiny_model import TinyLlamaSpec, write_tiny_llama


def serving(path, ready_within: float = 60, **settings):
    """A server on the model at path, once it is ready; stopped when the fixture ends."""
    server, host = start_server(str(path), **settings)
    try:
        assert host.wait_ready(ready_within), host.error
        yield server, host
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_server(tiny_gguf):
    yield from serving(tiny_gguf)


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


@pytest.fixture
def nobody_listens(monkeypatch):
    """TOKENMILL_HOST at a port nobody answers on: the CLI works on the store, in-process."""
    sock = bind_socket("127.0.0.1", 0)  # a port that was bound (so it was free) and is never listened on
    port = sock.getsockname()[1]
    sock.close()
    monkeypatch.setenv("TOKENMILL_HOST", f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def long_tiny_server(tmp_path_factory):
    """A tiny model with room for a tool listing: 1,024 tokens of context (its tokens are about one byte
    each). Modules that need it override `tiny` with it; it stops with the module."""
    path = write_tiny_llama(tmp_path_factory.mktemp("long-tiny") / "tiny-1k.gguf", TinyLlamaSpec(context_length=1024))
    yield from serving(path)


@pytest.fixture
def long_tiny(long_tiny_server):
    """(base url, ModelHost) of the 1k-context server; checks nothing leaked after each test. A module
    that needs the room overrides `tiny` with it, so `client` and `oai` talk to it."""
    server, host = long_tiny_server
    yield server.url, host
    wait_idle(host)


@pytest.fixture
def oai(tiny):
    """The official `openai` client, unchanged, on the module's `tiny` server."""
    import openai

    with openai.OpenAI(base_url=f"{tiny[0]}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="session")
def smol_server(smollm2_path):
    yield from serving(smollm2_path, 180, dtype="bf16", kv_size=4096)


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


@pytest.fixture(scope="module")
def qwen3(request, tmp_path_factory):
    """(client, host): a tiny Qwen3 of the module's SPEC with Qwen3's template (the model opens its block)."""
    yield from serve_tiny_qwen3(tmp_path_factory.mktemp("qwen3"), QWEN3_TEMPLATE, request.module.SPEC)


@pytest.fixture(scope="module")
def always_thinks(request, tmp_path_factory):
    """(client, host): the same with a template that opens the block in the prompt (DeepSeek-R1's kind)."""
    yield from serve_tiny_qwen3(tmp_path_factory.mktemp("r1"), OPEN_THINK_TEMPLATE, request.module.SPEC)
