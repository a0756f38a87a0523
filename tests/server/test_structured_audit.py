"""Structured output audit through HTTP on the tiny random model: logprobs of constrained rows,
JSON Schema keywords, hostile schemas and grammars (see test_structured_api.py for the basics)."""
from __future__ import annotations

import json
import math

import jsonschema
import pytest

from server_helpers import model_name

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "yy", "zzz"]}},
          "required": ["ok", "tag"], "additionalProperties": False}


def rf(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}}


def test_top_logprobs_of_a_constrained_row_leave_out_what_the_grammar_forbids(client, tiny):
    # Where the grammar allows a single token ('{', '"ok"'...) every other one is at -inf; reporting
    # them made the body unencodable (a 500), non-streamed and streamed alike.
    body = {"model": model_name(tiny[1]), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "temperature": 1.0, "seed": 0, "n": 2, "logprobs": True, "top_logprobs": 3, **rf(SCHEMA)}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        entries = choice["logprobs"]["content"]
        assert entries and all(math.isfinite(e["logprob"]) for e in entries)
        assert all(1 <= len(e["top_logprobs"]) <= 3 for e in entries)
        assert all(math.isfinite(t["logprob"]) for e in entries for t in e["top_logprobs"])
        assert any(len(e["top_logprobs"]) == 1 for e in entries)  # forced steps: the chosen token alone
    r = client.post("/completion", json={"prompt": "x", "n_predict": 40, "temperature": 1.0, "seed": 0, "n_probs": 3,
                                         "json_schema": SCHEMA})
    assert r.status_code == 200, r.text
    probs = r.json()["completion_probabilities"]
    assert all(math.isfinite(t["logprob"]) for p in probs for t in p["top_logprobs"])


# No finite output (every "a" needs another): llguidance compiles it and gives up a few tokens in.
ENDLESS = 'root ::= "a" root'
# A legitimate schema, but 3000 optional properties are more alternatives at one point than
# llguidance's parser follows (it gives up at a property name).
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)},
        "additionalProperties": False}


def test_a_grammar_the_parser_gives_up_on_mid_answer_is_a_400_not_a_server_error(client, tiny):
    name = model_name(tiny[1])
    r = client.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 50, "temperature": 1.0,
                                             "seed": 0, "guided_grammar": ENDLESS})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "grammar_failed" and "could not be followed" in err["message"], err
    assert "non-verbose" not in err["message"]
    r = client.post("/api/generate", json={"model": name, "prompt": "x", "format": WIDE, "stream": False,
                                           "options": {"temperature": 1.0, "seed": 0, "num_predict": 60}})
    assert r.status_code == 400 and "simplify the grammar or schema" in r.json()["error"], r.text
    r = client.post("/completion", json={"prompt": "x", "n_predict": 50, "seed": 0, "grammar": ENDLESS})
    assert r.status_code == 400, r.text
    with client.stream("POST", "/v1/chat/completions", json={
            "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True,
            "guided_grammar": ENDLESS}) as s:
        assert s.status_code == 200
        text = "".join(s.iter_lines())
    assert "could not be followed" in text and "[DONE]" not in text.split("could not be followed")[0]
    # The server goes on (the fixture checks that no request or KV block is left behind).
    r = client.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 20,
                                             "guided_choice": ["yes", "no"]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")


def test_boolean_schemas(client, tiny):
    # true is JSON Schema's "any value" (llguidance takes objects only: it was a 400 'Expecting object
    # schema to apply options'); false allows nothing.
    name = model_name(tiny[1])
    for seed in range(3):
        r = client.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 60, "temperature": 1.0,
                                                 "seed": seed, "guided_json": True})
        assert r.status_code == 200, r.text
        if r.json()["choices"][0]["finish_reason"] == "stop":
            json.loads(r.json()["choices"][0]["text"])
    r = client.post("/completion", json={"prompt": "x", "n_predict": 5, "json_schema": False})
    assert r.status_code == 400 and "false allows no value" in r.json()["error"], r.text


def test_an_overlapping_oneof_is_refused_with_advice_the_client_can_follow(client, tiny):
    r = client.post("/api/chat", json={"model": model_name(tiny[1]), "messages": [{"role": "user", "content": "hi"}],
                                       "stream": False, "format": {"oneOf": [{"type": "integer"}, {"type": "number"}]}})
    assert r.status_code == 400, r.text
    assert "use anyOf" in r.json()["error"] and "coerce_one_of" not in r.json()["error"], r.json()


@pytest.mark.parametrize("so, param", [
    ({"jsonx": {"type": "integer"}}, "structured_outputs.jsonx"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
])
def test_an_unknown_structured_outputs_key_is_a_400_not_an_unconstrained_answer(client, tiny, so, param):
    r = client.post("/v1/completions", json={"model": model_name(tiny[1]), "prompt": "x", "max_tokens": 5,
                                             "structured_outputs": so})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "not supported" in r.json()["error"]["message"]


def test_structured_outputs_options_beside_the_constraint_are_accepted(client, tiny):
    r = client.post("/v1/completions", json={"model": model_name(tiny[1]), "prompt": "x", "max_tokens": 10,
                                             "structured_outputs": {"choice": ["yes", "no"],
                                                                    "disable_any_whitespace": True}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
