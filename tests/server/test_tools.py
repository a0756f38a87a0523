"""Tool calling: parsing calls out of text, the default prompt format, and the APIs on the tiny
model (where `tool_choice` required / named, or an Ollama `format`, makes the call certain)."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server_helpers import model_name, stream_calls
from tokenmill.server.chat import normalize_messages
from tokenmill.server.errors import APIError
from tokenmill.server.tool_stream import ToolCallStream
from tokenmill.server.tools import parse_tool_use, prepare_messages
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


CASES = [
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
    ('[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"arguments": {"city": "Oslo", "unit": "F"},'
     ' "name": "get_weather"}]', None, [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "F"})]),
    ('a <b> <tool_call>{"name": "nope"}</tool_call>', 'a <b> <tool_call>{"name": "nope"}</tool_call>', []),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_calls_are_parsed_out_of_the_text(text, content, calls):
    got_content, got = USE.extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


def streamed(parser: ToolCallStream, chunks: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    """(content, [(name, raw arguments)], pieces) as a client would assemble them from the deltas."""
    pieces = [p for c in chunks for p in parser.feed(c)] + parser.finish()
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if p.content is None:
            if p.name is not None:
                assert p.index not in calls and p.call_id.startswith("call_")
                calls[p.index] = [p.name, ""]
            calls[p.index][1] += p.arguments
    return "".join(p.content for p in pieces if p.content is not None), [tuple(c) for c in calls.values()], pieces


@pytest.mark.parametrize("text, content, calls", CASES)
@pytest.mark.parametrize("cut", ["whole", "chars", "chunks"])
def test_the_stream_parser_finds_the_same_calls_piece_by_piece(text, content, calls, cut):
    chunks = {"whole": [text], "chars": list(text), "chunks": [text[i:i + 7] for i in range(0, len(text), 7)]}[cut]
    got_content, got, pieces = streamed(USE.stream(), chunks)
    assert [(name, json.loads(args)) for name, args in got] == calls
    # Calls take their text out of the content; text that is no call is all sent, none of it lost.
    assert got_content.strip() == (content or "").strip()
    if cut == "chars" and calls:  # arguments go out as they are written, not at the end
        assert sum(1 for p in pieces if p.content is None and p.name is None) > 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(['<tool_call>', '</tool_call>', '<tool', '{', '}', '[', ']', '"', '\\', ',', ':', ' ',
                                 '"name"', '"get_time"', '"arguments"', '{"zone": "UTC"}', '```json\n', '```', 'x',
                                 '\n', '"nope"']), max_size=30),
       st.integers(1, 9))
def test_the_stream_parser_never_fails_and_loses_no_text_that_is_not_a_call(parts, step):
    text = "".join(parts)
    content, calls, _ = streamed(USE.stream(), [text[i:i + step] for i in range(0, len(text), step)])
    assert (content, calls) == streamed(USE.stream(), [text])[:2]  # however the text is cut
    if not calls:
        assert content == text
    assert all(name == "get_time" for name, _ in calls)


def test_without_parallel_calls_only_the_first_is_kept():
    text = CASES[1][0]
    one = parse_tool_use({"tools": [WEATHER, TIME], "parallel_tool_calls": False})
    assert [c.name for c in one.extract(text)[1]] == ["get_weather"]
    assert [name for name, _ in streamed(one.stream(), list(text))[1]] == ["get_weather"]
    assert len(USE.extract(text)[1]) == 2


def test_required_allows_a_list_of_calls_only_when_parallel():
    spec, _ = parse_tool_use({"tools": [WEATHER, TIME], "tool_choice": "required"}).constraint()
    assert spec.value["type"] == "array" and spec.value["minItems"] == 1
    spec, _ = parse_tool_use({"tools": [WEATHER, TIME], "tool_choice": "required",
                              "parallel_tool_calls": False}).constraint()
    assert "anyOf" in spec.value
    with pytest.raises(APIError, match="parallel_tool_calls must be true or false"):
        parse_tool_use({"tools": [WEATHER], "parallel_tool_calls": "yes"})


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
    out, tools = prepare_messages(tiny_tokenizer, normalize_messages(messages), USE)
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
    out, tools = prepare_messages(tiny_tokenizer, normalize_messages(messages), USE)
    assert tiny_tokenizer.chat_template.render(out, tools=tools, add_generation_prompt=False) == \
        "[get_weather][get_time]<Oslo>"


@pytest.fixture
def tiny(long_tiny):
    """conftest's `tiny` on the 1k-context model: room for a tool listing."""
    return long_tiny


