"""Every client-facing error: status code, envelope (OpenAI's under /v1, Ollama's elsewhere) and a
message naming the field or the numbers involved."""
from __future__ import annotations

import pytest

from server_helpers import model_name

CHAT = [{"role": "user", "content": "hi"}]


def openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def ollama_error(r, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    return body["error"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_malformed_json_openai(client, path):
    err = openai_error(client.post(path, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "invalid JSON" in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/api/embed", "/completion", "/load"])
def test_malformed_json_ollama_and_runner(client, path):
    assert "invalid JSON" in ollama_error(client.post(path, content=b"[1, 2"), 400)


def test_body_must_be_an_object(client):
    assert "JSON object" in ollama_error(client.post("/api/generate", json=[1, 2]), 400)


@pytest.mark.parametrize("body,param", [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"stop": 5}, "stop"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"priority": "urgent"}, "priority"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {}}, "stream_options"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
])
def test_bad_openai_options_name_the_field(client, body, param):
    err = openai_error(client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **body}), 400)
    assert err["param"] == param and param.split("[")[0] in err["message"]


def test_openai_options_refused_on_completions_too(client):
    for body, param in (({"stream_options": {"include_usage": True}}, "stream_options"),
                        ({"include_stop_str_in_output": True}, "include_stop_str_in_output")):
        err = openai_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}), 400)
        assert err["param"] == param
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "include_stop_str_in_output": False,
                                             "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and '"usage"' in r.text


@pytest.mark.parametrize("path,field", [("/v1/embeddings", "input"), ("/api/embed", "input")])
def test_dimensions_over_the_embedding_size_name_the_maximum(client, tiny, path, field):
    host = tiny[1]
    name, dim = model_name(host), host.current.engine.loaded.config.dim
    r = client.post(path, json={"model": name, field: "hello", "dimensions": dim})
    vec = r.json()["data"][0]["embedding"] if path.startswith("/v1") else r.json()["embeddings"][0]
    assert r.status_code == 200 and len(vec) == dim
    r = client.post(path, json={"model": name, field: "hello", "dimensions": dim + 1})
    assert r.status_code == 400 and f"dimensions must be at most {dim}, got {dim + 1}" in r.text


@pytest.mark.parametrize("options,field", [
    ({"temperature": "warm"}, "options.temperature"),
    ({"top_k": 1.5}, "options.top_k"),
    ({"num_predict": -7}, "options.num_predict"),
    ({"repeat_penalty": 0}, "options.repeat_penalty"),
    ({"typical_p": 2}, "options.typical_p"),
    ({"stop": [1, 2]}, "options.stop"),
    ({"num_ctx": 0}, "options.num_ctx"),
])
def test_bad_ollama_options_name_the_field(client, tiny, options, field):
    r = client.post("/api/generate", json={"model": model_name(tiny[1]), "prompt": "hi", "options": options})
    assert field in ollama_error(r, 400)


def test_options_must_be_an_object(client, tiny):
    r = client.post("/api/chat", json={"model": model_name(tiny[1]), "messages": CHAT, "options": [1]})
    assert "options" in ollama_error(r, 400)


def test_unknown_model_is_404_everywhere(client):
    assert "not found" in openai_error(client.post("/v1/chat/completions", json={"model": "nope", "messages": CHAT}),
                                       404)["message"]
    assert "not found" in ollama_error(client.post("/api/generate", json={"model": "nope", "prompt": "x"}), 404)
    assert "not found" in ollama_error(client.post("/api/show", json={"model": "nope"}), 404)
    assert "not found" in ollama_error(client.post("/api/embed", json={"model": "nope", "input": "x"}), 404)
    assert ollama_error(client.post("/api/pull", json={"model": "nope:1b"}), 404)
    assert ollama_error(client.post("/load", json={"model": "nope"}), 404)


def test_model_is_required_by_ollama(client):
    assert "model is required" in ollama_error(client.post("/api/generate", json={"prompt": "x"}), 400)


def test_unknown_routes_and_methods_use_the_envelope(client):
    assert openai_error(client.get("/v1/nope"), 404)
    assert ollama_error(client.get("/api/nope"), 404)
    assert ollama_error(client.get("/api/generate"), 405)


def num_tokens(host, text: str) -> int:
    return len(host.current.engine.tokenizer.encode(text))


