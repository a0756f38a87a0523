"""JSON built to break a parser, and strings that are not Unicode, through every route that reads
them: deep nesting, numbers of thousands of digits and lone UTF-16 surrogates get a 400 naming the
problem, in the body or in JSON text a field carries (guided_json, a past call's arguments), and
none of them is ever stored by /api/create."""
from __future__ import annotations

import json

import httpx
import pytest

from server_helpers import model_name, start_server

DEEP = 5000
CHAT = [{"role": "user", "content": "hi"}]


def nested(levels: int, inner: str = "1") -> str:
    return "[" * levels + inner + "]" * levels


def post_raw(client, path: str, text: str):
    """`text` sent as it is: the JSON a client library would refuse to write."""
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


def error_message(r, status: int = 400) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    return err["message"] if isinstance(err, dict) else err


def request_body(path: str, model: str) -> dict:
    if path.startswith("/v1/chat") or path == "/api/chat":
        return {"model": model, "messages": CHAT, "max_tokens": 2, "stream": False}
    if path in ("/v1/embeddings", "/api/embed"):
        return {"model": model, "input": "hi"}
    return {"model": model, "prompt": "hi", "max_tokens": 2, "n_predict": 2, "stream": False}


ROUTES = ["/api/generate", "/api/chat", "/api/embed", "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
          "/completion", "/tokenize", "/api/show", "/api/create"]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("levels", [1000, DEEP])
def test_deeply_nested_body_is_400(client, path, levels):
    message = error_message(post_raw(client, path, '{"model": "x", "prompt": ' + nested(levels) + "}"))
    assert "invalid JSON" in message and "deep" in message, message


@pytest.mark.parametrize("path", ["/api/generate", "/v1/chat/completions", "/completion"])
def test_deep_but_parseable_body_is_400_before_anything_recurses_on_it(client, tiny, path):
    body = request_body(path, model_name(tiny[1]))
    text = json.dumps(body)[:-1] + ', "extra": ' + nested(500) + "}"
    assert "deep" in error_message(post_raw(client, path, text))


def test_a_body_nested_within_the_limit_is_served(client, tiny):
    schema = {"type": "string"}
    for _ in range(20):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    r = client.post("/v1/chat/completions", json={"model": model_name(tiny[1]), "messages": CHAT, "max_tokens": 2,
                                                  "guided_json": schema})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, field", [
    ("/api/generate", '"options": {"num_predict": %s}'),
    ("/v1/chat/completions", '"max_tokens": %s'),
    ("/v1/completions", '"max_tokens": %s'),
    ("/completion", '"n_predict": %s'),
])
def test_a_number_of_thousands_of_digits_is_400(client, tiny, path, field):
    body = request_body(path, model_name(tiny[1]))
    text = json.dumps(body)[:-1] + ", " + field % ("9" * 5000) + "}"
    message = error_message(post_raw(client, path, text))
    assert "invalid JSON" in message and "digits" in message and "9" * 50 not in message, message


@pytest.mark.parametrize("path, field", [
    ("/api/generate", '"options": {"temperature": %s}'),
    ("/api/generate", '"options": {"top_p": -%s}'),
    ("/v1/completions", '"frequency_penalty": %s'),
    ("/v1/chat/completions", '"top_p": %s'),
    ("/completion", '"temperature": %s'),
])
def test_an_integer_too_large_for_a_float_option_is_400(client, tiny, path, field):
    """Within the digit limit but past a double's range: float() overflows rather than giving inf."""
    body = request_body(path, model_name(tiny[1]))
    text = json.dumps(body)[:-1] + ", " + field % ("1" + "0" * 400) + "}"
    message = error_message(post_raw(client, path, text))
    assert "finite number" in message and "0" * 100 not in message, message


@pytest.mark.parametrize("option, value", [("num_ctx", -1e308), ("num_speculative_tokens", 1e300),
                                           ("num_ctx", "x" * 5000), ("temperature", ["a"] * 2000)])
def test_a_bad_option_is_not_echoed_in_full(client, tiny, option, value):
    r = client.post("/api/generate", json={"model": model_name(tiny[1]), "prompt": "hi", "stream": False,
                                           "options": {option: value}})
    message = error_message(r)
    assert option in message and len(message) < 200, message