def check_call(call, name: str | None = None) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_openai_tool_choice_required_and_named_always_call(oai, tiny):
    name = model_name(tiny[1])
    ask = [{"role": "user", "content": "weather?"}]
    r = oai.chat.completions.create(model=name, messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                    max_tokens=120, temperature=1.0, seed=2, n=3, parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])
    r = oai.chat.completions.create(model=name, messages=ask, tools=[WEATHER, TIME], max_tokens=120,
                                    tool_choice={"type": "function", "function": {"name": "get_time"}})
    check_call(r.choices[0].message.tool_calls[0], "get_time")


@pytest.mark.parametrize("parallel", [False, True])
def test_openai_required_tool_calls_stream_as_deltas(oai, tiny, parallel):
    kwargs = dict(model=model_name(tiny[1]), messages=[{"role": "user", "content": "weather?"}],
                  tools=[WEATHER, TIME], tool_choice="required", max_tokens=400, temperature=1.0, seed=5,
                  parallel_tool_calls=parallel)
    full = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    content, calls, reasons = stream_calls(chunks)
    assert reasons == ["tool_calls"] == [full.choices[0].finish_reason] and not content
    assert (len(calls) == 1) if not parallel else (len(calls) >= 1)
    # Same seed, same text: the streamed calls are the non-streamed ones.
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in full.choices[0].message.tool_calls]
    for c in full.choices[0].message.tool_calls:
        check_call(c)
    # The arguments arrive in several pieces as they are generated, not in one delta at the end.
    pieces = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or [] if tc.id is None]
    assert len(pieces) > len(calls)


@pytest.mark.parametrize("max_tokens", [3, 20, 30, 40])
@pytest.mark.parametrize("choice, parallel", [("required", False), ("required", True),
                                              ({"type": "function", "function": {"name": "get_weather"}}, False)])
def test_a_call_cut_by_max_tokens_reads_the_same_streamed_or_not(oai, tiny, max_tokens, choice, parallel):
    # Cut before the name is written the text is content; after, a call with its arguments as far as
    # they got (as OpenAI answers), in both forms.
    kwargs = dict(model=model_name(tiny[1]), messages=[{"role": "user", "content": "weather?"}],
                  tools=[WEATHER, TIME], tool_choice=choice, max_tokens=max_tokens, temperature=1.0, seed=5,
                  parallel_tool_calls=parallel)
    full = oai.chat.completions.create(**kwargs).choices[0]
    content, calls, reasons = stream_calls(oai.chat.completions.create(**kwargs, stream=True))
    assert reasons == [full.finish_reason] == ["length"]
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in full.message.tool_calls or []]
    assert (content or None) == full.message.content
    if max_tokens >= 30:  # past the name on this model and seed
        assert calls and all(c.id.startswith("call_") for c in full.message.tool_calls)


def test_openai_parallel_required_calls_may_be_several(oai, tiny):
    # Sampled lists of calls: over a few seeds some answer has more than one call, all valid.
    counts = []
    for seed in range(6):
        r = oai.chat.completions.create(model=model_name(tiny[1]), messages=[{"role": "user", "content": "go"}],
                                        tools=[WEATHER, TIME], tool_choice="required", max_tokens=400,
                                        temperature=1.0, seed=seed)
        if r.choices[0].finish_reason != "tool_calls":
            continue
        for c in r.choices[0].message.tool_calls:
            check_call(c)
        counts.append(len(r.choices[0].message.tool_calls))
    assert counts and max(counts) > 1, counts


def test_openai_auto_streams_content_then_a_call(oai, tiny):
    # The tiny model writes noise; a regex makes it write text and then a call, as a real model would.
    regex = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    kwargs = dict(model=model_name(tiny[1]), messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, TIME],
                  max_tokens=200, temperature=1.0, seed=3, extra_body={"guided_regex": regex})
    content, calls, reasons = stream_calls(oai.chat.completions.create(**kwargs, stream=True))
    assert content == "Sure. " and reasons == ["tool_calls"]
    [call] = calls
    assert call["name"] == "get_time" and json.loads(call["arguments"])["zone"] in ("UTC", "CET")
    full = oai.chat.completions.create(**kwargs).choices[0]
    assert full.message.content == "Sure." and full.finish_reason == "tool_calls"
    assert json.loads(full.message.tool_calls[0].function.arguments) == json.loads(call["arguments"])


