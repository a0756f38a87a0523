"""/v1/messages (Anthropic's Messages API) through the official `anthropic` client on the tiny model:
the same tokens as the chat endpoint for the same conversation, streamed events that the SDK's
stream helper assembles into the same message, tools both ways, a final assistant message
continued, stop sequences, count_tokens, x-api-key, and Anthropic's error shape for what it cannot
take."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server_helpers import hang_up_mid_stream, model_name, start_server, wait_idle

anthropic = pytest.importorskip("anthropic")

# Greedy: Anthropic's SDK no longer has a temperature argument (the server still takes the field).
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture
def tiny(long_tiny):
    """conftest's `tiny` on the 1k-context model: room for a tool listing."""
    return long_tiny


@pytest.fixture
def ant(tiny):
    """The official `anthropic` client, unchanged, on the tiny server."""
    with anthropic.Anthropic(base_url=tiny[0], api_key="unused", max_retries=0) as c:
        yield c


def _chat(oai, name: str, messages: list[dict], **kw):
    return oai.chat.completions.create(model=name, messages=messages, temperature=0, **kw)


def test_text_matches_chat_on_the_same_conversation(ant, oai, tiny):
    name = model_name(tiny[1])
    m = ant.messages.create(model=name, system="be brief", max_tokens=6, **GREEDY,
                            messages=[{"role": "user", "content": "hello"}])
    chat = _chat(oai, name, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
                 max_tokens=6)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == name
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert m.stop_sequence is None
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens


def test_blocks_system_list_and_turns_are_the_chat_messages(ant, oai, tiny):
    name = model_name(tiny[1])
    m = ant.messages.create(model=name, max_tokens=5, **GREEDY,
                            system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
                            messages=[{"role": "user", "content": [{"type": "text", "text": "hel"},
                                                                   {"type": "text", "text": "lo"}]},
                                      {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
                                      {"role": "user", "content": "again"}])
    chat = _chat(oai, name, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                             {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}],
                 max_tokens=5)
    assert m.content[0].text == chat.choices[0].message.content


def test_a_final_assistant_message_is_continued(ant, oai, tiny):
    name = model_name(tiny[1])
    turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Sure, here"}]
    m = ant.messages.create(model=name, max_tokens=5, **GREEDY, messages=turns)
    chat = _chat(oai, name, turns, max_tokens=5, extra_body={"continue_final_message": True,
                                                             "add_generation_prompt": False})
    assert m.content[0].text == chat.choices[0].message.content


