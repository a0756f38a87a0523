"""The official `ollama` client, unchanged, against a live server with the tiny model."""
from __future__ import annotations

import math

import ollama
import pytest

from server_helpers import model_name

GREEDY = {"temperature": 0, "num_predict": 5}


@pytest.fixture
def oll(tiny):
    return ollama.Client(host=tiny[0])


def test_generate_non_streaming_has_ollama_final_fields(oll, tiny):
    r = oll.generate(model=model_name(tiny[1]), prompt="hello", options=GREEDY)
    assert r.done and r.done_reason in ("stop", "length")
    assert r.prompt_eval_count > 0 and 0 < r.eval_count <= 5
    for field in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(r, field), int) and getattr(r, field) >= 0
    assert r.total_duration >= r.eval_duration
    assert r.context and len(r.context) == r.prompt_eval_count + r.eval_count


def test_generate_streaming_matches_and_continues_from_context(oll, tiny):
    name = model_name(tiny[1])
    full = oll.generate(model=name, prompt="hello", system="be kind", options=GREEDY)
    parts = list(oll.generate(model=name, prompt="hello", system="be kind", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == full.response
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    follow = oll.generate(model=name, prompt="more", context=full.context, options=GREEDY)
    assert follow.prompt_eval_count > len(full.context)


def test_generate_raw_and_logprobs(oll, tiny):
    r = oll.generate(model=model_name(tiny[1]), prompt="abc", raw=True, options=GREEDY, logprobs=True,
                     top_logprobs=3)
    assert r.prompt_eval_count == 3  # no template, no BOS for this tokenizer
    assert len(r.logprobs) == r.eval_count
    assert all(len(lp.top_logprobs) == 3 for lp in r.logprobs)


def test_chat_streaming_and_non_streaming(oll, tiny):
    name = model_name(tiny[1])
    messages = [{"role": "system", "content": "short answers"}, {"role": "user", "content": "hi"}]
    full = oll.chat(model=name, messages=messages, options=GREEDY)
    assert full.message.role == "assistant" and full.done and full.eval_count > 0
    parts = list(oll.chat(model=name, messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == full.message.content
    assert parts[-1].done_reason == full.done_reason


def test_stop_option_cuts_the_text(oll, tiny):
    name = model_name(tiny[1])
    opts = {"temperature": 1.0, "seed": 11, "num_predict": 10}
    text = oll.generate(model=name, prompt="hello", raw=True, options=opts).response
    cut = next((i for i in range(1, len(text)) if text[i].isascii() and text[i].isalnum() and text[i] not in text[:i]),
               None)
    assert cut is not None, f"sampled text has no usable stop character: {text!r}"
    stopped = oll.generate(model=name, prompt="hello", raw=True, options={**opts, "stop": [text[cut]]})
    assert stopped.response == text[:cut] and stopped.done_reason == "stop"


def test_embed_and_legacy_embeddings(oll, tiny):
    name = model_name(tiny[1])
    r = oll.embed(model=name, input=["hello", "world"])
    assert len(r.embeddings) == 2
    assert math.isclose(math.sqrt(sum(x * x for x in r.embeddings[0])), 1.0, rel_tol=1e-3)
    assert r.prompt_eval_count > 0
    legacy = oll.embeddings(model=name, prompt="hello")
    assert legacy.embedding == pytest.approx(r.embeddings[0], abs=1e-6)
    short = oll.embed(model=name, input="hello", dimensions=4)
    assert len(short.embeddings[0]) == 4


def test_list_show_ps(oll, tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    name = model_name(tiny[1])
    listed = oll.list()
    assert [m.model for m in listed.models] == [name]
    assert listed.models[0].details.format == "gguf" and listed.models[0].details.family == "llama"
    shown = oll.show(name)
    assert shown.modelinfo["general.architecture"] == "llama"
    assert "im_start" in shown.template and "completion" in shown.capabilities
    running = oll.ps()
    assert running.models[0].model == name and running.models[0].context_length == 256


def test_unknown_model_is_a_404(oll):
    with pytest.raises(ollama.ResponseError) as exc:
        oll.chat(model="llama9:900b", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 404 and "not found" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        oll.show("llama9:900b")
    assert exc.value.status_code == 404
