"""The official `openai` client, unchanged, against a live server with the tiny model."""
from __future__ import annotations

import math

import openai
import pytest

from server_helpers import model_name


def test_chat_non_streaming(oai, tiny):
    name = model_name(tiny[1])
    r = oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                    temperature=0)
    assert r.object == "chat.completion" and r.model == name
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming_and_reports_usage(oai, tiny):
    kwargs = dict(model=model_name(tiny[1]), messages=[{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": "hello"}],
                  max_tokens=6, temperature=0)
    full = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_n_choices_with_seed_and_logprobs(oai, tiny):
    r = oai.chat.completions.create(model=model_name(tiny[1]), messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=3, n=3, seed=7, temperature=1.0, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        entries = c.logprobs.content
        assert entries and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    # Same seed + i on a second call: the same three samples.
    again = oai.chat.completions.create(model=model_name(tiny[1]), messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=3, n=3, seed=7, temperature=1.0)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_completion_non_streaming_and_streaming(oai, tiny):
    name = model_name(tiny[1])
    r = oai.completions.create(model=name, prompt="the cat", max_tokens=5, temperature=0, logprobs=2)
    assert r.object == "text_completion"
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    stream = oai.completions.create(model=name, prompt="the cat", max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == r.choices[0].text


def test_completion_with_vllm_extensions_and_token_prompt(oai, tiny):
    # Seeded, and a stop string the sample cannot plausibly contain: min_tokens holds back the end tokens,
    # not stop strings, and an unseeded draw from the global RNG once produced "zz" after two tokens.
    r = oai.completions.create(model=model_name(tiny[1]), prompt=[10, 20, 30], max_tokens=6, temperature=0.7,
                               seed=7, stop=["\u2603\u2603"],
                               extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 6,
                                           "ignore_eos": True, "priority": -1})
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 6


def test_embeddings_float_and_default_base64(oai, tiny):
    name = model_name(tiny[1])
    # The client asks for base64 by default and decodes it.
    r = oai.embeddings.create(model=name, input=["hello", "world"])
    assert [d.index for d in r.data] == [0, 1]
    dim = tiny[1].current.engine.loaded.config.dim
    for d in r.data:
        assert len(d.embedding) == dim
        assert math.isclose(math.sqrt(sum(x * x for x in d.embedding)), 1.0, rel_tol=1e-3)
    floats = oai.embeddings.create(model=name, input="hello", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(r.data[0].embedding, abs=1e-6)
    assert r.usage.prompt_tokens > 0
    short = oai.embeddings.create(model=name, input="hello", dimensions=8, encoding_format="float")
    assert len(short.data[0].embedding) == 8


def test_models_list_and_retrieve(oai, tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))  # only the served model
    name = model_name(tiny[1])
    models = oai.models.list()
    assert [m.id for m in models.data] == [name]
    assert oai.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_errors_become_client_exceptions(oai, tiny):
    name = model_name(tiny[1])
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert exc.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_completion_echo_with_logprobs_scores_the_prompt(oai, tiny):
    """OpenAI's echo with logprobs (what lm-eval's loglikelihood tasks send): the prompt's tokens come
    back with their logprobs, the first with none, then the completion's; max_tokens 0 scores the
    prompt alone. A generated token's logprob is the one the prompt scoring gives it once it is part
    of the prompt."""
    name = model_name(tiny[1])
    r = oai.completions.create(model=name, prompt="the cat sat", max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    prompt_tokens = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == prompt_tokens + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # Keyed by token text, as OpenAI's legacy shape is: two ids with one text share an entry.
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert r.choices[0].text.startswith("the cat sat") and "".join(lp.tokens).endswith(r.choices[0].text[11:])
    assert lp.text_offset == sorted(lp.text_offset)

    scored = oai.completions.create(model=name, prompt=r.choices[0].text, max_tokens=0, echo=True, logprobs=0)
    assert scored.usage.completion_tokens == 0 and scored.choices[0].text == r.choices[0].text
    again = scored.choices[0].logprobs
    assert again.top_logprobs is None and len(again.token_logprobs) == scored.usage.prompt_tokens
    assert again.tokens == lp.tokens  # the text re-encodes to the same tokens (byte-level BPE)
    assert again.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_completion_echo_with_logprobs_streams_the_prompt_first(oai, tiny):
    kwargs = dict(model=model_name(tiny[1]), prompt=["one two", "three"], max_tokens=2, temperature=0, echo=True,
                  logprobs=1, n=2)
    full = oai.completions.create(**kwargs)
    chunks = list(oai.completions.create(**kwargs, stream=True))
    for i, choice in enumerate(full.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].text == ("one two" if i < 2 else "three") and mine[0].logprobs.token_logprobs[0] is None
        assert "".join(c.text for c in mine) == choice.text
        streamed = [v for c in mine if c.logprobs for v in c.logprobs.token_logprobs]
        assert streamed == choice.logprobs.token_logprobs
    # Both samples of a prompt carry the one scoring of it.
    assert full.choices[0].logprobs.token_logprobs[:2] == full.choices[1].logprobs.token_logprobs[:2]
