"""The OpenAI API's request fields as the official `openai` client (and vLLM's users) send them: each is
honoured, accepted without effect, or refused with a 400 naming it, never silently ignored when that
would change the answer. The tiny model's output is random text; these tests look at what the server
did with the request (the prompt it rendered, the fields it answered with), not at the words."""
from __future__ import annotations

import openai
import pytest

from server_helpers import model_name, start_server, wait_idle
from tiny_model import CHATML_TEMPLATE, write_tiny_llama

HI = [{"role": "user", "content": "hi"}]


def refused(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    return info.value.body["message"]


@pytest.mark.parametrize("fields, param", [
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"modalities": "text"}, "modalities"),
    ({"web_search_options": {}}, "web_search_options"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(oai, tiny, fields, param):
    # Ignored, these would return plain text where the client waits for a function call, audio or
    # search results; vLLM ignores them, tokenmill says so.
    message = refused(lambda: oai.chat.completions.create(model=model_name(tiny[1]), messages=HI, max_tokens=2,
                                                          **fields), param)
    assert param in message


def test_fields_without_effect_are_accepted(oai, tiny):
    # Hints and bookkeeping that change nothing about the text; function_call "auto" with no functions
    # and modalities ["text"] ask for what a plain request gets anyway.
    r = oai.chat.completions.create(
        model=model_name(tiny[1]), messages=HI, max_tokens=2, user="u1", metadata={"k": "v"}, store=False,
        service_tier="auto", reasoning_effort="low", modalities=["text"], function_call="auto",
        prediction={"type": "content", "content": "hello"}, prompt_cache_key="k", prompt_cache_retention="24h",
        safety_identifier="s", verbosity="low")
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens > 0


def test_refusal_and_input_text_parts_are_read_as_text(oai, tiny):
    name = model_name(tiny[1])

    def prompt_tokens(assistant_content, user_content) -> int:
        messages = [{"role": "user", "content": user_content}, {"role": "assistant", "content": assistant_content},
                    {"role": "user", "content": "again"}]
        return oai.chat.completions.create(model=name, messages=messages, max_tokens=1).usage.prompt_tokens

    # A client sends an earlier answer back as it got it, a refusal part included (as vLLM reads it).
    as_parts = prompt_tokens([{"type": "refusal", "refusal": "I cannot"}], [{"type": "input_text", "text": "hi"}])
    assert as_parts == prompt_tokens("I cannot", "hi")
    message = refused(lambda: oai.chat.completions.create(
        model=name, max_tokens=1,
        messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}]}]),
        "messages[0].content")
    assert "text only" in message and "video_url" in message


@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_stats_put_each_choice_s_usage_so_far_on_every_chunk(oai, tiny, n):
    name = model_name(tiny[1])
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(oai.chat.completions.create(model=name, messages=HI, max_tokens=4, n=n, temperature=1, seed=3,
                                              stream=True, stream_options=options))
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens > 0
    seen = [0] * n
    for c in chunks[:-1]:
        (choice,) = c.choices
        u = c.usage
        assert u.prompt_tokens == final.usage.prompt_tokens
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert u.completion_tokens >= seen[choice.index]  # this choice's count so far, never going back
        seen[choice.index] = u.completion_tokens
    assert sum(seen) == final.usage.completion_tokens
    # As vLLM: only along with include_usage; alone it adds nothing.
    plain = list(oai.chat.completions.create(model=name, messages=HI, max_tokens=2, stream=True,
                                             stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)
    # /v1/completions too.
    texts = list(oai.completions.create(model=name, prompt=["ab", "cd"], max_tokens=3, n=n, stream=True,
                                        echo=True, stream_options=options))
    assert all(c.usage is not None for c in texts)
    assert texts[-1].choices == [] and texts[-1].usage.prompt_tokens == sum(
        c.usage.prompt_tokens for c in texts[:-1] if c.choices[0].index % n == 0 and c.choices[0].finish_reason)


# A chat template that reads a variable of chat_template_kwargs (as Qwen3's reads enable_thinking).
NOTE_TEMPLATE = ("{% if note is defined %}{{ '<|im_start|>system\n' + note + '<|im_end|>\n' }}{% endif %}"
                 + CHATML_TEMPLATE)


@pytest.fixture(scope="module")
def noted(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("noted") / "noted.gguf", chat_template=NOTE_TEMPLATE)
    server, host = start_server(str(path), kv_size=2048)
    assert host.wait_ready(60), host.error
    yield server.url, host
    server.stop()


def test_chat_template_kwargs_and_add_generation_prompt_reach_the_template(noted):
    url, host = noted
    tok = host.current.engine.tokenizer

    def expected(**template) -> int:
        return len(tok.encode(tok.apply_chat_template(HI, **template), add_special_tokens=False))

    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        def prompt_tokens(**extra) -> int:
            return c.chat.completions.create(model=model_name(host), messages=HI, max_tokens=1,
                                             extra_body=extra).usage.prompt_tokens

        plain = prompt_tokens()
        assert plain == expected()
        assert prompt_tokens(chat_template_kwargs={"note": "be brief"}) == expected(note="be brief") > plain
        assert prompt_tokens(add_generation_prompt=False) == expected(add_generation_prompt=False) < plain
        for kwargs in ({"messages": []}, {"add_generation_prompt": False}, {"tools": []}):
            message = refused(lambda: prompt_tokens(chat_template_kwargs=kwargs), "chat_template_kwargs")
            assert next(iter(kwargs)) in message
        refused(lambda: prompt_tokens(chat_template_kwargs=["note"]), "chat_template_kwargs")
        # A variable that breaks the template is the template's 400, not a server error.
        refused(lambda: prompt_tokens(chat_template_kwargs={"note": 5}), "messages")
    wait_idle(host)


@pytest.mark.parametrize("path, field", [("/v1/embeddings", "input"), ("/v1/completions", "prompt")])
def test_truncate_prompt_tokens_zero_is_a_400_on_every_route(client, tiny, path, field):
    # On /v1/embeddings 0 used to embed the whole input (a slice [-0:] keeps everything).
    body = {"model": model_name(tiny[1]), field: "hello there", "max_tokens": 1}
    r = client.post(path, json={**body, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    r = client.post(path, json={**body, "truncate_prompt_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2, r.text
