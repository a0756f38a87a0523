"""Bounded work over HTTP: a request that never stops by itself (Ollama's num_predict -1 with
context shift, OpenAI without max_tokens) ends at the server's token cap, and a deadline ends a
request with `length`, never silently."""
from __future__ import annotations

import time

import pytest

from server_helpers import model_name


@pytest.fixture
def engine(tiny, monkeypatch):
    eng = tiny[1].current.engine
    monkeypatch.setattr(eng, "step_hook", None)
    return eng


def test_num_predict_minus_one_stops_at_the_cap(client, tiny, engine, monkeypatch):
    monkeypatch.setattr(engine, "max_new_tokens", 40)
    body = {"model": model_name(tiny[1]), "prompt": "hello", "raw": True, "stream": False,
            "options": {"num_predict": -1, "temperature": 0, "num_ctx": 24}}  # shifts the context, never stops
    r = client.post("/api/generate", json=body).json()
    assert (r["done_reason"], r["eval_count"]) == ("length", 40)
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 10_000, "temperature": 0,
                                              "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 40


def test_num_predict_minus_two_fills_the_context_within_the_cap(client, tiny, engine):
    body = {"model": model_name(tiny[1]), "prompt": "hello", "raw": True, "stream": False,
            "options": {"num_predict": -2, "temperature": 0, "num_ctx": 32}}
    r = client.post("/api/generate", json=body).json()
    assert r["done_reason"] == "length" and r["prompt_eval_count"] + r["eval_count"] == 32


def test_deadline_ends_a_request_with_length(client, tiny, engine, monkeypatch):
    monkeypatch.setattr(engine.cfg, "request_timeout", 0.5)
    engine.step_hook = lambda batch: time.sleep(0.02)  # slow enough that 5000 tokens take minutes
    start = time.monotonic()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                   "max_tokens": 5000, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert 0 < r.json()["usage"]["completion_tokens"] < 5000
    assert time.monotonic() - start < 5
    # streamed too; ignore_eos because a sampled EOS from the random tiny model would end it first
    body = {"prompt": "hi", "max_tokens": 5000, "stream": True, "ignore_eos": True, "speculative": False}
    with client.stream("POST", "/v1/completions", json=body) as s:
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"finish_reason": "length"' in events[-2]
