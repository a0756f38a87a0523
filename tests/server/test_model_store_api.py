"""The model store through the server, with the real `ollama` client: ps, copy, delete, and create
(Modelfile-lite) whose SYSTEM prompt, PARAMETERs and TEMPLATE apply to requests naming the new model."""
from __future__ import annotations

import hashlib

import httpx
import ollama
import pytest

from server_helpers import start_server


@pytest.fixture
def served_store(store):
    models = store
    server, host = start_server("tiny-a", kv_size=2048)
    assert host.wait_ready(30)
    yield server, models
    server.stop()


def test_ps_copy_delete_with_the_ollama_client(served_store):
    server, models = served_store
    client = ollama.Client(host=server.url)
    [m] = client.ps().models
    assert m.model == "tiny-a" and m.size > 0 and m.context_length == 256
    assert client.copy("tiny-b", "my-copy").status == "success"
    names = {m.model for m in client.list().models}
    assert {"tiny-a", "tiny-b", "my-copy"} <= names
    with httpx.Client(base_url=server.url) as c:
        assert "my-copy" in {m["id"] for m in c.get("/v1/models").json()["data"]}
        # The copy is the same weights: the same greedy answer.
        a = c.post("/api/generate", json={"model": "my-copy", "prompt": "hi", "stream": False,
                                          "options": {"num_predict": 6, "temperature": 0}}).json()
        b = c.post("/api/generate", json={"model": "tiny-b", "prompt": "hi", "stream": False,
                                          "options": {"num_predict": 6, "temperature": 0}}).json()
        assert a["model"] == "my-copy" and a["response"] == b["response"]
        # A base another model is made from is not deleted from under it.
        r = c.request("DELETE", "/api/delete", json={"model": "tiny-b"})
        assert r.status_code == 409 and "my-copy" in r.json()["error"]
        assert c.request("DELETE", "/api/delete", json={"model": "nope"}).status_code == 404
        assert c.post("/api/copy", json={"source": "nope", "destination": "x"}).status_code == 404
        assert c.post("/api/copy", json={"source": "tiny-a", "destination": "bad name!"}).status_code == 400
    assert client.delete("my-copy").status == "success"
    assert client.delete("tiny-b").status == "success"
    assert not (models / "tiny-b.gguf").exists()
    assert {m.model for m in client.list().models} == {"tiny-a"}


def test_a_created_model_applies_its_system_prompt_and_parameters(served_store):
    server, _ = served_store
    client = ollama.Client(host=server.url)
    system = "You are a terse assistant."
    r = client.create("terse", from_="tiny-a", system=system, parameters={"num_predict": 4, "temperature": 0})
    assert r.status == "success"
    created = client.chat("terse", messages=[{"role": "user", "content": "hello"}])
    explicit = client.chat("tiny-a", messages=[{"role": "system", "content": system},
                                               {"role": "user", "content": "hello"}],
                           options={"num_predict": 4, "temperature": 0})
    # The SYSTEM prompt is in the rendered prompt: the same prompt tokens and the same greedy answer
    # as sending it explicitly; num_predict 4 came from the PARAMETER.
    assert created.prompt_eval_count == explicit.prompt_eval_count
    assert created.eval_count == 4 and created.message.content == explicit.message.content
    # A request's own options win over the model's parameters.
    assert client.chat("terse", messages=[{"role": "user", "content": "hello"}],
                       options={"num_predict": 2}).eval_count == 2
    shown = client.show("terse")
    assert "num_predict 4" in shown.parameters
    assert f'SYSTEM """{system}"""' in shown.modelfile and "FROM tiny-a" in shown.modelfile


def test_modelfile_template_and_messages_through_the_older_create_form(served_store):
    server, _ = served_store
    modelfile = ('FROM tiny-a\nPARAMETER num_predict 3\nPARAMETER stop "<|end|>"\n'
                 'TEMPLATE """{{ if .System }}S: {{ .System }}\n{{ end }}U: {{ .Prompt }}\nA: {{ .Response }}\n"""\n'
                 'SYSTEM be brief\nMESSAGE user hi\nMESSAGE assistant hello\n')
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/api/create", json={"model": "plain", "modelfile": modelfile, "stream": False})
        assert r.status_code == 200 and r.json() == {"status": "success"}
        rendered = c.post("/tokenize", json={"model": "tiny-a", "content": "S: be brief\nU: hi\nA: hello\nU: again\nA: ",
                                             "add_special": False}).json()["tokens"]
        r = c.post("/api/chat", json={"model": "plain", "stream": False,
                                      "messages": [{"role": "user", "content": "again"}]})
        assert r.status_code == 200 and r.json()["prompt_eval_count"] == len(rendered)
        assert r.json()["eval_count"] <= 3
        bad = c.post("/api/create", json={"model": "x", "modelfile": "PARAMETER temperature 0.1\n"})
        assert bad.status_code == 400 and "FROM" in bad.json()["error"]
        bad = c.post("/api/create", json={"model": "x", "modelfile": "FROM tiny-a\nTEMPLATE {{ range .Messages }}"})
        assert bad.status_code == 400 and "not supported" in bad.json()["error"]
        bad = c.post("/api/create", json={"model": "x", "from": "nope"})
        assert bad.status_code == 404
        bad = c.post("/api/create", json={"model": "tiny-b", "from": "tiny-a"})  # would shadow an installed file
        assert bad.status_code == 400 and "installed model file" in bad.json()["error"]
        tags = {m["name"] for m in c.get("/api/tags").json()["models"]}
        assert "plain" in tags


def test_a_model_made_from_a_catalog_alias_is_listed_and_shown(store, monkeypatch):
    # `from: smollm2` (an alias of smollm2:135m) is recorded as written; the listing must still find
    # its base, or the model serves but /api/tags, /api/show and /v1/models say it does not exist.
    from tokenmill.server import model_info
    from tokenmill.store import KNOWN_MODELS, ModelSpec
    from tokenmill.store.derived import Profile, save_derived

    data = (store / "tiny-a.gguf").read_bytes()
    spec = ModelSpec(name="tiny:1m", aliases=("tinyalias",), filename="tiny-a.gguf", parts=(),
                     sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    save_derived("from-alias", "tinyalias", Profile(system="be brief"))
    listed = {e.name: e for e in model_info.installed_entries(None)}
    assert "from-alias" in listed and listed["from-alias"].path == store / "tiny-a.gguf"
    shown = model_info.find_entry(None, "from-alias")
    assert shown is not None and shown.derived.profile.system == "be brief"
