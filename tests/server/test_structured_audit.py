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
