"""An assistant prefill: a conversation that ends with the assistant's own text is continued (the
prompt ends with that text, its turn left open), as Ollama's /api/chat does and as vLLM's
continue_final_message asks on /v1/chat/completions; the answer is what the model writes after it."""
from __future__ import annotations

import pytest

from server_helpers import model_name

PREFILL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
GREEDY = {"temperature": 0, "num_predict": 6}


def prompt_text(host, seq) -> str:
    return host.current.engine.tokenizer.decode(seq.prompt_ids, skip_special_tokens=False)


def test_ollama_chat_continues_a_final_assistant_message(client, tiny, added):
    url, host = tiny
    r = client.post("/api/chat", json={"model": model_name(host), "messages": PREFILL, "stream": False,
                                       "options": GREEDY})
    assert r.status_code == 200, r.text
    assert prompt_text(host, added[-1]).endswith("<|im_start|>assistant\nhello there")
    # The same text as a raw prompt gives the same answer: the prefill is the prompt's end, nothing more.
    raw = client.post("/api/generate", json={"model": model_name(host), "prompt": prompt_text(host, added[-1]),
                                             "raw": True, "stream": False, "options": GREEDY})
    assert added[-1].prompt_ids == added[-2].prompt_ids
    assert r.json()["message"]["content"] == raw.json()["response"]


def test_ollama_chat_without_assistant_text_at_the_end_opens_a_new_turn(client, tiny, added):
    url, host = tiny
    for messages in ([{"role": "user", "content": "hi"}], PREFILL[:1] + [{"role": "assistant", "content": "  "}]):
        r = client.post("/api/chat", json={"model": model_name(host), "messages": messages, "stream": False,
                                           "options": GREEDY})
        assert r.status_code == 200, r.text
        assert prompt_text(host, added[-1]).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_openai_continue_final_message_is_the_same_prefill(client, tiny, added):
    url, host = tiny
    ollama = client.post("/api/chat", json={"model": model_name(host), "messages": PREFILL, "stream": False,
                                            "options": GREEDY}).json()
    r = client.post("/v1/chat/completions", json={"model": model_name(host), "messages": PREFILL, "max_tokens": 6,
                                                  "temperature": 0, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert added[-1].prompt_ids == added[-2].prompt_ids
    assert r.json()["choices"][0]["message"]["content"] == ollama["message"]["content"]
    # Without the flag, OpenAI's API answers a final assistant message with a new turn (as vLLM does).
    client.post("/v1/chat/completions", json={"model": model_name(host), "messages": PREFILL, "max_tokens": 2})
    assert prompt_text(host, added[-1]).endswith("hello there<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("extra, messages, param", [
    ({"continue_final_message": True}, PREFILL[:1], "messages"),
    ({"continue_final_message": True, "add_generation_prompt": True}, PREFILL, "continue_final_message"),
    ({"chat_template_kwargs": {"continue_final_message": True}}, PREFILL, "chat_template_kwargs"),
])
def test_openai_continue_final_message_refuses_what_it_cannot_continue(client, tiny, extra, messages, param):
    r = client.post("/v1/chat/completions", json={"model": model_name(tiny[1]), "messages": messages,
                                                  "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
