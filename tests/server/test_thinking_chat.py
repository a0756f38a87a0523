"""A thinking model through the chat APIs: a tiny random Qwen3 with Qwen3's own chat template (the
model opens its think block itself), and one whose template opens the block in the prompt (as
DeepSeek-R1's). Its prompts render as transformers renders the same template; its reasoning comes back
apart from its answer, as Ollama's `thinking` and OpenAI-style `reasoning_content`, streamed or not;
`think: false` / `enable_thinking: false` turn thinking off in the template. The tiny model writes noise,
so a regex (vLLM's guided_regex) makes it write a block and an answer where the text matters."""
from __future__ import annotations

import json

import gguf
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from qwen_templates import OPEN_THINK_TEMPLATE, QWEN3_TEMPLATE
from server_helpers import model_name, wait_idle
from tiny_model import TinyLlamaSpec, write_tiny_qwen

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SPEC = TinyLlamaSpec(weight_type=gguf.GGMLQuantizationType.Q8_0, context_length=2048)


@pytest.fixture
def prompts(qwen3, monkeypatch):
    """The text of every prompt the engine is handed, decoded from its ids."""
    engine = qwen3[1].current.engine
    seen: list[str] = []
    add = engine.scheduler.add
    monkeypatch.setattr(engine.scheduler, "add", lambda seq: (seen.append(engine.tokenizer.decode(seq.prompt_ids)),
                                                              add(seq))[1])
    yield seen
    wait_idle(qwen3[1])


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "reasoning_content": "They want Oslo.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "4 C"},
    {"role": "assistant", "content": "<think>\nIt is cold.\n</think>\n\nIt is 4 C."},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.mark.parametrize("thinking", [None, False])
def test_prompts_render_as_transformers_renders_qwen3s_template(qwen3, prompts, thinking):
    client, host = qwen3
    variables = {} if thinking is None else {"enable_thinking": thinking}
    [expected], _ = render_jinja_template([CONVERSATION], tools=[WEATHER], chat_template=QWEN3_TEMPLATE,
                                          add_generation_prompt=True, **variables)
    r = client.post("/v1/chat/completions", json={"model": model_name(host), "messages": CONVERSATION,
                                                  "tools": [WEATHER], "max_tokens": 1,
                                                  "chat_template_kwargs": variables})
    assert r.status_code == 200, r.text
    ollama = [{**m, "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
              if m.get("tool_calls") else m for m in CONVERSATION]
    r = client.post("/api/chat", json={"model": model_name(host), "messages": ollama, "tools": [WEATHER],
                                       "stream": False, "options": {"num_predict": 1},
                                       **({} if thinking is None else {"think": thinking})})
    assert r.status_code == 200, r.text
    assert prompts == [expected, expected]
    assert expected.endswith("<think>\n\n</think>\n\n" if thinking is False else "<|im_start|>assistant\n")


REGEX = r"<think>\nThe user greets me\. I greet back\.\n</think>\n\nHello there\."


def _stream_deltas(client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(x)["choices"][0]["delta"] for x in lines if x != "[DONE]" and json.loads(x)["choices"]]


def test_openai_reasoning_content_apart_from_the_answer_streamed_or_not(qwen3):
    client, host = qwen3
    body = {"model": model_name(host), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "temperature": 0, "guided_regex": REGEX}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "The user greets me. I greet back."
    assert message["content"] == "Hello there."
    deltas = _stream_deltas(client, body)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert not any("think>" in (d.get("reasoning_content", "") + (d.get("content") or "")) for d in deltas)
    # Streamed as written: reasoning in more than one delta, all of it before the answer.
    kinds = [("r" if d.get("reasoning_content") else "c") for d in deltas if d.get("reasoning_content") or d.get("content")]
    assert kinds.count("r") > 1 and "".join(kinds).startswith("r") and "cr" not in "".join(kinds)


def test_openai_reasoning_then_a_tool_call(qwen3):
    client, host = qwen3
    regex = r'<think>\nOslo\.\n</think>\n\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'
    body = {"model": model_name(host), "messages": [{"role": "user", "content": "Oslo weather?"}],
            "tools": [WEATHER], "max_tokens": 200, "temperature": 0, "guided_regex": regex}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "Oslo."
    [call] = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    deltas = _stream_deltas(client, body)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Oslo."
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "name" in c["function"]] == \
        ["get_weather"]


