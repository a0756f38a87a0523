"""Structured output through every API, on the tiny random model: whatever it wants to write, the
output matches what was asked, and a bad schema or grammar is a 400 naming the field."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from server_helpers import model_name

# Bounded everywhere, so even a random model completes it within the token budget.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "yy", "zzz"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "tag", "n"], "additionalProperties": False}
SAMPLED = {"temperature": 1.0, "seed": 4}
# Every object needs a `next` of its own kind: no finite value exists.
CHAIN = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
# Recursive too, but a node without children ends it.
TREE = {"type": "object", "properties": {"value": {"enum": [1, 2]},
                                         "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["value"], "additionalProperties": False}


def valid(text: str) -> dict:
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


def test_ollama_generate_and_chat_with_a_schema(client, tiny):
    name = model_name(tiny[1])
    r = client.post("/api/generate", json={"model": name, "prompt": "hi", "format": SCHEMA, "stream": False,
                                           "options": {**SAMPLED, "num_predict": 60}})
    assert r.status_code == 200, r.text
    assert r.json()["done_reason"] == "stop"
    valid(r.json()["response"])
    r = client.post("/api/chat", json={"model": name, "messages": [{"role": "user", "content": "hi"}],
                                       "format": SCHEMA, "options": {**SAMPLED, "num_predict": 60}})
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"
    valid("".join(x["message"]["content"] for x in lines))


def test_ollama_format_json_only_allows_json(client, tiny):
    r = client.post("/api/generate", json={"model": model_name(tiny[1]), "prompt": "hi", "format": "json",
                                           "stream": False, "options": {"temperature": 0, "num_predict": 30}})
    text = r.json()["response"]
    assert r.status_code == 200 and text.startswith("{")
    if r.json()["done_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_openai_response_format_json_schema_streamed_and_not(client, tiny):
    body = {"model": model_name(tiny[1]), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
            **SAMPLED, "n": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        valid(choice["message"]["content"])
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    texts = ["", ""]
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
    assert texts == [c["message"]["content"] for c in r.json()["choices"]]  # same seed, same samples


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[a-c]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_grammar": 'root ::= "go " ("up" | "down")'}, lambda t: t in ("go up", "go down")),
    ({"guided_json": SCHEMA}, valid),
    ({"guided_json": json.dumps(SCHEMA)}, valid),
    ({"structured_outputs": {"choice": ["a1", "b2"]}}, lambda t: t in ("a1", "b2")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}, valid),
])
def test_openai_completions_with_vllm_guided_fields(client, tiny, extra, check):
    r = client.post("/v1/completions", json={"model": model_name(tiny[1]), "prompt": "x", "max_tokens": 60,
                                             **SAMPLED, **extra})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice["text"]


@pytest.mark.parametrize("extra, check", [
    ({"json_schema": SCHEMA}, valid),
    ({"grammar": 'root ::= [0-9]{3} "-" [a-z]{2}'}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
])
def test_runner_completion_grammar_and_json_schema(client, tiny, extra, check):
    r = client.post("/completion", json={"prompt": "x", "n_predict": 60, **SAMPLED, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["stop_type"] == "eos" and check(r.json()["content"]), r.json()["content"]


SCHEMA_RF = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nonsense"}}}


@pytest.mark.parametrize("path, extra, param, message", [
    ("/v1/chat/completions", {"response_format": SCHEMA_RF}, "response_format.json_schema.schema", "nonsense"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}},
     "response_format.json_schema.schema", "required"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ("/v1/chat/completions", {"guided_regex": "(("}, "guided_regex", "unclosed group"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("/v1/completions", {"guided_grammar": "root ::= (("}, "guided_grammar", "Expected"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ("/v1/completions", {"guided_json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 3,
                                                                             "maximum": 1}}, "required": ["a"]}},
     "guided_json", "nsatisfiable"),
    # Recursion without a base case: no value is finite, so it is refused before the request is queued.
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": {"$ref": "#"}}}}, "response_format.json_schema.schema", "recursive without a base case"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
                              "tool_choice": "required"}, "tools[0].function.parameters", "recursive without a base case"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": CHAIN}}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters", "recursive without a base case"),
    ("/v1/completions", {"guided_json": CHAIN}, "guided_json", "recursive without a base case"),
    ("/v1/completions", {"guided_grammar": "start: a\na: a\n"}, "guided_grammar", "allows no output"),
])
def test_openai_bad_constraints_are_400_naming_the_field(client, tiny, path, extra, param, message):
    body = {"model": model_name(tiny[1]), "max_tokens": 5, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "x"})
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


@pytest.mark.parametrize("path, extra, message", [
    ("/api/generate", {"format": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "does not exist"),
    ("/api/chat", {"format": "yaml"}, 'format must be "json" or a JSON schema'),
    ("/api/chat", {"format": {"type": "string", "pattern": "(("}}, "unclosed group"),
    ("/completion", {"grammar": "root ::= (("}, "grammar"),
    ("/completion", {"json_schema": {"type": 3}}, "json_schema"),
    ("/api/chat", {"format": {"$ref": "#"}}, "recursive without a base case"),
    ("/api/generate", {"format": CHAIN}, "recursive without a base case"),
    ("/completion", {"json_schema": CHAIN}, "recursive without a base case"),
])
def test_ollama_and_runner_bad_constraints_are_400(client, tiny, path, extra, message):
    body = {"model": model_name(tiny[1]), "stream": False, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path == "/api/chat" else {"prompt": "x"})
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"], r.json()


@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_a_recursive_schema_that_can_end_is_followed(client, tiny, api):
    name, finished = model_name(tiny[1]), 0
    for seed in range(3):
        if api == "openai":
            r = client.post("/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 150,
                "temperature": 1.0, "seed": seed,
                "response_format": {"type": "json_schema", "json_schema": {"name": "tree", "schema": TREE}}})
            assert r.status_code == 200, r.text
            text, reason = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
        else:
            r = client.post("/api/chat", json={"model": name, "messages": [{"role": "user", "content": "hi"}],
                                               "format": TREE, "stream": False,
                                               "options": {"temperature": 1.0, "seed": seed, "num_predict": 150}})
            assert r.status_code == 200, r.text
            text, reason = r.json()["message"]["content"], r.json()["done_reason"]
        if reason == "stop":
            jsonschema.validate(json.loads(text), TREE)
            finished += 1
    assert finished  # a tree that may stop at any node ends well within the budget


def test_a_constrained_stream_left_early_frees_everything(tiny):
    # The `tiny` fixture checks afterwards that no request and no KV block is left behind.
    body = {"model": model_name(tiny[1]), "prompt": "x", "max_tokens": 200, "temperature": 1.0, "stream": True,
            "n": 3, "response_format": {"type": "json_object"}}
    with httpx.Client(base_url=tiny[0], timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as s:
        for i, _ in enumerate(s.iter_lines()):
            if i > 3:
                break
