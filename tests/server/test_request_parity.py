"""Less-used request fields as OpenAI, vLLM and Ollama treat them: logit_bias (refused rather than
ignored) and /v1/completions' default max_tokens of 16. The `tiny` fixture checks after each test that
every KV block came back."""
from __future__ import annotations

import pytest

CHAT = [{"role": "user", "content": "hi"}]


def openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": CHAT}),
                                       ("/v1/completions", {"prompt": "hi"})])
def test_logit_bias_that_would_change_the_output_is_refused_not_ignored(client, tiny, path, body):
    body = {**body, "max_tokens": 2}
    for empty in ({}, None):  # what SDKs send by default: nothing to apply
        assert client.post(path, json={**body, "logit_bias": empty}).status_code == 200
    for bias in ({"5": -100}, {"999999": 1}):
        err = openai_error(client.post(path, json={**body, "logit_bias": bias}), 400)
        assert err["param"] == "logit_bias" and "not supported" in err["message"]
    err = openai_error(client.post(path, json={**body, "logit_bias": [5]}), 400)
    assert err["param"] == "logit_bias" and "must be an object" in err["message"]


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
