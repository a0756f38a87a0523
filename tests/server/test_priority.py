"""Request priority reaches the engine: vLLM's integer `priority` (lower runs first: < 0 high, 0 normal,
> 0 low) or a level name, on the OpenAI endpoints and as a top-level field of Ollama's."""
from __future__ import annotations

import pytest

from server_helpers import model_name
from test_errors import ollama_error, openai_error
from tokenmill.engine import Priority

CASES = [(-3, Priority.HIGH), (0, Priority.NORMAL), (7, Priority.LOW), ("high", Priority.HIGH),
         ("LOW", Priority.LOW), ("normal", Priority.NORMAL), (None, Priority.NORMAL)]


def with_priority(body: dict, value) -> dict:
    return body if value is None else {**body, "priority": value}


@pytest.mark.parametrize("value,expected", CASES)
def test_openai_priority(client, tiny, added, value, expected):
    r = client.post("/v1/chat/completions", json=with_priority(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, value))
    assert r.status_code == 200, r.text
    assert added[-1].priority is expected


@pytest.mark.parametrize("value,expected", CASES)
def test_ollama_priority(client, tiny, added, value, expected):
    r = client.post("/api/generate", json=with_priority(
        {"model": model_name(tiny[1]), "prompt": "hi", "stream": False, "options": {"num_predict": 1}}, value))
    assert r.status_code == 200, r.text
    assert added[-1].priority is expected


def test_every_sample_of_a_request_has_its_priority(client, tiny, added):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 3, "priority": -1})
    assert r.status_code == 200 and len(added) == 1 and added[0].priority is Priority.HIGH


@pytest.mark.parametrize("value", ["urgent", 1.5, True, [1]])
def test_bad_priority_is_a_400(client, tiny, value):
    err = openai_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": value}), 400)
    assert err["param"] == "priority"
    assert "priority" in ollama_error(client.post("/api/chat", json={
        "model": model_name(tiny[1]), "messages": [{"role": "user", "content": "x"}], "priority": value}), 400)
