"""Past tool calls and tool results in chat messages, through both chat APIs on the tiny model: a
malformed one is a 400 naming the part to fix (never a 500, never an empty call quietly put in the
prompt); a well-formed one, in either API's shape, is written back into the prompt."""
from __future__ import annotations

import pytest

from server_helpers import model_name

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
WRITTEN_BACK = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def conversation(tool_calls, **tool_message) -> list[dict]:
    out = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": tool_calls}]
    if tool_message:
        out.append({"role": "tool", "content": "-3 C", **tool_message})
    return out + [{"role": "user", "content": "x"}]


def post(client, tiny, api: str, messages: list[dict]):
    if api == "openai":
        return client.post("/v1/chat/completions", json={"model": model_name(tiny[1]), "messages": messages,
                                                         "max_tokens": 1})
    return client.post("/api/chat", json={"model": model_name(tiny[1]), "messages": messages, "stream": False,
                                          "options": {"num_predict": 1}})


def error_of(r, api: str) -> tuple[str, str | None]:
    """(message, param) of an error response; Ollama's body has no param."""
    body = r.json()
    return (body["error"]["message"], body["error"]["param"]) if api == "openai" else (body["error"], None)


BAD_CALLS = [
    ([{"function": None}], "messages[1].tool_calls[0].function", "must be an object with name and arguments"),
    ([{"function": "str"}], "messages[1].tool_calls[0].function", "got string"),
    ([{"function": [1]}], "messages[1].tool_calls[0].function", "got array"),
    ([{"name": "get_weather", "arguments": {}}], "messages[1].tool_calls[0].function", "got null"),
    (5, "messages[1].tool_calls", "must be a list of calls, got number"),
    (True, "messages[1].tool_calls", "got boolean"),
    ("x", "messages[1].tool_calls", "got string"),
    ({"function": {"name": "f"}}, "messages[1].tool_calls", "got object"),
    ([{"function": {"name": "f", "arguments": {}}}, 7], "messages[1].tool_calls[1]", "must be an object"),
    ([{"function": {"arguments": {}}}], "messages[1].tool_calls[0].function.name", "must be a string, got null"),
    ([{"function": {"name": 3}}], "messages[1].tool_calls[0].function.name", "got number"),
    ([{"function": {"name": "f", "arguments": 5}}], "messages[1].tool_calls[0].function.arguments", "got number"),
    ([{"function": {"name": "f", "arguments": [1]}}], "messages[1].tool_calls[0].function.arguments", "got array"),
    ([{"type": "custom", "function": {"name": "f"}}], "messages[1].tool_calls[0].type", 'must be "function"'),
    ([{"id": 1, "function": {"name": "f"}}], "messages[1].tool_calls[0].id", "must be a string"),
]


@pytest.mark.parametrize("api", ["openai", "ollama"])
@pytest.mark.parametrize("tool_calls, param, message", BAD_CALLS)
def test_a_malformed_past_tool_call_is_400_naming_it(client, tiny, api, tool_calls, param, message):
    r = post(client, tiny, api, conversation(tool_calls))
    assert r.status_code == 400, r.text
    text, got_param = error_of(r, api)
    assert text.startswith(param) and message in text, text
    assert got_param in (param, None)


@pytest.mark.parametrize("arguments, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object, got array"),
    ('"Oslo"', "must hold a JSON object, got string"),
    ("[" * 300 + "]" * 300, "nested more than"),
])
def test_openai_arguments_text_must_be_a_json_object(client, tiny, arguments, message):
    call = {**CALL, "function": {"name": "get_weather", "arguments": arguments}}
    r = post(client, tiny, "openai", conversation([call]))
    assert r.status_code == 400, r.text
    text, param = error_of(r, "openai")
    assert param == "messages[1].tool_calls[0].function.arguments" and message in text, text


def test_ollama_takes_arguments_as_an_object_only(client, tiny):
    r = post(client, tiny, "ollama", conversation([CALL]))
    assert r.status_code == 400, r.text
    assert "messages[1].tool_calls[0].function.arguments must be an object, got string" in r.json()["error"]


@pytest.mark.parametrize("api", ["openai", "ollama"])
@pytest.mark.parametrize("field, value", [("tool_call_id", 5), ("name", ["get_weather"]), ("tool_name", {})])
def test_a_tool_result_names_its_call_with_strings(client, tiny, api, field, value):
    r = post(client, tiny, api, conversation([{"function": {"name": "get_weather", "arguments": {}}}],
                                             **{field: value}))
    assert r.status_code == 400, r.text
    text, param = error_of(r, api)
    assert text.startswith(f"messages[2].{field} must be a string"), text
    assert param in (f"messages[2].{field}", None)


@pytest.mark.parametrize("api, call", [
    ("openai", CALL),
    ("openai", {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}),
    ("ollama", {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}),
    ("ollama", {"function": {"index": 0, "name": "get_weather", "arguments": {"city": "Oslo"}}}),
])
def test_a_well_formed_past_call_is_written_back_into_the_prompt(client, tiny, added, api, call):
    r = post(client, tiny, api, conversation([call], tool_call_id="call_1", name="get_weather"))
    assert r.status_code == 200, r.text
    prompt = tiny[1].current.engine.tokenizer.decode(added[-1].prompt_ids)
    assert WRITTEN_BACK in prompt and '<tool_response name="get_weather">\n-3 C\n</tool_response>' in prompt


@pytest.mark.parametrize("tool_calls", [None, []])
def test_no_calls_is_no_calls(client, tiny, added, tool_calls):
    r = post(client, tiny, "openai", conversation(tool_calls))
    assert r.status_code == 200, r.text
    assert "<tool_call>" not in tiny[1].current.engine.tokenizer.decode(added[-1].prompt_ids)


def test_openai_arguments_may_be_empty_text_for_a_call_without_arguments(client, tiny, added):
    r = post(client, tiny, "openai", conversation([{"function": {"name": "now", "arguments": ""}}]))
    assert r.status_code == 200, r.text
    prompt = tiny[1].current.engine.tokenizer.decode(added[-1].prompt_ids)
    assert '<tool_call>{"name": "now", "arguments": {}}</tool_call>' in prompt
