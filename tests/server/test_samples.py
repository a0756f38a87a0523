"""OpenAI n > 1 as one engine request: the prompt is computed once for all samples, each sample has its
own output (and its own stop strings), streaming and not."""
from __future__ import annotations

import json
import random
import re

from server_helpers import wait_idle


def fresh_prompt(seed: int, length: int = 40) -> list[int]:
    # Random token ids, so no earlier test left this prompt in the prefix cache.
    return random.Random(seed).choices(range(3, 250), k=length)


def prompt_tokens_total(client) -> int:
    text = client.get("/metrics").text
    return int(re.search(r"^vllm:prompt_tokens_total(?:\{[^}]*\})? (\d+)$", text, re.M).group(1))


def test_n_samples_with_temperature_differ_and_share_one_prompt(client, tiny, added):
    engine = tiny[1].current.engine
    ids = fresh_prompt(1)
    before = engine.stats.num_prompt_tokens
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "n": 4, "temperature": 1.0,
                                             "seed": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert len({c["text"] for c in body["choices"]}) > 1
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 24
    # One engine request, its prompt computed once.
    assert len(added) == 1
    assert engine.stats.num_prompt_tokens - before == len(ids)


def test_n_greedy_samples_are_equal_and_the_prompt_is_counted_once(client, tiny):
    ids = fresh_prompt(2)
    before = prompt_tokens_total(client)
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "n": 4, "temperature": 0})
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 4 and len(set(texts)) == 1
    assert prompt_tokens_total(client) - before == len(ids)


def test_n_samples_stream_each_choice_to_its_own_end(client, tiny):
    ids = fresh_prompt(3)
    full = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "n": 3, "temperature": 1.0,
                                                "seed": 11, "ignore_eos": True}).json()
    with client.stream("POST", "/v1/completions", json={"prompt": ids, "max_tokens": 5, "n": 3, "temperature": 1.0,
                                                        "seed": 11, "ignore_eos": True, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts, finishes = ["", "", ""], [[], [], []]
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                finishes[c["index"]].append(c["finish_reason"])
    assert texts == [c["text"] for c in full["choices"]]
    assert finishes == [["length"]] * 3
    assert chunks[-1]["usage"]["prompt_tokens"] == len(ids) and chunks[-1]["usage"]["completion_tokens"] == 15


def test_chat_n_streams_a_role_and_a_finish_per_choice(client, tiny):
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "sample me"}], "max_tokens": 3, "n": 4, "temperature": 0,
            "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(roles) == [0, 1, 2, 3] and sorted(finishes) == [0, 1, 2, 3]


def test_a_stop_string_ends_only_its_own_sample(client, tiny):
    host = tiny[1]
    ids = fresh_prompt(4)
    body = {"prompt": ids, "max_tokens": 24, "n": 4, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    texts = [c["text"] for c in client.post("/v1/completions", json=body).json()["choices"]]
    # An early piece of sample 0's text that no other sample contains: sample 0 stops long before the
    # end, so the engine still runs it when the server asks to abort it.
    first = texts[0]
    stop = next(first[i:i + k] for k in (2, 3, 4) for i in range(1, 8)
                if "\ufffd" not in first[i:i + k] and not any(first[i:i + k] in t for t in texts[1:]))
    before = host.current.engine.stats.finished.get("abort", 0)
    choices = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"]
    assert choices[0]["finish_reason"] == "stop" and choices[0]["text"] == first[:first.index(stop)]
    assert [c["text"] for c in choices[1:]] == texts[1:]
    assert [c["finish_reason"] for c in choices[1:]] == ["length"] * 3
    wait_idle(host)
    # Only sample 0 was aborted in the engine; its siblings ran to their end.
    assert host.current.engine.stats.finished.get("abort", 0) - before == 1