def test_openai_auto_without_a_call_streams_plain_content(oai, tiny):
    kwargs = dict(model=model_name(tiny[1]), messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                  max_tokens=30, temperature=0)
    full = oai.chat.completions.create(**kwargs).choices[0]
    content, calls, reasons = stream_calls(oai.chat.completions.create(**kwargs, stream=True))
    assert full.message.tool_calls is None and not calls
    assert content == full.message.content and reasons == [full.finish_reason]


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
    # As Ollama 0.8+ streams: the call in a chunk of its own once complete, the final chunk without it.
    streamed = [c for line in lines if not line["done"] for c in line["message"].get("tool_calls", [])]
    assert streamed == message["tool_calls"]
    assert lines[-1]["done"] and "tool_calls" not in lines[-1]["message"]
    assert "".join(line["message"]["content"] for line in lines) == message["content"] == ""


def test_ollama_streams_text_with_tools_on_and_a_cut_call_as_text(client, tiny):
    name = model_name(tiny[1])
    body = {"model": name, "messages": [{"role": "user", "content": "hello"}], "tools": [WEATHER],
            "options": {"temperature": 0, "num_predict": 40}}
    whole = client.post("/api/chat", json={**body, "stream": False}).json()["message"]
    lines = [json.loads(x) for x in client.post("/api/chat", json=body).text.splitlines()]
    assert "tool_calls" not in whole and len(whole["content"]) > 10  # the tiny model writes text, no call
    assert "".join(line["message"]["content"] for line in lines) == whole["content"]
    assert sum(bool(line["message"]["content"]) for line in lines) > 1  # it came as it was written
    with_lp = [json.loads(x) for x in client.post("/api/chat", json={**body, "logprobs": True}).text.splitlines()]
    assert sum(len(line.get("logprobs") or []) for line in with_lp) == with_lp[-1]["eval_count"]  # one a token
    # A call that num_predict cuts: no call (its arguments are incomplete), its text kept, as without stream.
    call_schema = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                                    "arguments": WEATHER["function"]["parameters"]},
                   "required": ["name", "arguments"], "additionalProperties": False}
    cut = {**body, "format": call_schema, "options": {"temperature": 0, "num_predict": 12}}
    whole = client.post("/api/chat", json={**cut, "stream": False}).json()
    lines = [json.loads(x) for x in client.post("/api/chat", json=cut).text.splitlines()]
    assert whole["done_reason"] == lines[-1]["done_reason"] == "length" and "tool_calls" not in whole["message"]
    assert not any("tool_calls" in line["message"] for line in lines)
    streamed = "".join(line["message"]["content"] for line in lines)
    assert streamed == whole["message"]["content"], (streamed, whole["message"]["content"])  # the same text


# A tree of nodes: recursive through its own $defs ("#/$defs/node") and through "#" (a forest of trees).
NODE = {"type": "object", "properties": {"value": {"enum": [1, 2]},
                                         "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                      "maxItems": 2}},
        "required": ["value"], "additionalProperties": False}
PLANT = {"type": "function", "function": {"name": "plant", "parameters": {
    "$defs": {"node": NODE}, "type": "object", "additionalProperties": False, "required": ["tree"],
    "properties": {"tree": {"$ref": "#/$defs/node"},
                   "more": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}}}}}


def test_a_recursive_parameters_schema_keeps_its_meaning_when_a_call_is_forced(oai, tiny):
    # The call's schema holds the parameters in its own $defs, their refs rewritten to point there:
    # before, "#/$defs/node" did not resolve (a 400) and "#" meant the whole call schema.
    params, finished = PLANT["function"]["parameters"], 0
    for seed in range(3):
        r = oai.chat.completions.create(model=model_name(tiny[1]), messages=[{"role": "user", "content": "plant"}],
                                        tools=[PLANT, TIME], tool_choice={"type": "function",
                                                                          "function": {"name": "plant"}},
                                        max_tokens=200, temperature=1.0, seed=seed)
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            [call] = choice.message.tool_calls
            assert call.function.name == "plant"
            jsonschema.validate(json.loads(call.function.arguments), params)
            finished += 1
    assert finished


def test_a_parameters_schema_with_no_finite_value_is_400_naming_the_tool(client, tiny):
    endless = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}
    r = client.post("/v1/chat/completions", json={
        "model": model_name(tiny[1]), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "tools": [TIME, endless], "tool_choice": "required"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools[1].function.parameters" and "recursive without a base case" in err["message"]
