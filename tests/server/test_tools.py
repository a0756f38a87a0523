"""Tool calling: parsing calls out of text, the default prompt format, and the APIs on the tiny
model (where `tool_choice` required / named, or an Ollama `format`, makes the call certain)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server_helpers import model_name, start_server, wait_idle
from tiny_model import TinyLlamaSpec, write_tiny_llama
from tokenmill.server.errors import APIError
from tokenmill.server.tools import ToolUse, parse_tool_use, prepare_messages
from tokenmill.tokenizer import ChatTemplate

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                                           "unit": {"enum": ["C", "F"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
USE = parse_tool_use({"tools": [WEATHER, TIME]})


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', None, [("get_time", {"zone": "UTC"})]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
     '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>', "Let me check.",
     [("get_weather", {"city": "Oslo", "unit": "C"}), ("get_time", {"zone": "CET"})]),
    ('{"name": "get_time", "arguments": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),
    ('```json\n{"name": "get_time", "parameters": {"zone": "UTC"}}\n```', None, [("get_time", {"zone": "UTC"})]),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
    ('{"name": "launch_rocket", "arguments": {}}', '{"name": "launch_rocket", "arguments": {}}', []),
    ('The weather is fine.', 'The weather is fine.', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
])
def test_calls_are_parsed_out_of_the_text(text, content, calls):
    got_content, got = USE.extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("body, message", [
    ({"tools": {"a": 1}}, "tools must be a list"),
    ({"tools": [{"type": "function"}]}, "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name must be a non-empty string"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
])
def test_bad_tools_are_400(body, message):
    with pytest.raises(APIError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_tool_use(body)


def test_default_format_lists_the_tools_and_writes_calls_and_results_back(tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "-3 C, snow"}]
    out, tools = prepare_messages(tiny_tokenizer, messages, USE)
    assert tools is None  # the tiny model's ChatML template knows nothing of tools
    assert out[0]["content"].startswith("Be brief.\n\nYou can call") and '"name": "get_time"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>'
    assert out[3] == {"role": "user", "content": '<tool_response name="get_weather">\n-3 C, snow\n</tool_response>'}


def test_a_template_with_tools_gets_them_and_the_arguments_as_objects(tiny_tokenizer, monkeypatch):
    source = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
              "{% for c in m.tool_calls or [] %}<{{ c.function.arguments.city }}>{% endfor %}{% endfor %}")
    monkeypatch.setattr(tiny_tokenizer, "chat_template", ChatTemplate(source))
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    out, tools = prepare_messages(tiny_tokenizer, messages, USE)
    assert tiny_tokenizer.chat_template.render(out, tools=tools, add_generation_prompt=False) == \
        "[get_weather][get_time]<Oslo>"


@pytest.fixture(scope="module")
def long_tiny_server(tmp_path_factory):
    """A tiny model with room for the tool listing (its tokens are about one byte each)."""
    path = write_tiny_llama(tmp_path_factory.mktemp("tools") / "tiny-1k.gguf", TinyLlamaSpec(context_length=1024))
    server, host = start_server(str(path))
    assert host.wait_ready(60), host.error
    yield server, host
    server.stop()


@pytest.fixture
def tiny(long_tiny_server):
    """Overrides conftest's `tiny`, so its `client` talks to this server."""
    server, host = long_tiny_server
    yield server.url, host
    wait_idle(host)


@pytest.fixture
def oai(tiny):
    with openai.OpenAI(base_url=f"{tiny[0]}/v1", api_key="unused", max_retries=0) as c:
        yield c


def check_call(call, name: str | None = None) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_openai_tool_choice_required_and_named_always_call(oai, tiny):
    name = model_name(tiny[1])
    ask = [{"role": "user", "content": "weather?"}]
    r = oai.chat.completions.create(model=name, messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                    max_tokens=120, temperature=1.0, seed=2, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])
    r = oai.chat.completions.create(model=name, messages=ask, tools=[WEATHER, TIME], max_tokens=120,
                                    tool_choice={"type": "function", "function": {"name": "get_time"}})
    check_call(r.choices[0].message.tool_calls[0], "get_time")


def test_openai_tool_calls_stream_as_deltas(oai, tiny):
    kwargs = dict(model=model_name(tiny[1]), messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
                  tool_choice="required", max_tokens=120, temperature=1.0, seed=5)
    full = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0
    assert calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == full.choices[0].message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_openai_tool_choice_none_and_conflicts(oai, tiny, client):
    name = model_name(tiny[1])
    r = oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                    tool_choice="none", max_tokens=5, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    bad = client.post("/v1/chat/completions", json={
        "model": name, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
        "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


def test_ollama_tools_come_back_as_tool_calls_with_object_arguments(client, tiny):
    # Ollama has no tool_choice; a format in the shape of a call makes the tiny model write one.
    call_schema = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                                    "arguments": WEATHER["function"]["parameters"]},
                   "required": ["name", "arguments"], "additionalProperties": False}
    body = {"model": model_name(tiny[1]), "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER],
            "format": call_schema, "options": {"temperature": 1.0, "seed": 1, "num_predict": 120}}
    r = client.post("/api/chat", json={**body, "stream": False})
    assert r.status_code == 200, r.text
    message = r.json()["message"]
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(call["function"]["arguments"], PARAMS["get_weather"])
    lines = [json.loads(x) for x in client.post("/api/chat", json=body).text.splitlines()]
    assert len(lines) == 1 and lines[0]["done"] and lines[0]["message"]["tool_calls"] == message["tool_calls"]
