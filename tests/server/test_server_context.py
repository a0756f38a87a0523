"""Context management over HTTP. Ollama's endpoints do what Ollama does: options.num_ctx sets the
context, an over-long prompt is cut to its first options.num_keep tokens plus the newest tail, and a
generation that fills the context shifts it; `"truncate": false` / `"shift": false` turn these off.
OpenAI's endpoints reject an over-long prompt unless truncate_prompt_tokens is given.
(The tiny model's context is 256 tokens.)"""
from __future__ import annotations

from server_helpers import model_name
from test_errors import ollama_error, openai_error

LONG = "a b " * 300


def generate(client, tiny, prompt: str, **extra):
    r = client.post("/api/generate", json={"model": model_name(tiny[1]), "prompt": prompt, "raw": True,
                                           "stream": False, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def original_prompt(body: dict) -> list[int]:
    # `context` is the prompt as the server tokenized it (before any truncation) plus the output.
    return body["context"][:len(body["context"]) - body["eval_count"]]


def test_long_prompt_is_truncated_keeping_num_keep_and_the_newest_tokens(client, tiny, added):
    body = generate(client, tiny, LONG, options={"temperature": 0, "num_predict": 4})
    ids = original_prompt(body)
    assert len(ids) > 256
    # 256 tokens of context, 4 of them left for the answer; Ollama's default num_keep is 4.
    assert body["prompt_eval_count"] == 252
    assert added[-1].prompt_ids == ids[:4] + ids[-248:]


def test_num_ctx_and_num_keep_options(client, tiny, added):
    body = generate(client, tiny, LONG, options={"temperature": 0, "num_predict": 4, "num_ctx": 64, "num_keep": 10})
    ids = original_prompt(body)
    assert body["prompt_eval_count"] == 60
    assert added[-1].prompt_ids == ids[:10] + ids[-50:]
    assert added[-1].max_model_len == 64 and added[-1].num_keep == 10
    # num_keep -1 keeps as much of the start as fits (the last prompt token always stays).
    body = generate(client, tiny, LONG, options={"temperature": 0, "num_predict": 4, "num_ctx": 64, "num_keep": -1})
    assert added[-1].prompt_ids == ids[:59] + ids[-1:]


def test_chat_truncates_too(client, tiny, added):
    r = client.post("/api/chat", json={"model": model_name(tiny[1]), "stream": False,
                                       "messages": [{"role": "user", "content": LONG}],
                                       "options": {"temperature": 0, "num_predict": 2, "num_ctx": 100}})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] == 98 and len(added[-1].prompt_ids) == 98


def test_truncate_false_refuses_with_both_numbers(client, tiny):
    name = model_name(tiny[1])
    msg = ollama_error(client.post("/api/chat", json={"model": name, "truncate": False,
                                                       "messages": [{"role": "user", "content": LONG}]}), 400)
    assert "256" in msg and "tokens" in msg
    n = len(tiny[1].current.engine.tokenizer.encode("a b " * 20))
    msg = ollama_error(client.post("/api/generate", json={"model": name, "prompt": "a b " * 20, "raw": True,
                                                           "truncate": False, "options": {"num_ctx": 16}}), 400)
    assert f"{n} tokens" in msg and "16" in msg
    assert ollama_error(client.post("/api/generate", json={"model": name, "prompt": "x", "truncate": 1}), 400)


def test_a_full_context_shifts_unless_told_not_to(client, tiny, added):
    options = {"temperature": 0, "num_predict": 32, "num_ctx": 24}
    shifted = generate(client, tiny, "a b c d", options=options)
    assert added[-1].shift and shifted["eval_count"] == 32 and shifted["done_reason"] == "length"
    assert added[-1].num_shifted_tokens > 0
    stopped = generate(client, tiny, "a b c d", options=options, shift=False)
    assert not added[-1].shift and stopped["done_reason"] == "length"
    assert stopped["prompt_eval_count"] + stopped["eval_count"] == 24
    # The same text up to where the unshifted one had to stop.
    assert shifted["response"].startswith(stopped["response"])
    # num_predict -2: until the context is full, never shifting.
    filled = generate(client, tiny, "a b c d", options={**options, "num_predict": -2})
    assert not added[-1].shift and filled["eval_count"] == stopped["eval_count"]


def test_openai_rejects_over_long_prompts_unless_asked_to_truncate(client, tiny):
    err = openai_error(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages" and "256" in err["message"]
    err = openai_error(client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2, "n": 3}), 400)
    assert err["code"] == "context_length_exceeded"
    r = client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2, "n": 2, "temperature": 0,
                                             "truncate_prompt_tokens": 30})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 30 and len(r.json()["choices"]) == 2
