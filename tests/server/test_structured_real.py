"""Structured output on SmolLM2 through the real clients: the `openai` SDK's
`chat.completions.parse(response_format=Model)` and the `ollama` client's `chat(format=schema)`
round-trip into pydantic models."""
from __future__ import annotations

from typing import Annotated, Literal

import ollama
import openai
import pydantic
import pytest

from server_helpers import stream_calls, wait_idle

pytestmark = pytest.mark.real_model


class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=30)
    city: str = pydantic.Field(max_length=20)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["engineer", "teacher", "doctor"]
    address: Address
    hobbies: list[Annotated[str, pydantic.Field(max_length=16)]] = pydantic.Field(max_length=3)


ASK = [{"role": "user", "content": "Invent a person: name, age, job, address and a few hobbies. Answer in JSON."}]


@pytest.fixture
def smol(smol_server):
    server, host = smol_server
    yield server.url
    wait_idle(host, timeout=30)


def test_openai_parse_into_a_pydantic_model(smol):
    with openai.OpenAI(base_url=f"{smol}/v1", api_key="unused", max_retries=0) as c:
        r = c.chat.completions.parse(model="smollm2", messages=ASK, response_format=Person, max_tokens=120,
                                     temperature=0.7, seed=1)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person), choice.message.content
        Person.model_validate_json(choice.message.content)


def test_ollama_chat_with_a_model_schema(smol):
    r = ollama.Client(host=smol).chat(model="smollm2", messages=ASK, format=Person.model_json_schema(),
                                      options={"temperature": 0, "num_predict": 120})
    assert r.done_reason == "stop"
    person = Person.model_validate_json(r.message.content)
    assert person.name


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def test_openai_required_tool_call_streamed_and_not_then_a_second_turn_with_the_result(smol):
    import json

    import jsonschema

    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    kwargs = dict(model="smollm2", messages=ask, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=60,
                  temperature=0)
    with openai.OpenAI(base_url=f"{smol}/v1", api_key="unused", max_retries=0) as c:
        r = c.chat.completions.create(**kwargs)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])

        content, calls, reasons = stream_calls(c.chat.completions.create(**kwargs, stream=True))
        assert reasons == ["tool_calls"] and not content
        assert [(s["name"], json.loads(s["arguments"])) for s in calls] == \
            [("get_weather", json.loads(call.function.arguments))]

        history = ask + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 31, "sky": "sunny"}'}]
        answer = c.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER_TOOL], max_tokens=40,
                                           temperature=0)
    text = answer.choices[0].message.content or ""
    assert answer.choices[0].message.tool_calls is None and text.strip(), answer
    assert "31" in text or "sunny" in text.lower(), text
