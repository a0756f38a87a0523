"""Constrained decoding on the real Gemma 3 (SentencePiece vocabulary, 262k tokens) through HTTP:
JSON-schema requests on the OpenAI and Ollama APIs return text that validates."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server_helpers import model_name, start_server, wait_idle

pytestmark = pytest.mark.real_model

# Bounded strings and lists, so a short max_tokens always leaves room to close the JSON.
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "country": {"enum": ["France", "Italy", "Spain"]},
    "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}},
    "required": ["city", "country", "population_millions"], "additionalProperties": False}
LIST = {"type": "object", "properties": {
    "colors": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{3,8}$"}, "minItems": 2, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["colors", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    server, host = start_server(str(gemma3_path), dtype="bf16", kv_size=2048)
    assert host.wait_ready(180), host.error
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client, host
    server.stop()


def test_openai_json_schema_on_gemma3_validates(gemma):
    client, host = gemma
    body = {"model": model_name(host), "max_tokens": 60, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a big city in Europe, as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), CITY)
    wait_idle(host, timeout=30)


def test_ollama_format_schema_on_gemma3_validates(gemma):
    client, host = gemma
    body = {"model": model_name(host), "stream": False, "format": LIST,
            "prompt": "List a few colors of the rainbow.",
            "options": {"temperature": 0.8, "seed": 7, "num_predict": 60}}
    r = client.post("/api/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["done_reason"] == "stop", out
    jsonschema.validate(json.loads(out["response"]), LIST)
    wait_idle(host, timeout=30)