def test_stream_events_assemble_to_the_same_message(ant, tiny):
    kwargs = dict(model=model_name(tiny[1]), max_tokens=8, **GREEDY, messages=[{"role": "user", "content": "hi"}])
    full = ant.messages.create(**kwargs)
    events = list(ant.messages.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == full.content[0].text
    assert events[-2].delta.stop_reason == full.stop_reason
    assert events[-2].usage.output_tokens == full.usage.output_tokens
    with ant.messages.stream(**kwargs) as stream:  # the SDK's helper, which rebuilds the message from the events
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        full.usage.input_tokens + full.usage.cache_read_input_tokens


def test_stop_sequences_name_the_one_that_ended_it(ant, tiny):
    kwargs = dict(model=model_name(tiny[1]), max_tokens=30, **GREEDY, messages=[{"role": "user", "content": "hi"}])
    text = ant.messages.create(**kwargs).content[0].text
    assert len(text) >= 4, text  # the tiny model writes something to cut
    stop = text[2:4]
    cut = ant.messages.create(**kwargs, stop_sequences=["never-written-here", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    with ant.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop,
                                                                               cut.content[0].text)


def test_tools_call_and_take_their_result(ant, tiny):
    name = model_name(tiny[1])
    kwargs = dict(model=name, max_tokens=80, **GREEDY, tools=[WEATHER],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  messages=[{"role": "user", "content": "weather in Paris?"}])
    m = ant.messages.create(**kwargs)
    calls = [b for b in m.content if b.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and calls[0].id and m.stop_reason == "tool_use"
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    with ant.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(c.name, c.input) for c in calls]
    assert final.stop_reason == "tool_use"
    # The call and its result sent back, as an agent loop does: the model answers in text.
    follow = ant.messages.create(model=name, max_tokens=5, **GREEDY, tools=[WEATHER], messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": calls[0].id, "name": "get_weather",
                                           "input": calls[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny, 21 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > \
        m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_a_named_tool_choice_calls_that_tool(ant, tiny):
    m = ant.messages.create(model=model_name(tiny[1]), max_tokens=80, **GREEDY, tools=[WEATHER],
                            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                            messages=[{"role": "user", "content": "hi"}])
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"


def test_output_config_format_constrains_the_text(ant, tiny):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    m = ant.messages.create(model=model_name(tiny[1]), max_tokens=60, **GREEDY,
                            output_config={"format": {"type": "json_schema", "schema": person}},
                            messages=[{"role": "user", "content": "a person"}])
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), person)


def test_count_tokens_is_the_prompt_the_message_computes(ant, tiny):
    name = model_name(tiny[1])
    turns = [{"role": "user", "content": "weather in Paris?"}]
    counted = ant.messages.count_tokens(model=name, system="be brief", tools=[WEATHER], messages=turns)
    m = ant.messages.create(model=name, system="be brief", tools=[WEATHER], messages=turns, max_tokens=1)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert ant.messages.count_tokens(model=name, messages=turns).input_tokens < counted.input_tokens


@pytest.mark.parametrize("extra, where", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": 5}]}, "tools[0].input_schema"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"temperature": -1}, "temperature"),
    ({"output_config": {"format": {"type": "json_schema", "schema": 5}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
])
def test_what_it_cannot_take_is_a_400_in_anthropic_shape(tiny, extra, where):
    body = {"model": model_name(tiny[1]), "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    body.update(extra)
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{tiny[0]}/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert where in err["error"]["message"], err


def test_sdk_errors_carry_status_and_message(ant, tiny):
    with pytest.raises(anthropic.NotFoundError) as info:
        ant.messages.create(model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        ant.messages.create(model=model_name(tiny[1]), max_tokens=5,
                            messages=[{"role": "user", "content": "hi " * 2000}])
    assert "context" in info.value.message


def test_a_client_gone_mid_stream_aborts_and_frees_its_blocks(tiny):
    url, host = tiny
    before = host.current.engine.stats.finished.get("abort", 0)
    body = {"model": model_name(host), "max_tokens": 300, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "hello"}]}
    hang_up_mid_stream(url, "/v1/messages", body, "content_block_delta", host)
    wait_idle(host)
    assert host.current.engine.stats.finished.get("abort", 0) == before + 1


def test_models_list_and_retrieve_in_anthropic_shape(ant, oai, tiny):
    name = model_name(tiny[1])
    listed = list(ant.models.list())
    assert name in [m.id for m in listed] and all(m.type == "model" and m.display_name for m in listed)
    one = ant.models.retrieve(name)
    assert one.id == name and one.created_at.year >= 2020 and one.max_input_tokens == 1024  # loaded: its context
    assert name in [m.id for m in oai.models.list()]  # OpenAI's client, without the header, gets OpenAI's list
    with pytest.raises(anthropic.NotFoundError):
        ant.models.retrieve("no-such-model")


def test_the_api_key_comes_as_x_api_key(tiny_gguf):
    server, host = start_server(str(tiny_gguf), api_key="sekret")
    try:
        assert host.wait_ready(60), host.error
        body = {"model": model_name(host), "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        with anthropic.Anthropic(base_url=server.url, api_key="sekret", max_retries=0) as ant:
            assert ant.messages.create(**body).type == "message"
        with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as ant, \
                pytest.raises(anthropic.AuthenticationError) as info:
            ant.messages.create(**body)
        assert info.value.body["error"]["type"] == "authentication_error"
        # ANTHROPIC_AUTH_TOKEN (what Ollama's docs set for Claude Code) sends the key as a Bearer token.
        with anthropic.Anthropic(base_url=server.url, auth_token="sekret", max_retries=0) as ant:
            assert ant.messages.create(**body).type == "message"
    finally:
        server.stop()