def test_prompt_longer_than_context_is_400_with_both_numbers(client, tiny):
    name = model_name(tiny[1])
    long = "a b " * 300  # the tiny model's context is 256 tokens
    n = num_tokens(tiny[1], long)
    err = openai_error(client.post("/v1/completions", json={"prompt": long, "max_tokens": 2}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert f"{n} tokens" in err["message"] and "256" in err["message"]
    # Ollama truncates by default (tests/server/test_context.py); "truncate": false refuses instead.
    msg = ollama_error(client.post("/api/generate", json={"model": name, "prompt": long, "raw": True,
                                                           "truncate": False}), 400)
    assert f"{n} tokens" in msg and "256" in msg
    # num_ctx lowers the limit for one request.
    short = "a b " * 20
    msg = ollama_error(client.post("/api/generate", json={"model": name, "prompt": short, "raw": True,
                                                           "truncate": False, "options": {"num_ctx": 16}}), 400)
    assert f"{num_tokens(tiny[1], short)} tokens" in msg and "16" in msg


def test_truncation_when_asked_for(client, tiny):
    name = model_name(tiny[1])
    long = "a b " * 300
    n = num_tokens(tiny[1], long)
    r = client.post("/v1/completions", json={"prompt": long, "max_tokens": 2, "temperature": 0,
                                             "truncate_prompt_tokens": 50})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 50
    err = openai_error(client.post("/v1/embeddings", json={"input": long}), 400)
    assert f"{n} tokens" in err["message"] and "256" in err["message"]
    r = client.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 100})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100
    # Ollama's /api/embed truncates by default, as Ollama does, and refuses when told not to.
    r = client.post("/api/embed", json={"model": name, "input": long})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == 256
    msg = ollama_error(client.post("/api/embed", json={"model": name, "input": long, "truncate": False}), 400)
    assert f"{n} tokens" in msg and "256" in msg


def test_full_queue_is_503_with_retry_after(client, tiny):
    host = tiny[1]
    saved = host.admission.max_queue
    host.admission.max_queue = 1
    host.admission.in_flight += 1  # as if one request were running: the next could fit once it ends
    try:
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        err = openai_error(r, 503)
        assert r.headers["retry-after"] == "1" and err["code"] == "queue_full"
        r = client.post("/api/generate", json={"model": model_name(host), "prompt": "x"})
        assert "busy" in ollama_error(r, 503) and r.headers["retry-after"] == "1"
        assert client.post("/api/embed", json={"model": model_name(host), "input": "x"}).status_code == 503
    finally:
        host.admission.max_queue = saved
        host.admission.in_flight -= 1
    metrics = client.get("/metrics").text
    assert "tokenmill:requests_rejected_total" in metrics


def test_n_counts_against_the_queue(client, tiny):
    host = tiny[1]
    saved = host.admission.max_queue
    host.admission.max_queue = 3
    try:
        host.admission.in_flight += 1  # one request running: 3 sequences fit once it ends
        try:
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 3})
            assert openai_error(r, 503)["code"] == "queue_full" and r.headers["retry-after"] == "1"
        finally:
            host.admission.in_flight -= 1
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 3}).status_code == 200
        # More sequences than the limit itself can never run: 400, and no Retry-After to retry it by.
        r = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1, "n": 2})
        err = openai_error(r, 400)
        assert err["code"] == "too_many_sequences" and "4 sequences" in err["message"] and "limit of 3" in err["message"]
        assert "retry-after" not in r.headers
        # llama-server's /completion with a list of prompts: each one is a sequence too.
        r = client.post("/completion", json={"prompt": ["a", "b", "c", "d"], "n_predict": 1})
        assert r.status_code == 400 and "4 sequences" in r.text, r.text
        assert client.post("/completion", json={"prompt": ["a", "b", "c"], "n_predict": 1}).status_code == 200
    finally:
        host.admission.max_queue = saved


def test_unsupported_features_are_400(client, tiny):
    name = model_name(tiny[1])
    assert "images" in ollama_error(client.post("/api/generate", json={"model": name, "prompt": "x",
                                                                        "images": ["aGk="]}), 400)
    assert "suffix" in ollama_error(client.post("/api/generate", json={"model": name, "prompt": "x",
                                                                        "suffix": "y"}), 400)
    assert openai_error(client.post("/v1/completions", json={"prompt": "x", "suffix": "y"}), 400)["param"] == "suffix"
    assert openai_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400)["param"] == \
        "max_tokens"  # without echo there is nothing to return
    assert openai_error(client.post("/v1/chat/completions", json={"messages": []}), 400)["param"] == "messages"


def test_unknown_fields_are_ignored(client):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "frobnicate": True})
    assert r.status_code == 200


def test_empty_prompt_just_loads(client, tiny):
    r = client.post("/api/generate", json={"model": model_name(tiny[1])})
    assert r.status_code == 200 and r.json()["done_reason"] == "load" and r.json()["done"] is True

