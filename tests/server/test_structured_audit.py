"""Structured output audit through HTTP on the tiny random model: logprobs of constrained rows,
JSON Schema keywords, hostile schemas and grammars (see test_structured_api.py for the basics)."""
from __future__ import annotations

import json
import math

import jsonschema

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
