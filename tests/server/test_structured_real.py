"""Structured output on SmolLM2 through the real clients: the `openai` SDK's
`chat.completions.parse(response_format=Model)` and the `ollama` client's `chat(format=schema)`
round-trip into pydantic models."""
from __future__ import annotations

from typing import Annotated, Literal

import ollama
import openai
import pydantic
import pytest

from server_helpers import wait_idle

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
