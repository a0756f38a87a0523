"""Structured output from a thinking model: a JSON format (Ollama's `format`, OpenAI's `response_format`)
waits for the reasoning to end, as Ollama's /api/chat and vLLM with a reasoning parser do, and the reasoning
comes back apart; with thinking off (or a client's regex) the grammar holds from the first token as before.
A tiny random Qwen3 whose tags are one token each, as the real one's; the model writes noise, so
logit_bias makes it open and close its block where the order matters."""
from __future__ import annotations

import json

import gguf
import pytest

from qwen_templates import OPEN_THINK_TEMPLATE
from server_helpers import model_name, wait_idle
from tiny_model import TinyLlamaSpec, write_tiny_qwen

SPEC = TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0, context_length=2048, added_tokens=("<think>", "</think>"))
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def seen(qwen3, monkeypatch):
    """The sequences the engine is handed (their prompts and output ids)."""
    engine = qwen3[1].current.engine
    seqs = []
    add = engine.scheduler.add
    monkeypatch.setattr(engine.scheduler, "add", lambda seq: (seqs.append(seq), add(seq))[1])
    yield seqs
    wait_idle(qwen3[1])


def _tags(host) -> tuple[int, int]:
    tok = host.current.engine.tokenizer
    [open_id], [close_id] = (tok.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    return open_id, close_id


def test_openai_json_comes_after_the_models_think_block(qwen3, seen):
    client, host = qwen3
    open_id, close_id = _tags(host)
    body = {"model": model_name(host), "messages": HI, "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
            # The block opened (a grammar holding from the first token forbade it) and closed at once.
            "logit_bias": {str(open_id): 100, str(close_id): 100}}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert seen[-1].output_ids[:2] == [open_id, close_id]
    assert open_id not in seen[-1].prompt_ids and not message.get("reasoning_content")
    assert message["content"].startswith('{"a": ')
    deltas = [json.loads(line[len("data: "):])["choices"] for line in
              client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c[0]["delta"].get("content") or "" for c in deltas if c) == message["content"]
    # with thinking off in the template the grammar holds from the first token: no block can open
    off = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert seen[-1].output_ids[0] != open_id and off.json()["choices"][0]["message"]["content"].startswith('{"a": ')


def test_a_forced_tool_call_comes_after_the_think_block(qwen3, seen):
    client, host = qwen3
    open_id, close_id = _tags(host)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"]}}}
    body = {"model": model_name(host), "messages": HI, "max_tokens": 80, "temperature": 0, "tools": [weather],
            "tool_choice": "required", "logit_bias": {str(open_id): 100, str(close_id): 100}}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert seen[-1].output_ids[0] == open_id and close_id in seen[-1].output_ids
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])


def test_ollama_format_renders_the_template_thinking_unless_think_is_false(qwen3, seen):
    client, host = qwen3
    body = {"model": model_name(host), "messages": HI, "stream": False, "format": SCHEMA,
            "options": {"temperature": 0, "num_predict": 30}}
    tok = host.current.engine.tokenizer
    client.post("/api/chat", json=body).raise_for_status()
    assert "<think>\n\n</think>" not in tok.decode(seen[-1].prompt_ids)  # thinking on: the model's own block
    reply = client.post("/api/chat", json={**body, "think": False}).json()["message"]
    assert tok.decode(seen[-1].prompt_ids).endswith("<think>\n\n</think>\n\n")  # Qwen3's switch, as before
    assert "thinking" not in reply and reply["content"].startswith('{"a": ')


def test_a_block_the_prompt_opened_is_reasoning_until_the_model_closes_it(always_thinks):
    client, host = always_thinks
    open_id, close_id = _tags(host)
    body = {"model": model_name(host), "messages": HI, "stream": False, "format": "json",
            "options": {"temperature": 0, "num_predict": 30}}
    # This model never closes its block unasked: all it writes is reasoning, cut by num_predict.
    endless = client.post("/api/chat", json=body).json()
    assert endless["message"]["thinking"] and endless["message"]["content"] == "" and endless["done_reason"] == "length"
    generate = client.post("/api/generate", json={"model": model_name(host), "prompt": "hi", "stream": False,
                                                   "format": "json", "options": body["options"]}).json()
    assert generate["thinking"] == endless["message"]["thinking"] and generate["response"] == ""
    # Asked to close it at once, its answer is the JSON, the reasoning nothing.
    closes = client.post("/v1/chat/completions", json={"model": model_name(host), "messages": HI, "max_tokens": 30,
                                                       "temperature": 0, "response_format": {"type": "json_object"},
                                                       "logit_bias": {str(close_id): 100}}).json()
    message = closes["choices"][0]["message"]
    assert message["content"].startswith("{") and not message.get("reasoning_content")
    # think false: the grammar holds from the first token, so what it makes is the answer
    off = client.post("/api/chat", json={**body, "think": False}).json()["message"]
    assert "thinking" not in off and off["content"].startswith("{")
    wait_idle(host)


def test_run_in_process_thinks_before_its_json_too(tmp_path, nobody_listens, capsys):
    # As a server's format: the model's reasoning first (this one never ends it), shown apart.
    from tokenmill.cli import main

    path = write_tiny_qwen(tmp_path / "r1.gguf", "qwen3", SPEC, chat_template=OPEN_THINK_TEMPLATE)
    assert main(["run", str(path), "hi", "--max-tokens", "8", "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Thinking...\n") and "...done thinking." in out
    assert main(["run", str(path), "hi", "--max-tokens", "8", "--format", "json", "--think=false"]) == 0
    assert capsys.readouterr().out.lstrip().startswith("{")  # thinking off: the grammar from the first token