def test_a_bad_role_is_not_echoed_in_full(client, tiny):
    r = client.post("/v1/chat/completions", json={"model": model_name(tiny[1]), "max_tokens": 2,
                                                  "messages": [{"role": "u" * 5000, "content": "hi"}]})
    message = error_message(r)
    assert "messages[0].role" in message and len(message) < 200, message


@pytest.mark.parametrize("path, field", [
    ("/v1/chat/completions", "guided_json"),
    ("/v1/completions", "guided_json"),
    ("/v1/chat/completions", "response_format"),
    ("/completion", "json_schema"),
    ("/v1/chat/completions", "tool_calls"),
])
@pytest.mark.parametrize("inner", [nested(DEEP), nested(1000), '{"a": ' + "9" * 5000 + "}", '{"enum": ["\\ud800"]}'])
def test_json_text_inside_a_field_is_checked_like_the_body(client, tiny, path, field, inner):
    body = request_body(path, model_name(tiny[1]))
    if field == "response_format":
        body[field] = {"type": "json_schema", "json_schema": {"name": "t", "schema": inner}}
    elif field == "tool_calls":
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": inner}}
        body["messages"] = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "c1", "content": "ok"}, *CHAT]
    else:
        body[field] = inner
    message = error_message(client.post(path, json=body))
    assert "JSON" in message or "Unicode" in message, message


SURROGATE_BODIES = [
    ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800 hi"}]}'),
    ("/api/generate", '{"model": "%s", "prompt": "\\ud800 hi", "stream": false}'),
    ("/api/chat", '{"model": "%s", "messages": [{"role": "user", "content": "hi \\udfff"}], "stream": false}'),
    ("/tokenize", '{"content": "\\ud800"}'),
    ("/completion", '{"prompt": "a\\udc00b", "n_predict": 2}'),
    ("/v1/embeddings", '{"model": "%s", "input": "\\ud800"}'),
    ("/v1/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
                             '"tools": [{"type": "function", "function": {"name": "f\\ud800"}}]}'),
    ("/v1/completions", '{"model": "%s", "prompt": "hi", "max_tokens": 2, "guided_regex": "\\ud800"}'),
    ("/api/generate", '{"model": "%s", "prompt": "hi", "stream": false, "options": {"\\ud800": 1}}'),
]


@pytest.mark.parametrize("path, text", SURROGATE_BODIES)
def test_a_lone_surrogate_anywhere_in_the_body_is_400(client, tiny, path, text):
    message = error_message(post_raw(client, path, text.replace("%s", model_name(tiny[1]))))
    assert "Unicode" in message and "surrogate" in message, message


def test_a_paired_surrogate_escape_is_a_character_and_served(client, tiny):
    r = post_raw(client, "/api/generate", '{"model": "%s", "prompt": "\\ud83d\\ude00 hi", "stream": false, '
                                          '"options": {"num_predict": 2}}' % model_name(tiny[1]))
    assert r.status_code == 200, r.text


@pytest.fixture
def served_store(store):
    server, host = start_server("tiny-a", kv_size=2048)
    assert host.wait_ready(30)
    yield server
    server.stop()


@pytest.mark.parametrize("body", [
    '{"model": "x", "from": "tiny-a", "system": "\\ud800", "stream": false}',
    '{"model": "x", "from": "tiny-a", "messages": [{"role": "user", "content": "\\udfff"}], "stream": false}',
    '{"model": "x", "modelfile": "FROM tiny-a\\nSYSTEM \\"\\\\ud800\\"", "stream": false}',
])
def test_create_refuses_a_lone_surrogate_and_stores_nothing(served_store, body):
    with httpx.Client(base_url=served_store.url, timeout=30) as c:
        assert "Unicode" in error_message(post_raw(c, "/api/create", body))
        assert "x" not in {m["name"].split(":")[0] for m in c.get("/api/tags").json()["models"]}
        assert c.post("/api/show", json={"model": "x"}).status_code == 404
        # The same request with a real character is stored and served.
        ok = body.replace("\\\\ud800", "\\u00e9").replace("\\ud800", "\\u00e9").replace("\\udfff", "\\u00e9")
        assert post_raw(c, "/api/create", ok).status_code == 200
        assert c.post("/api/show", json={"model": "x"}).status_code == 200
        r = c.post("/api/generate", json={"model": "x", "prompt": "hi", "stream": False,
                                          "options": {"num_predict": 2}})
        assert r.status_code == 200, r.text
        assert c.request("DELETE", "/api/delete", json={"model": "x"}).status_code == 200