def test_enable_thinking_false_leaves_the_text_as_written(qwen3):
    client, host = qwen3
    body = {"model": model_name(host), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "temperature": 0, "guided_regex": REGEX, "chat_template_kwargs": {"enable_thinking": False}}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].startswith("<think>")


def test_a_template_that_opens_the_block_makes_the_answer_reasoning_until_it_closes(always_thinks):
    # The tiny model never closes the block: all it writes is reasoning, cut by num_predict.
    client, host = always_thinks
    body = {"model": model_name(host), "messages": [{"role": "user", "content": "hi"}],
            "options": {"temperature": 0, "num_predict": 12}}
    whole = client.post("/api/chat", json={**body, "stream": False}).json()
    assert whole["message"]["content"] == "" and len(whole["message"]["thinking"]) > 0
    lines = [json.loads(x) for x in client.post("/api/chat", json=body).text.splitlines()]
    assert "".join(line["message"].get("thinking", "") for line in lines) == whole["message"]["thinking"]
    assert lines[-1]["done"] and "".join(line["message"]["content"] for line in lines) == ""
    generate = client.post("/api/generate", json={"model": model_name(host), "prompt": "hi", "stream": False,
                                                   "think": "high", "options": {"temperature": 0, "num_predict": 12}})
    assert generate.json()["thinking"] == whole["message"]["thinking"] and generate.json()["response"] == ""
    raw = client.post("/api/generate", json={"model": model_name(host), "prompt": "hi", "raw": True, "stream": False,
                                              "options": {"temperature": 0, "num_predict": 12}}).json()
    assert "thinking" not in raw  # a raw prompt is the client's own: its answer comes back as written
    openai = client.post("/v1/chat/completions", json={"model": model_name(host), "max_tokens": 12, "temperature": 0,
                                                       "messages": body["messages"]}).json()["choices"][0]["message"]
    assert len(openai["reasoning_content"]) > 0 and openai["content"] == ""  # (Ollama's defaults sample otherwise)
    # A JSON format waits for the reasoning (test_thinking_structured.py): this one never ends.
    structured = client.post("/api/chat", json={**body, "stream": False, "format": "json",
                                                "options": {"temperature": 0, "num_predict": 40}}).json()["message"]
    assert structured["thinking"] and structured["content"] == ""


def test_thinking_is_a_capability_and_think_is_checked(qwen3):
    client, host = qwen3
    show = client.post("/api/show", json={"model": model_name(host)}).json()
    assert "thinking" in show["capabilities"]
    bad = client.post("/api/chat", json={"model": model_name(host), "messages": [{"role": "user", "content": "hi"}],
                                         "think": "maximum"})
    assert bad.status_code == 400 and "think" in bad.json()["error"]


def _anthropic_events(client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]


