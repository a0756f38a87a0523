"""Chats with a tiny random Gemma 3 through both chat APIs: its file carries no chat template (as real
Gemma GGUFs), so the built-in Gemma one renders, whose turns must alternate user/model. A system
message goes into the first user turn, tool results are written back as user turns, and a run of them
(the answers to parallel calls) is one turn, not several in a row that the template would reject."""
from __future__ import annotations

import json

import gguf
import httpx
import pytest

from server_helpers import model_name, start_server, wait_idle
from tiny_model import TinyGemma3Spec, write_tiny_gemma3
from tiny_spm import tiny_spm_metadata

WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    # Context for the tool listing: the tiny vocabulary spells most text a byte per token.
    spec = TinyGemma3Spec(weight_type=gguf.GGMLQuantizationType.Q8_0, context_length=1024)
    path = write_tiny_gemma3(tmp_path_factory.mktemp("gemma3-chat") / "tiny-gemma3.gguf", tiny_spm_metadata(), spec)
    server, host = start_server(str(path), dtype="auto")
    assert host.wait_ready(60), host.error
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client, host
    server.stop()


@pytest.fixture
def prompts(gemma, monkeypatch):
    """The text of every prompt the engine is handed, decoded from its ids."""
    host = gemma[1]
    engine = host.current.engine
    seen: list[str] = []
    add = engine.scheduler.add
    monkeypatch.setattr(engine.scheduler, "add", lambda seq: (seen.append(engine.tokenizer.decode(seq.prompt_ids)),
                                                              add(seq))[1])
    yield seen
    wait_idle(host)


def post(gemma, api: str, messages: list[dict], **body):
    client, host = gemma
    if api == "openai":
        return client.post("/v1/chat/completions", json={"model": model_name(host), "messages": messages,
                                                         "max_tokens": 1, **body})
    return client.post("/api/chat", json={"model": model_name(host), "messages": messages, "stream": False,
                                          "options": {"num_predict": 1}, **body})


def calls(api: str, *cities: str) -> list[dict]:
    if api == "openai":
        return [{"id": f"call_{c}", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}} for c in cities]
    return [{"function": {"name": "get_weather", "arguments": {"city": c}}} for c in cities]


@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_the_system_message_opens_the_first_user_turn(gemma, prompts, api):
    r = post(gemma, api, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}])
    assert r.status_code == 200, r.text
    assert prompts == ["<bos><start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\n"]


@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_the_answers_to_parallel_calls_are_one_user_turn(gemma, prompts, api):
    messages = [{"role": "user", "content": "Weather in Oslo and Rome?"},
                {"role": "assistant", "content": "", "tool_calls": calls(api, "Oslo", "Rome")},
                {"role": "tool", "content": "-3 C", **({"tool_call_id": "call_Oslo"} if api == "openai" else {})},
                {"role": "tool", "content": "18 C", **({"tool_call_id": "call_Rome"} if api == "openai" else {})}]
    r = post(gemma, api, messages, tools=[WEATHER])
    assert r.status_code == 200, r.text
    turns = prompts[0].split("<start_of_turn>")
    assert turns[-2] == "user\n<tool_response>\n-3 C\n</tool_response>\n<tool_response>\n18 C\n</tool_response><end_of_turn>\n"
    assert turns[-1] == "model\n"
    assert [t.split("\n", 1)[0] for t in turns[1:]] == ["user", "model", "user", "model"]


@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_two_user_turns_in_a_row_are_a_400_naming_the_messages(gemma, api):
    r = post(gemma, api, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    text = error["message"] if api == "openai" else error
    assert "Conversation roles must alternate" in text, text
    if api == "openai":
        assert error["param"] == "messages"
