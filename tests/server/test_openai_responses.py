"""/v1/responses (OpenAI's Responses API, stateless) through the official `openai` client on the tiny
model: the same tokens as the chat endpoint for the same conversation, streamed events in the
order the SDK's stream helper assembles, function tools both ways, structured output, and a 400
naming the Responses field for what it cannot take."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server_helpers import hang_up_mid_stream, model_name, wait_idle

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture
def tiny(long_tiny):
    """conftest's `tiny` on the 1k-context model: room for a tool listing."""
    return long_tiny


def test_text_matches_chat_on_the_same_conversation(oai, tiny):
    name = model_name(tiny[1])
    r = oai.responses.create(model=name, instructions="be brief", input="hello", max_output_tokens=6,
                             temperature=0)
    chat = oai.chat.completions.create(model=name, messages=[{"role": "system", "content": "be brief"},
                                                             {"role": "user", "content": "hello"}],
                                       max_tokens=6, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == name
    assert r.output_text == chat.choices[0].message.content
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens") == cut


def test_message_items_and_content_parts_are_the_chat_messages(oai, tiny):
    name = model_name(tiny[1])
    items = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "input_text", "text": "hel"}, {"type": "input_text", "text": "lo"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
             {"role": "user", "content": "again"}]
    r = oai.responses.create(model=name, input=items, max_output_tokens=5, temperature=0)
    chat = oai.chat.completions.create(model=name, max_tokens=5, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_events_assemble_to_the_same_response(oai, tiny):
    kwargs = dict(model=model_name(tiny[1]), input="hello", max_output_tokens=8, temperature=0)
    full = oai.responses.create(**kwargs)
    events = list(oai.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-1].response.output_text
    assert events[-1].response.status == full.status
    assert events[-1].response.usage.output_tokens == full.usage.output_tokens
    with oai.responses.stream(**kwargs) as stream:  # the SDK's helper, which rebuilds the response from the events
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == full.output_text


def test_logprobs_come_with_the_output_text(oai, tiny):
    r = oai.responses.create(model=model_name(tiny[1]), input="hi", max_output_tokens=3, temperature=0, top_logprobs=2)
    entries = r.output[0].content[0].logprobs
    assert len(entries) == r.usage.output_tokens
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)


def test_function_tools_call_and_take_their_output(oai, tiny):
    name = model_name(tiny[1])
    r = oai.responses.create(model=name, input="weather in Paris?", tools=[WEATHER], tool_choice="required",
                             max_output_tokens=80, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    events = list(oai.responses.create(model=name, input="weather in Paris?", tools=[WEATHER],
                                       tool_choice="required", max_output_tokens=80, temperature=0, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == calls[0].arguments
    # The call and its output sent back as input, as an agent loop does: the model answers in text.
    follow = oai.responses.create(model=name, tools=[WEATHER], max_output_tokens=5, temperature=0, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > r.usage.input_tokens


def test_json_schema_format_constrains_the_text(oai, tiny):
    r = oai.responses.create(model=model_name(tiny[1]), input="a person", temperature=0, max_output_tokens=60,
                             text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(r.output_text), PERSON)


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "file_search_call"}]}, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"metadata": "x"}, "metadata"),
    ({"include": 5}, "include"),
])
def test_what_it_cannot_take_is_a_400_naming_the_field(tiny, extra, param):
    body = {"model": model_name(tiny[1]), "input": "hi", **extra}
    r = httpx.post(f"{tiny[0]}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_prompt_longer_than_the_context_is_a_400(tiny):
    r = httpx.post(f"{tiny[0]}/v1/responses", json={"model": model_name(tiny[1]), "input": "hello " * 2000,
                                                    "stream": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input"


def test_a_client_gone_mid_stream_aborts_and_frees_its_blocks(tiny):
    url, host = tiny
    before = host.current.engine.stats.finished.get("abort", 0)
    body = {"model": model_name(host), "input": "hello", "max_output_tokens": 300, "temperature": 0, "stream": True}
    hang_up_mid_stream(url, "/v1/responses", body, "response.output_text.delta", host)
    wait_idle(host)
    assert host.current.engine.stats.finished.get("abort", 0) == before + 1
