"""The output side on the real tokenizer: stop strings across token boundaries, UTF-8 holdback,
logprobs aligned after trimming."""
from __future__ import annotations

import pytest

from tokenmill.engine import FinishReason, OutputAssembler, SamplingParams, TokenEvent
from tokenmill.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer.from_file(smollm2_path)


def stream(tok, text: str, params: SamplingParams, *, finish: FinishReason = FinishReason.LENGTH):
    """Feed `text`'s tokens one event each, with fake logprobs = -index, through an assembler."""
    ids = tok.encode(text, add_special_tokens=False)
    asm = OutputAssembler(tok, params)
    deltas = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        ev = TokenEvent("r", [t], [-float(i)], None, finish if last else None, None, 3, 0, i + 1)
        deltas.append(asm.push(ev))
        if deltas[-1].finished:
            break
    return ids, deltas


def test_stop_string_spanning_tokens_is_trimmed(tok):
    text = "Hello there. User: what now? more text"
    ids, deltas = stream(tok, text, SamplingParams(stop=["\nUser:", " User:"], logprobs=True))
    out = "".join(d.text for d in deltas)
    assert out == "Hello there."
    assert deltas[-1].finish_reason == "stop" and deltas[-1].hit_stop_string
    # Logprobs stay aligned: exactly the tokens whose text starts before the cut, in order.
    sent = [lp for d in deltas for lp in (d.logprobs or [])]
    released = [t for d in deltas for t in d.token_ids]
    assert tok.decode(released) == "Hello there."
    assert sent == [-float(i) for i in range(len(released))]


def test_text_that_only_looks_like_a_stop_is_released(tok):
    text = "We use <|fake|> tags and Us ers, not User"
    ids, deltas = stream(tok, text, SamplingParams(stop=["User:"]))
    assert "".join(d.text for d in deltas) == text
    assert deltas[-1].finish_reason == "length"


@pytest.mark.parametrize("text", ["Emoji: 🎉🚀 done", "日本語のテキスト、東京", "naïve café — ½ 👩‍👩‍👧"])
def test_utf8_never_split(tok, text):
    ids, deltas = stream(tok, text, SamplingParams())
    for d in deltas:
        assert "\ufffd" not in d.text
        d.text.encode("utf-8")  # every delta is whole characters
    assert "".join(d.text for d in deltas) == text
    assert sum(len(d.token_ids) for d in deltas) == len(ids)


def test_eos_text_is_not_emitted(tok):
    ids = tok.encode("Fine.", add_special_tokens=False) + [tok.eos_id]
    asm = OutputAssembler(tok, SamplingParams())
    out = ""
    for i, t in enumerate(ids):
        out += asm.push(TokenEvent("r", [t], None, None, FinishReason.STOP if i == len(ids) - 1 else None,
                                   None, 3, 0, i + 1)).text
    assert out == "Fine."
