"""Model administration through the server, where it touches what is loaded: deleting a copy leaves
its base served, a refused delete changes nothing, a created model's PARAMETERs are held to the
request options' own checks when it is created, and no keep_alive, however long, breaks /api/ps."""
from __future__ import annotations

import datetime as dt
import hashlib
import time

import httpx
import pytest

from server_helpers import start_server
from tokenmill.cli import main

YEAR = 365 * 86400


@pytest.fixture
def served(store):
    """(client, host, models directory) of a server started with tiny-a, tiny-b installed too."""
    server, host = start_server("tiny-a", kv_size=2048)
    try:
        assert host.wait_ready(30), host.error
        with httpx.Client(base_url=server.url, timeout=30) as c:
            yield c, host, store
    finally:
        server.stop()


def generate(c: httpx.Client, model: str, **extra) -> httpx.Response:
    return c.post("/api/generate", json={"model": model, "prompt": "hello", "stream": False,
                                         "options": {"num_predict": 2, "temperature": 0}, **extra})


def loaded(c: httpx.Client) -> dict[str, float]:
    """Each loaded model's name -> seconds until it unloads, as /api/ps says."""
    r = c.get("/api/ps")
    assert r.status_code == 200, r.text
    return {m["name"]: dt.datetime.fromisoformat(m["expires_at"].replace("Z", "+00:00")).timestamp() - time.time()
            for m in r.json()["models"]}


def delete(c: httpx.Client, name: str) -> httpx.Response:
    return c.request("DELETE", "/api/delete", json={"model": name})


def test_deleting_a_copy_never_unloads_its_base(served):
    c, _, _ = served
    assert generate(c, "tiny-b").status_code == 200
    for base, copy in (("tiny-a", "copy-a"), ("tiny-b", "copy-b")):  # the default model and one loaded on demand
        assert c.post("/api/copy", json={"source": base, "destination": copy}).status_code == 200
        assert generate(c, copy).status_code == 200  # served by its base's engine
        assert delete(c, copy).status_code == 200
    # Neither base was told to unload (an unload makes the expiry now): both stay for minutes at least.
    after = loaded(c)
    assert set(after) == {"tiny-a", "tiny-b"} and min(after.values()) > 60
    assert {m["name"] for m in c.get("/api/tags").json()["models"]} >= {"tiny-a", "tiny-b"}


def test_a_refused_delete_leaves_the_model_served(served):
    c, _, models = served
    assert generate(c, "tiny-b").status_code == 200
    for base in ("tiny-a", "tiny-b"):
        assert c.post("/api/copy", json={"source": base, "destination": f"from-{base}"}).status_code == 200
        r = delete(c, base)
        assert r.status_code == 409 and f"from-{base}" in r.json()["error"]
        assert (models / f"{base}.gguf").exists()
    after = loaded(c)
    assert set(after) == {"tiny-a", "tiny-b"} and min(after.values()) > 60
    assert generate(c, "tiny-b").status_code == 200
    # Once its copy is gone, the base goes, and stops being served.
    assert delete(c, "from-tiny-b").status_code == 200 and delete(c, "tiny-b").status_code == 200
    assert "tiny-b" not in loaded(c) and not (models / "tiny-b.gguf").exists()


def test_deleting_a_model_made_from_a_blob_unloads_it_under_its_own_name(served):
    c, _, models = served
    data = (models / "tiny-b.gguf").read_bytes()
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    assert c.post(f"/api/blobs/{digest}", content=data).status_code == 201
    assert c.post("/api/create", json={"model": "pushed", "files": {"m.gguf": digest}, "stream": False}).status_code == 200
    assert c.post("/api/copy", json={"source": "pushed", "destination": "pushed-too"}).status_code == 200
    assert generate(c, "pushed").status_code == 200 and "pushed" in loaded(c)
    # Its blob stays for pushed-too, but a deleted name is not served any more.
    assert delete(c, "pushed").status_code == 200
    assert "pushed" not in loaded(c) and c.head(f"/api/blobs/{digest}").status_code == 200
    assert generate(c, "pushed-too").status_code == 200 and "pushed-too" in loaded(c)
    assert delete(c, "pushed-too").status_code == 200
    assert "pushed-too" not in loaded(c) and c.head(f"/api/blobs/{digest}").status_code == 404
    assert set(loaded(c)) == {"tiny-a"}


