"""Helpers for the HTTP tests: a real uvicorn server on a random loopback port in a background
thread, and checks on the model host behind it."""
from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from tokenmill.config import Config
from tokenmill.server import LoadSpec, ModelHost, create_app
from tokenmill.server.model_host import HostPolicy
from tokenmill.server.commands import bind_socket

TINY_KV_TOKENS = 8192


class Terminal(io.StringIO):
    """Typed input: `run` without a prompt opens the chat only on a terminal (piped stdin is the prompt)."""

    def isatty(self) -> bool:
        return True


class LiveServer:
    def __init__(self, app, *, graceful_timeout: int = 5, http="auto"):
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=graceful_timeout,
                                http=http)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def start_server(model: str, *, max_queue: int = 256, dtype: str = "fp32", kv_size: int = TINY_KV_TOKENS,
                 loader=None, fetcher=None, compile: bool = False, **more_settings) -> tuple[LiveServer, ModelHost]:
    settings = Config(dtype=dtype, kv_size=kv_size, max_queue=max_queue, compile=compile, **more_settings)
    host = ModelHost(max_queue=max_queue, retire_timeout=5, policy=HostPolicy.from_settings(settings),
                     fetcher=fetcher, **({"loader": loader} if loader else {}))
    if model:
        host.start_load(LoadSpec(model, settings.engine_config()))
    server = LiveServer(create_app(host, settings, fetcher=fetcher)).start()
    return server, host


def hang_up_mid_stream(url: str, path: str, body: dict, event: str, host: ModelHost, count: int = 2) -> None:
    """Stream `body` to `path` with the engine's steps slowed (so the answer cannot end first), read
    until the `event: <event>` line has come `count` times, check the request holds KV blocks, and
    drop the connection."""
    engine = host.current.engine
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "step_hook", lambda batch: time.sleep(0.01))
        with httpx.Client(base_url=url, timeout=30) as client, client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line == f"event: {event}"
                if seen == count:
                    break
            assert engine.blocks.num_used_blocks > 0


def wait_idle(host: ModelHost, timeout: float = 10.0) -> None:
    """Every request finished and every KV block back in the pool, in every loaded model."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engines = [m.engine for m in host.loaded_models()]
        if host.admission.in_flight == 0 and all(e.blocks.num_used_blocks == 0 and not e.has_unfinished()
                                                 for e in engines):
            return
        time.sleep(0.02)
    state = [(e.blocks.num_used_blocks, e.num_running(), e.num_waiting()) for e in engines]
    raise AssertionError(f"not idle: (blocks used, running, waiting) per model {state}, "
                         f"in_flight={host.admission.in_flight}")


def wait_for(predicate, timeout: float = 10.0, poll: float = 0.01) -> bool:
    """Whether predicate() came true within timeout seconds (checked every poll seconds)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def model_name(host: ModelHost) -> str:
    return host.current.name


def stream_calls(chunks) -> tuple[str, list[dict], list[str]]:
    """(content, calls, finish reasons) assembled from streamed chunks as the openai SDK's users do."""
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.id is not None:  # a call's header comes first, with its id, type and name
                assert tc.index not in calls and tc.type == "function"
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        reasons += [choice.finish_reason] if choice.finish_reason else []
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], reasons


@contextlib.contextmanager
def store_server(home: Path, *, extra_models: int = 0, timeout: float = 60,
                 **server_options) -> Iterator[tuple[httpx.Client, Path, ModelHost]]:
    """A server over its own store (TOKENMILL_HOME=home) holding tiny-a (and tiny-b, ... for
    extra_models), serving tiny-a: (client, models dir, host)."""
    from tiny_model import TinyLlamaSpec, write_tiny_llama

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_HOME", str(home))
        models = home / "models"
        models.mkdir()
        for i in range(1 + extra_models):
            write_tiny_llama(models / f"tiny-{chr(ord('a') + i)}.gguf", TinyLlamaSpec(seed=1 + i))
        server, host = start_server("tiny-a", kv_size=2048, **server_options)
        assert host.wait_ready(60), host.error
        try:
            with httpx.Client(base_url=server.url, timeout=timeout) as client:
                yield client, models, host
        finally:
            server.stop()


def start_speculative_server(folder: Path) -> tuple[LiveServer, ModelHost]:
    """A server over a tiny Q8_0 model on the native path (where the engine speculates), proposing
    eagerly (1-token matches, 6 tokens) so that a tiny model's looping output gets proposals accepted."""
    import gguf

    from tiny_model import TinyLlamaSpec, write_tiny_llama

    path = write_tiny_llama(folder / "q.gguf", TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0,
                                                             context_length=512))
    live, host = start_server(str(path), dtype="gguf", spec_ngram_min=1, num_speculative_tokens=6)
    assert host.wait_ready(60), host.error
    return live, host


def serve_tiny_qwen3(folder: Path, template: str, spec) -> Iterator[tuple[httpx.Client, ModelHost]]:
    """(client, host) of a server of a tiny Qwen3 (`spec`: a TinyLlamaSpec) with this chat template, until
    the generator closes: a module fixture's body."""
    from tiny_model import write_tiny_qwen

    path = write_tiny_qwen(folder / "tiny-qwen3.gguf", "qwen3", spec, chat_template=template)
    server, host = start_server(str(path), dtype="auto", kv_size=4096)
    assert host.wait_ready(60), host.error
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client, host
    server.stop()