def test_anthropic_thinking_blocks_streamed_or_not(always_thinks):
    client, host = always_thinks
    body = {"model": model_name(host), "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 1024}}
    message = client.post("/v1/messages", json=body).json()
    [thinking] = message["content"]  # the tokens ran out while it thought: no text block
    assert thinking["type"] == "thinking" and len(thinking["thinking"]) > 0 and message["stop_reason"] == "max_tokens"
    events = _anthropic_events(client, body)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking"]
    streamed = "".join(e["delta"]["thinking"] for e in events
                       if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta")
    assert streamed == thinking["thinking"]


def test_anthropic_thinking_disabled_turns_it_off_in_the_template(qwen3, prompts):
    client, host = qwen3
    r = client.post("/v1/messages", json={"model": model_name(host), "max_tokens": 1, "thinking": {"type": "disabled"},
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_responses_reasoning_items_streamed_or_not(always_thinks):
    from openai import OpenAI

    client, host = always_thinks
    oai = OpenAI(base_url=f"{str(client.base_url).rstrip('/')}/v1", api_key="x")
    kwargs = dict(model=model_name(host), input="hi", max_output_tokens=12, temperature=0)
    response = oai.responses.create(**kwargs)
    [reasoning] = response.output  # the tokens ran out while it thought: no message
    assert reasoning.type == "reasoning" and len(reasoning.content[0].text) > 0
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens
    events = list(oai.responses.create(**kwargs, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning"] and final.output[0].content[0].text == deltas


def test_a_reasoning_item_sent_back_is_the_turns_reasoning_in_the_prompt(qwen3, prompts):
    client, host = qwen3
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    r = client.post("/v1/responses", json={"model": model_name(host), "max_output_tokens": 1, "tools": [
        {"type": "function", **WEATHER["function"]}], "input": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "They want Oslo."}]},
        call, {"type": "function_call_output", "call_id": "c1", "output": "4 C"}]})
    assert r.status_code == 200, r.text
    chat = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "reasoning_content": "They want Oslo.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "4 C"}]
    [expected], _ = render_jinja_template([chat], tools=[WEATHER], chat_template=QWEN3_TEMPLATE,
                                          add_generation_prompt=True)
    assert "<think>\nThey want Oslo.\n</think>" in expected and prompts == [expected]


def test_an_anthropic_thinking_block_sent_back_is_the_turns_reasoning_in_the_prompt(qwen3, prompts):
    client, host = qwen3
    r = client.post("/v1/messages", json={"model": model_name(host), "max_tokens": 1, "tools": [
        {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "They want Oslo.", "signature": ""},
                                          {"type": "tool_use", "id": "c1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "4 C"}]}]})
    assert r.status_code == 200, r.text
    assert "<|im_start|>assistant\n<think>\nThey want Oslo.\n</think>\n\n<tool_call>" in prompts[-1]
    bad = client.post("/v1/messages", json={"model": model_name(host), "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]},
        {"role": "user", "content": "hi"}]})
    assert bad.status_code == 400 and "thinking" in bad.json()["error"]["message"]


def _server(client) -> str:
    return str(client.base_url).rstrip("/").removeprefix("http://")


def test_run_shows_the_reasoning_as_ollama_run_does_or_hides_it(always_thinks, capsys):
    from tokenmill.cli import main

    client, host = always_thinks
    argv = ["run", model_name(host), "hi", "--server", _server(client), "--max-tokens", "8", "--temperature", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("Thinking...\n") and out.endswith("\n...done thinking.\n\n") and len(out) > 35
    assert main(argv + ["--hidethinking"]) == 0
    assert capsys.readouterr().out == "\n"  # the tokens ran out while it thought: no answer


def test_run_in_process_reads_the_reasoning_apart_too(tmp_path, nobody_listens, capsys):
    from tokenmill.cli import main

    path = write_tiny_qwen(tmp_path / "r1.gguf", "qwen3", SPEC, chat_template=OPEN_THINK_TEMPLATE)
    assert main(["run", str(path), "hi", "--max-tokens", "8", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Thinking...\n") and "...done thinking." in out


def test_run_set_nothink_turns_thinking_off(qwen3, prompts, monkeypatch, capsys):
    from server_helpers import Terminal
    from tokenmill.cli import main

    client, host = qwen3
    monkeypatch.setattr("sys.stdin", Terminal("/set nothink\nhi\n/set think\nhi again\n/bye\n"))
    assert main(["run", model_name(host), "--server", _server(client), "--max-tokens", "2"]) == 0
    assert "Set 'nothink' mode." in capsys.readouterr().err
    off, on = prompts
    assert off.endswith("<think>\n\n</think>\n\n") and on.endswith("<|im_start|>assistant\n")


def test_reasoning_effort_none_turns_thinking_off(qwen3, prompts):
    client, host = qwen3
    base = {"model": model_name(host), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json={**base, "reasoning_effort": "none"}).status_code == 200
    assert client.post("/v1/chat/completions", json={**base, "reasoning_effort": "high"}).status_code == 200
    r = client.post("/v1/responses", json={"model": model_name(host), "input": "hi", "max_output_tokens": 1,
                                           "reasoning": {"effort": "none"}})
    assert r.status_code == 200, r.text
    off, default, responses_off = prompts
    assert off.endswith("<think>\n\n</think>\n\n") and default.endswith("assistant\n") and responses_off == off
    bad = client.post("/v1/chat/completions", json={**base, "reasoning_effort": "maximal"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    bad = client.post("/v1/responses", json={"model": model_name(host), "input": "hi", "reasoning": {"effort": 3}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning.effort"
