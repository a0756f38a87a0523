"""One model-name grammar at every door: a name that breaks it is a 400 that names the field, on the
Ollama, OpenAI and runner routes alike, before anything touches the store; no answer carries a
server path; names users make and use keep working."""
from __future__ import annotations

import json
import urllib.parse

import httpx
import pytest

from server_helpers import store_server

HOSTILE = [
    "\ud800", "a" * 300, "../../etc/passwd", "/etc/passwd", "C:\\Windows\\win.ini", "%2e%2e/%2e%2e/etc/passwd",
    "x\x00y", "x\ny", "tiny-a.gguf", "~root", "caf\u00e9",
]

# (method, path, body with NAME where the name goes, the field a bad name is reported under)
ROUTES = [
    ("POST", "/api/generate", {"model": "NAME", "prompt": "x"}, "model"),
    ("POST", "/api/generate", {"name": "NAME", "prompt": "x"}, "name"),
    ("POST", "/api/chat", {"model": "NAME", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ("POST", "/api/embed", {"model": "NAME", "input": "x"}, "model"),
    ("POST", "/api/embeddings", {"model": "NAME", "prompt": "x"}, "model"),
    ("POST", "/api/show", {"model": "NAME"}, "model"),
    ("DELETE", "/api/delete", {"model": "NAME"}, "model"),
    ("POST", "/api/copy", {"source": "NAME", "destination": "fresh"}, "source"),
    ("POST", "/api/copy", {"source": "tiny-a", "destination": "NAME"}, "destination"),
    ("POST", "/api/create", {"model": "NAME", "from": "tiny-a", "stream": False}, "model"),
    ("POST", "/api/create", {"model": "fresh", "from": "NAME", "stream": False}, "from"),
    ("POST", "/api/pull", {"model": "NAME", "stream": False}, "model"),
    ("POST", "/v1/chat/completions", {"model": "NAME", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ("POST", "/v1/completions", {"model": "NAME", "prompt": "x"}, "model"),
    ("POST", "/v1/embeddings", {"model": "NAME", "input": "x"}, "model"),
    ("POST", "/load", {"model": "NAME"}, "model"),
    ("POST", "/completion", {"model": "NAME", "prompt": "x"}, "model"),
    ("POST", "/embedding", {"model": "NAME", "content": "x"}, "model"),
    ("POST", "/tokenize", {"model": "NAME", "content": "x"}, "model"),
    ("POST", "/detokenize", {"model": "NAME", "tokens": [1]}, "model"),
]


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    """A tiny-a server over its own store (TOKENMILL_HOME): (client, models dir)."""
    with store_server(tmp_path_factory.mktemp("names-home"), timeout=30) as (client, models, _):
        yield client, models


def send(client: httpx.Client, method: str, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800, as a hostile client would send it.
    return client.request(method, path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def with_name(body: dict, name: str) -> dict:
    return {k: (name if v == "NAME" else v) for k, v in body.items()}


def store_listing(models) -> list[str]:
    return sorted(str(p.relative_to(models)) for p in models.rglob("*"))


def assert_refused(r: httpx.Response, path: str, field: str, models) -> None:
    assert r.status_code == 400, (path, field, r.text)
    body = r.json()
    if path.startswith("/v1/"):
        assert body["error"]["param"] == field and body["error"]["type"] == "invalid_request_error"
        message = body["error"]["message"]
    else:
        message = body["error"]
    # A lone surrogate is refused where the body is decoded (server/client_json.py), before any name check.
    assert (message.startswith(f"{field}: invalid model name")
            or message.startswith(f"{field} is not valid Unicode: it holds a lone UTF-16 surrogate")), message
    assert str(models.parent) not in r.text and "root:" not in r.text


@pytest.mark.parametrize("method,path,body,field", ROUTES, ids=[f"{r[1]}:{r[3]}" for r in ROUTES])
def test_a_bad_name_is_a_400_naming_the_field_on_every_route(named, method, path, body, field):
    client, models = named
    before = store_listing(models)
    for name in HOSTILE:
        assert_refused(send(client, method, path, with_name(body, name)), path, field, models)
    assert store_listing(models) == before


def test_the_issues_probes_surrogate_on_generate_and_chat_300_chars_on_embed(named):
    client, models = named
    for path, body in (("/api/generate", {"model": "\ud800", "prompt": "x"}),
                       ("/api/chat", {"model": "\ud800", "messages": []}),
                       ("/api/embed", {"model": "x" * 300, "input": "x"})):
        r = send(client, "POST", path, body)
        assert_refused(r, path, "model", models)
        assert "File name too long" not in r.text and "UnicodeEncodeError" not in r.text


def test_modelfile_from_a_path_is_a_400_on_the_modelfile_field(named):
    client, models = named
    before = store_listing(models)
    for base in ("/etc/passwd", "../../etc/passwd", "./model.gguf", str(models / "tiny-a.gguf")):
        r = send(client, "POST", "/api/create", {"model": "x1", "modelfile": f"FROM {base}\n", "stream": False})
        assert r.status_code == 400 and r.json()["error"].startswith("modelfile: FROM: invalid model name"), r.text
        assert str(models.parent) not in r.text
    assert store_listing(models) == before


def test_openai_model_path_parameter_is_checked_too(named):
    client, models = named
    for name in ("%2e%2e", "a" * 300, "caf\u00e9", "x.gguf", "ns/../x"):
        r = client.get("/v1/models/" + urllib.parse.quote(name, safe=""))
        assert_refused(r, "/v1/models/", "model", models)
    # Dots the client encoded (so that no URL normalization removes them) arrive as "..".
    assert_refused(client.get("/v1/models/%2E%2E"), "/v1/models/", "model", models)
    assert client.get("/v1/models/tiny-a").json()["id"] == "tiny-a"
    assert client.get("/v1/models/nope").status_code == 404


def test_names_users_make_keep_working(named):
    client, models = named
    r = client.post("/api/create", json={"model": "me/tiny-chat:v1", "from": "tiny-a", "stream": False,
                                         "parameters": {"num_predict": 2, "temperature": 0}})
    assert r.status_code == 200, r.text
    try:
        for name in ("tiny-a", "tiny-a:latest", "me/tiny-chat:v1"):
            r = client.post("/api/generate", json={"model": name, "prompt": "hi", "stream": False,
                                                   "options": {"num_predict": 2}})
            assert r.status_code == 200 and r.json()["eval_count"] == 2, (name, r.text)
        r = client.post("/api/show", json={"model": "me/tiny-chat:v1"})
        assert r.status_code == 200
        # A well-formed name that is not installed is still Ollama's 404, not a 400.
        r = client.post("/api/generate", json={"model": "registry.ollama.ai/library/llama3.2:3b", "prompt": "x"})
        assert r.status_code == 404
        # The served model by default: no name at all.
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
    finally:
        assert client.request("DELETE", "/api/delete", json={"model": "me/tiny-chat:v1"}).status_code == 200
