"""SmolLM2-135M-Instruct through the real `openai` and `ollama` clients: a greedy answer is sensible,
and streaming (either API) yields exactly the non-streaming answer. Kept to three short generations:
the real model is slow on a shared CPU."""
from __future__ import annotations

import ollama
import openai
import pytest

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 7


@pytest.fixture(scope="module")
def smol(smol_server):
    server, host = smol_server
    return server.url, host


@pytest.fixture(scope="module")
def greedy_answer(smol):
    with openai.OpenAI(base_url=f"{smol[0]}/v1", api_key="unused", max_retries=0) as c:
        full = c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    assert full.model == "smollm2:135m"
    return full


def test_openai_chat_non_streaming(greedy_answer):
    text = greedy_answer.choices[0].message.content
    assert "Paris" in text, text
    assert greedy_answer.usage.completion_tokens <= MAX_TOKENS


def test_openai_chat_streaming(smol, greedy_answer):
    with openai.OpenAI(base_url=f"{smol[0]}/v1", api_key="unused", max_retries=0) as c:
        stream = c.chat.completions.create(model="smollm2:135m", messages=QUESTION, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream) == greedy_answer.choices[0].message.content


def test_ollama_chat_streaming(smol, greedy_answer):
    c = ollama.Client(host=smol[0])
    # Ollama's own defaults add a repeat penalty; without it greedy decoding must agree with OpenAI's.
    options = {"temperature": 0, "num_predict": MAX_TOKENS, "repeat_penalty": 1.0}
    parts = list(c.chat(model="smollm2:latest", messages=QUESTION, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == greedy_answer.choices[0].message.content
    final = parts[-1]
    assert final.done and final.eval_count == greedy_answer.usage.completion_tokens
    assert final.prompt_eval_count == greedy_answer.usage.prompt_tokens


def test_embeddings_rank_related_text_higher(smol):
    url, host = smol
    vecs = ollama.Client(host=url).embed(model="smollm2", input=[
        "The cat sat on the mat.", "A kitten rested on the rug.", "Quarterly revenue grew by four percent."]).embeddings
    assert len(vecs[0]) == host.current.engine.loaded.config.dim

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b))

    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2])