@pytest.mark.parametrize("keep_alive", ["999999999h", 1e308, 10**30, "2562048h", str(10**400)])
def test_a_keep_alive_too_long_for_a_clock_is_forever_and_ps_still_answers(served, keep_alive, monkeypatch, capsys):
    c, _, _ = served
    assert generate(c, "tiny-b", keep_alive=keep_alive).status_code == 200
    assert loaded(c)["tiny-b"] > 5 * YEAR  # shown as a model kept forever is
    monkeypatch.setenv("TOKENMILL_HOST", str(c.base_url).removeprefix("http://").rstrip("/"))
    assert main(["ps"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny-b")][0].endswith("Forever")


def test_a_long_keep_alive_a_clock_can_count_is_kept(served):
    c, _, _ = served
    assert generate(c, "tiny-b", keep_alive="87600h").status_code == 200  # ten years
    assert 10 * YEAR - 60 < loaded(c)["tiny-b"] <= 10 * YEAR + 5


BAD_PARAMETERS = [
    ({"temperature": -1}, "parameters.temperature must be between 0 and 100, got -1"),
    ({"top_p": 5}, "parameters.top_p must be between 0 and 1, got 5"),
    ({"num_ctx": -5}, "parameters.num_ctx must be at least 2, got -5"),
    ({"repeat_penalty": 0}, "parameters.repeat_penalty must be greater than 0, got 0"),
    ({"num_predict": -100}, "parameters.num_predict must be at least -2, got -100"),
    ({"top_k": 1.5}, "parameters.top_k must be an integer"),
]


@pytest.mark.parametrize(("parameters", "message"), BAD_PARAMETERS)
def test_create_refuses_parameters_a_request_would_be_refused(served, parameters, message):
    c, _, _ = served
    r = c.post("/api/create", json={"model": "bad", "from": "tiny-a", "parameters": parameters, "stream": False})
    assert r.status_code == 400 and r.json()["error"].startswith(message), r.text
    assert c.post("/api/show", json={"model": "bad"}).status_code == 404  # nothing was stored


@pytest.mark.parametrize(("line", "message"), [
    ("PARAMETER temperature nan", "modelfile: PARAMETER temperature must be a finite number, got NaN"),
    ("PARAMETER temperature inf", "modelfile: PARAMETER temperature must be a finite number, got Infinity"),
    ("PARAMETER top_p 5", "modelfile: PARAMETER top_p must be between 0 and 1, got 5"),
    ("PARAMETER num_predict -100", "modelfile: PARAMETER num_predict must be at least -2, got -100"),
    ("PARAMETER top_k 1.5", "modelfile: line 2: PARAMETER top_k must be an integer, got '1.5'"),
])
def test_create_refuses_modelfile_parameters_a_request_would_be_refused(served, line, message):
    c, _, _ = served
    r = c.post("/api/create", json={"model": "bad", "modelfile": f"FROM tiny-a\n{line}\n", "stream": False})
    assert r.status_code == 400 and r.json()["error"] == message, r.text
    assert c.post("/api/show", json={"model": "bad"}).status_code == 404


def test_ollamas_runner_parameters_are_checked_and_dropped(served):
    """A Modelfile written for Ollama sets runner options (mirostat, num_gpu, use_mmap) that mean nothing
    here: create takes them as requests' options do (type-checked, then dropped), not as unknown."""
    c, _, _ = served
    modelfile = "FROM tiny-a\nPARAMETER mirostat 0\nPARAMETER num_gpu 99\nPARAMETER use_mmap false\nPARAMETER temperature 0\n"
    r = c.post("/api/create", json={"model": "from-ollama", "modelfile": modelfile, "stream": False})
    assert r.status_code == 200, r.text
    r = c.post("/api/create", json={"model": "from-json", "from": "tiny-a", "stream": False,
                                    "parameters": {"mirostat_tau": 5.0, "num_thread": 4, "penalize_newline": True}})
    assert r.status_code == 200, r.text
    for name in ("from-ollama", "from-json"):
        shown = c.post("/api/show", json={"model": name}).json()["parameters"]
        assert "mirostat" not in shown and "num_gpu" not in shown and "num_thread" not in shown, shown
        assert generate(c, name).status_code == 200
    assert "temperature" in c.post("/api/show", json={"model": "from-ollama"}).json()["parameters"]
    for body, message in (({"modelfile": "FROM tiny-a\nPARAMETER use_mmap maybe\n"},
                           "modelfile: line 2: PARAMETER use_mmap must be true or false, got 'maybe'"),
                          ({"modelfile": "FROM tiny-a\nPARAMETER mirostat x\n"},
                           "modelfile: line 2: PARAMETER mirostat must be an integer, got 'x'"),
                          ({"from": "tiny-a", "parameters": {"num_gpu": "all"}}, "parameters.num_gpu must be an integer"),
                          ({"from": "tiny-a", "parameters": {"use_mlock": 1}}, "parameters.use_mlock must be true or false")):
        r = c.post("/api/create", json={"model": "bad", "stream": False, **body})
        assert r.status_code == 400 and r.json()["error"] == message, r.text
    assert c.post("/api/show", json={"model": "bad"}).status_code == 404


def test_parameters_at_the_ends_of_their_ranges_serve_both_apis(served):
    c, _, _ = served
    # Ollama's "no limit" (num_predict -1/-2) and "random" (seed -1) are requests' values too.
    for name, parameters in (("unbounded", {"num_predict": -1, "seed": -1, "top_k": -1, "temperature": 0}),
                             ("to-the-end", {"num_predict": -2, "num_ctx": 64, "top_p": 1, "repeat_penalty": 2})):
        r = c.post("/api/create", json={"model": name, "from": "tiny-a", "parameters": parameters, "stream": False})
        assert r.status_code == 200, r.text
        r = generate(c, name)
        assert r.status_code == 200 and r.json()["eval_count"] == 2, r.text
        # An OpenAI request takes num_predict as its max_tokens default: "no limit" is no max_tokens.
        r = c.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text


def test_the_file_the_server_was_started_with_is_not_deleted_and_its_path_not_told(store, tmp_path):
    from tiny_model import TinyLlamaSpec, write_tiny_llama

    outside = tmp_path / "operators-own-dir"
    outside.mkdir()
    path = write_tiny_llama(outside / "mine.gguf", TinyLlamaSpec(seed=5))
    server, host = start_server(str(path), kv_size=2048)
    try:
        assert host.wait_ready(30), host.error
        with httpx.Client(base_url=server.url, timeout=30) as c:
            names = {m["name"] for m in c.get("/api/ps").json()["models"]} | {"mine", str(path)}
            for name in sorted(names):
                r = delete(c, name)
                assert r.status_code in (400, 404), (name, r.text)
                assert "operators-own-dir" not in r.text and str(tmp_path) not in r.text, r.text
            assert path.exists() and generate(c, "mine").status_code == 200
    finally:
        server.stop()


def test_runner_template_endpoints_show_a_created_models_template_and_system(served):
    """/apply-template renders what the chat endpoints would for a model made with TEMPLATE and SYSTEM,
    and /props shows that template, not its base file's."""
    c, _, _ = served
    modelfile = 'FROM tiny-a\nSYSTEM Be terse.\nTEMPLATE """{{ .System }}<<{{ .Prompt }}>>"""\n'
    assert c.post("/api/create", json={"model": "terse", "modelfile": modelfile, "stream": False}).status_code == 200
    r = c.post("/apply-template", json={"model": "terse", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["prompt"].endswith("Be terse.<<hi>>"), r.text
    shown = c.get("/props", params={"model": "terse"}).json()["chat_template"]
    base = c.get("/props", params={"model": "tiny-a"}).json()["chat_template"]
    assert "<<" in shown and "<<" not in base  # the TEMPLATE (turned into Jinja), not the base file's
    plain = c.post("/apply-template", json={"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}]})
    assert "Be terse." not in plain.json()["prompt"]
