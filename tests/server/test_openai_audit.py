"""The OpenAI API's request fields as the official `openai` client (and vLLM's users) send them: each is
honoured, accepted without effect, or refused with a 400 naming it, never silently ignored when that
would change the answer. The tiny model's output is random text; these tests look at what the server
did with the request (the prompt it rendered, the fields it answered with), not at the words."""
from __future__ import annotations

import openai
import pytest

from server_helpers import model_name

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def oai(tiny):
    url, _ = tiny
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def refused(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    return info.value.body["message"]


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
