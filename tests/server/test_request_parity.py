"""Less-used request fields as OpenAI, vLLM and Ollama treat them: logit_bias (applied, its bad
values refused), /v1/completions' default max_tokens of 16, and /api/generate's per-request template. The
`tiny` fixture checks after each test that every KV block came back."""
from __future__ import annotations

import pytest

from server_helpers import model_name

CHAT = [{"role": "user", "content": "hi"}]


def openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def ollama_error(r, status: int) -> str:
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"}
    return r.json()["error"]


def _content(r) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": CHAT}),
                                       ("/v1/completions", {"prompt": "hi"})])
def test_logit_bias_reaches_the_sampler_and_bad_biases_are_400s(client, tiny, path, body):
    """Bans themselves are held to the engine's tests (tests/engine/test_logit_bias.py); here, that the
    values arrive as sent: +100 forces a token, a fraction less loses to it, -100 loses to +100."""
    tokenizer = tiny[1].current.engine.tokenizer
    body = {**body, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    for empty in ({}, None):  # what SDKs send by default: nothing to apply
        assert client.post(path, json={**body, "logit_bias": empty}).status_code == 200
    for bias, forced in (({"7": 100}, 7), ({"7": 100, "8": 99.5}, 7), ({"7": -100, "8": 100}, 8)):
        assert _content(client.post(path, json={**body, "logit_bias": bias})) == tokenizer.decode([forced] * 3)
    vocab = tiny[1].current.engine.loaded.config.vocab_size
    for bias, says in (({"5": 101}, "between -100 and 100"), ({"5": "x"}, "must be numbers"),
                       ({"abc": 1}, "must be token ids"), ({"-3": 1}, "must be token ids"),
                       ({"5": None}, "must be numbers"), ({"5": 10 ** 400}, "between"),
                       ({str(vocab): 1}, "outside the vocabulary"), ([5], "must be an object")):
        err = openai_error(client.post(path, json={**body, "logit_bias": bias}), 400)
        assert err["param"] == "logit_bias" and says in err["message"], err


def test_completions_default_to_16_tokens_as_openai_and_vllm(client, tiny):
    body = {"prompt": "hi", "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # An explicit null is no limit (vLLM's reading): the output runs on past 16.
    r = client.post("/v1/completions", json={**body, "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 16
    # Chat has no such default.
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 16


def _prompt_text(tiny, r) -> str:
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["context"][:body["prompt_eval_count"]]
    return tiny[1].current.engine.tokenizer.decode(ids)


def test_generate_renders_the_prompt_with_the_requests_template(client, tiny):
    name = model_name(tiny[1])
    base = {"model": name, "prompt": "hi", "stream": False, "options": {"num_predict": 1}}
    own = _prompt_text(tiny, client.post("/api/generate", json=base))
    assert "<|im_start|>" in own  # the tiny model's own chat template
    text = _prompt_text(tiny, client.post("/api/generate", json={**base, "template": "Q: {{ .Prompt }} A:"}))
    assert text.endswith("Q: hi A:") and "<|im_start|>" not in text
    text = _prompt_text(tiny, client.post("/api/generate", json={
        **base, "system": "S", "template": "{{ if .System }}[{{ .System }}]{{ end }}{{ .Prompt }}"}))
    assert text.endswith("[S]hi")
    jinja = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert _prompt_text(tiny, client.post("/api/generate", json={**base, "template": jinja})).endswith("<user>hi")
    # raw: no template at all, so the request's is not even read.
    r = client.post("/api/generate", json={**base, "raw": True, "template": "{{ .Nope }}"})
    assert _prompt_text(tiny, r).endswith("hi") and len(r.json()["context"]) <= 4


@pytest.mark.parametrize("path,extra", [("/api/generate", {"prompt": "hi"}), ("/api/chat", {"messages": CHAT})])
def test_thinking_is_refused_as_ollama_refuses_it_for_a_model_without_it(client, tiny, path, extra):
    name = model_name(tiny[1])
    body = {"model": name, "stream": False, "options": {"num_predict": 1}, **extra}
    for off in (False, None):
        assert client.post(path, json={**body, "think": off}).status_code == 200
    for on in (True, "high"):
        assert ollama_error(client.post(path, json={**body, "think": on}), 400) == f'"{name}" does not support thinking'
    assert "think must be" in ollama_error(client.post(path, json={**body, "think": "very"}), 400)
    assert "not found" in ollama_error(client.post(path, json={**body, "model": "nope", "think": True}), 404)


@pytest.mark.parametrize("template,message", [
    (5, "template must be a string"),
    ("{{ .Nope }}", "template: {{ .Nope }} is not supported"),
    ("{% for m in messages %}", "does not compile"),
    ("{% for i in range(10**9) %}x{% endfor %}", "template"),  # a render's budget holds for a request's own
    ("x" * (128 * 1024 + 1), "the limit is"),
])
def test_a_bad_generate_template_is_400_naming_it(client, tiny, template, message):
    r = client.post("/api/generate", json={"model": model_name(tiny[1]), "prompt": "hi", "stream": False,
                                           "template": template, "options": {"num_predict": 1}})
    assert message in ollama_error(r, 400)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
                                       ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                                       ("/v1/embeddings", {"input": "hi"})])
def test_user_is_a_string_as_openai_requires(client, tiny, path, body):
    assert client.post(path, json={**body, "user": "alice"}).status_code == 200
    assert client.post(path, json={**body, "user": None}).status_code == 200
    err = openai_error(client.post(path, json={**body, "user": 5}), 400)
    assert err["param"] == "user" and "must be a string" in err["message"]


def test_the_file_serve_was_started_with_is_served_by_name_after_keep_alive_unloads_it(tmp_path, monkeypatch):
    """Ollama reloads an unloaded model on the next request naming it; the file `serve` was given
    (outside the store) answered 404 "try pulling it" and vanished from the listings instead."""
    import httpx

    from server_helpers import start_server, wait_idle
    from tiny_model import TinyLlamaSpec, write_tiny_llama

    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))  # an empty store: only the file
    (tmp_path / "files").mkdir()
    path = write_tiny_llama(tmp_path / "files" / "mine.gguf", TinyLlamaSpec(seed=3))
    server, host = start_server(str(path), kv_size=2048)
    try:
        assert host.wait_ready(60), host.error
        with httpx.Client(base_url=server.url, timeout=30) as c:
            gen = {"model": "mine", "prompt": "hi", "stream": False, "options": {"num_predict": 1}}
            r = c.post("/api/generate", json={**gen, "keep_alive": 0})
            assert r.status_code == 200 and r.json()["done_reason"] == "length", r.text
            assert wait_for_unloaded(host)
            assert [m["name"] for m in c.get("/api/tags").json()["models"]] == ["mine"]
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["mine"]
            assert c.post("/api/show", json={"model": "mine"}).status_code == 200
            assert c.get("/v1/models/mine").status_code == 200
            r = c.post("/api/generate", json=gen)
            assert r.status_code == 200 and r.json()["model"] == "mine", r.text
            assert [m.name for m in host.loaded_models()] == ["mine"]
            r = c.post("/v1/chat/completions", json={"model": "mine", "messages": CHAT, "max_tokens": 1})
            assert r.status_code == 200, r.text
            wait_idle(host)
    finally:
        server.stop()


def wait_for_unloaded(host) -> bool:
    from server_helpers import wait_for

    return wait_for(lambda: not host.loaded_models())


def test_best_of_is_checked_as_an_integer_then_refused_unless_it_equals_n(client, tiny):
    body = {"prompt": "hi", "max_tokens": 1}
    assert client.post("/v1/completions", json={**body, "best_of": 2, "n": 2}).status_code == 200
    err = openai_error(client.post("/v1/completions", json={**body, "best_of": "x"}), 400)
    assert err["param"] == "best_of" and "must be an integer" in err["message"]
    err = openai_error(client.post("/v1/completions", json={**body, "best_of": 0}), 400)
    assert err["param"] == "best_of" and "at least 1" in err["message"]
    err = openai_error(client.post("/v1/completions", json={**body, "best_of": 3, "n": 2}), 400)
    assert err["param"] == "best_of" and "may only equal n (2), got 3" in err["message"]
