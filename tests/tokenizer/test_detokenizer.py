"""IncrementalDetokenizer: streamed pieces are always whole characters and add up to decode()."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer

MULTIBYTE_TEXTS = [
    "naïve café résumé — “quotes” Ωμέγα",
    "日本語のテキストです。中文文本，还有标点。한국어",
    "emoji 🙂👍🏽 🇫🇷 👨‍👩‍👧 ❤️ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math",
    "<|im_start|>assistant\n好的 🙂<|im_end|>\n<|endoftext|>",
]


def _stream(tok: Tokenizer, ids: list[int], *, skip_special_tokens: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    return [detok.push(i) for i in ids] + [detok.flush()]


def _ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_incomplete_character_is_held_back(tiny_tokenizer):
    tok = tiny_tokenizer
    emoji = _ids_of(tok, "🙂")  # the tiny vocabulary has no merges for it: one token per byte
    assert len(emoji) == 4
    assert _stream(tok, emoji, skip_special_tokens=True) == ["", "", "", "🙂", ""]
    assert _stream(tok, _ids_of(tok, "aé the"), skip_special_tokens=True) == ["a", "", "é", " the", ""]


def test_leftover_bytes_become_replacement_on_flush(tiny_tokenizer):
    tok = tiny_tokenizer
    first_two = _ids_of(tok, "🙂")[:2]
    assert _stream(tok, first_two, skip_special_tokens=True) == ["", "", "\ufffd"]
    assert tok.decode(first_two) == "\ufffd"


def test_invalid_byte_is_replaced_at_once(tiny_tokenizer):
    tok = tiny_tokenizer
    continuation = _ids_of(tok, "é")[1]  # 0xA9 on its own is never valid UTF-8
    assert _stream(tok, [continuation, *_ids_of(tok, "x")], skip_special_tokens=True) == ["\ufffd", "x", ""]


def test_special_token_between_the_bytes_of_a_character(tiny_tokenizer):
    tok = tiny_tokenizer
    lead, cont = _ids_of(tok, "é")
    ids = [lead, 1, cont]  # <|im_start|> between the two bytes of 'é'
    assert _stream(tok, ids, skip_special_tokens=False) == ["", "\ufffd<|im_start|>", "\ufffd", ""]
    assert "".join(_stream(tok, ids, skip_special_tokens=False)) == tok.decode(ids) == "\ufffd<|im_start|>\ufffd"
    # A skipped special token leaves the character whole, as decode() does.
    assert _stream(tok, ids, skip_special_tokens=True) == ["", "", "é", ""]
    assert tok.decode(ids, skip_special_tokens=True) == "é"


def test_unknown_ids_are_dropped_like_decode(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = [*_ids_of(tok, "hi"), tok.vocab_size + 3]
    assert "".join(_stream(tok, ids, skip_special_tokens=True)) == tok.decode(ids) == "hi"


def test_flush_resets_for_reuse(tiny_tokenizer):
    tok = tiny_tokenizer
    detok = IncrementalDetokenizer(tok)
    lead, cont = _ids_of(tok, "é")
    assert detok.push(lead) == "" and detok.flush() == "\ufffd"
    assert detok.push(cont) == "\ufffd"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_decode_property(tiny_tokenizer, data, skip):
    tok = tiny_tokenizer
    # Mix arbitrary ids (including specials and bytes that form invalid UTF-8) with real encoded text.
    ids = data.draw(st.lists(st.one_of(
        st.integers(0, tok.vocab_size - 1).map(lambda i: [i]),
        st.text(max_size=6).map(lambda s: _ids_of(tok, s)),
    ), max_size=12).map(lambda parts: [i for part in parts for i in part]))
    pieces = _stream(tok, ids, skip_special_tokens=skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.real_model
@pytest.mark.parametrize("skip", [True, False])
def test_smollm2_stream_equals_decode(smollm2_tokenizer, corpus, skip):
    tok = smollm2_tokenizer
    held_back = 0
    for text in [*corpus, *MULTIBYTE_TEXTS]:
        ids = _ids_of(tok, text)
        pieces = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces), text  # valid text never streams a replacement char
        held_back += sum(1 for i, p in zip(ids, pieces) if p == "" and not tok.is_special(i))
    assert held_back > 10  # the texts really split characters across tokens, so holding back was exercised


@pytest.fixture(scope="module")
def half_char_tokenizer(make_tokenizer_gguf, reference_for):
    # User-defined tokens whose bytes are half a character: '©x' starts with the UTF-8 continuation
    # byte 0xA9 and 'xÃ' ends with the lead byte 0xC3. decode() joins all tokens' bytes before decoding,
    # so these join with neighbouring byte tokens into 'é', and the stream must do the same.
    path = make_tokenizer_gguf("half-char", extra=(("©x", 4), ("xÃ", 4)))
    return Tokenizer.from_file(path), reference_for(path)


def test_added_token_bytes_join_their_neighbours(half_char_tokenizer):
    tok, ref = half_char_tokenizer
    lead, cont = _ids_of(tok, "é")
    copy_x, x_lead = tok.vocab_size - 2, tok.vocab_size - 1
    for ids, text in (([lead, copy_x], "éx"), ([x_lead, cont], "xé"), ([x_lead, copy_x], "xéx")):
        assert "".join(_stream(tok, ids, skip_special_tokens=True)) == tok.decode(ids) == ref.decode(ids) == text
    assert _stream(tok, [x_lead, cont], skip_special_tokens=True) == ["x", "é", ""]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_decode_around_added_tokens(half_char_tokenizer, data, skip):
    tok, ref = half_char_tokenizer
    # Specials, the bytes of 'é' and '€' (lead and continuation bytes), ASCII, and the half-character tokens.
    pool = [0, 1, 2, *_ids_of(tok, "é€a<"), tok.vocab_size - 2, tok.vocab_size - 1]
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=12))
    assert "".join(_stream(tok, ids, skip_special_tokens=skip)) == ref.decode(ids, skip_special_tokens=skip)


# --- SentencePiece byte fallback: decode() reads a run of <0xXX> tokens as a whole ---------------


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    from tiny_spm import tiny_spm_metadata

    vocab = {t: i for i, t in enumerate(tiny_spm_metadata()["tokenizer.ggml.tokens"])}
    return [vocab[f"<0x{b:02X}>"] for b in data]


def test_byte_fallback_run_is_held_until_it_ends(tiny_spm_tokenizer):
    tok = tiny_spm_tokenizer
    ids = _ids_of(tok, "🙂a🙂")  # no piece for the emoji: four byte tokens each
    assert len(ids) == 9
    assert _stream(tok, ids, skip_special_tokens=True) == ["", "", "", "", "🙂a", "", "", "", "", "🙂"]


def test_invalid_byte_fallback_run_gives_one_replacement_per_byte(tiny_spm_tokenizer, tiny_spm_reference):
    tok, ref = tiny_spm_tokenizer, tiny_spm_reference
    a = _ids_of(tok, "a")
    # A cut-off character, and a valid 'é' followed by a stray continuation byte: unlike a plain UTF-8
    # decoder, ByteFallback replaces every byte of a run that is not valid as a whole.
    for data, text in ((b"\xe6\x97", "\ufffd\ufffd"), (b"\xc3\xa9\xa9", "\ufffd\ufffd\ufffd"), (b"\xc3\xa9", "é")):
        ids = [*_byte_ids(tok, data), *a]
        assert tok.decode(ids) == ref.decode(ids) == text + "a"
        assert _stream(tok, ids, skip_special_tokens=True) == [""] * len(data) + [text + "a", ""]
        assert "".join(_stream(tok, _byte_ids(tok, data), skip_special_tokens=True)) == text  # ended by flush


def test_special_token_inside_a_byte_fallback_run(tiny_spm_tokenizer):
    tok = tiny_spm_tokenizer
    lead, cont = _byte_ids(tok, b"\xc3\xa9")
    ids = [lead, 6, cont]  # <end_of_turn> between the two bytes of 'é'
    assert "".join(_stream(tok, ids, skip_special_tokens=False)) == tok.decode(ids) == "\ufffd<end_of_turn>\ufffd"
    # A skipped special token is not there for decode(), so the run goes on.
    assert _stream(tok, ids, skip_special_tokens=True) == ["", "", "", "é"]
    assert tok.decode(ids, skip_special_tokens=True) == "é"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_sentencepiece_stream_equals_decode_property(tiny_spm_tokenizer, tiny_spm_reference, data, skip):
    tok = tiny_spm_tokenizer
    ids = data.draw(st.lists(st.one_of(
        st.integers(0, tok.vocab_size + 2).map(lambda i: [i]),
        st.binary(max_size=4).map(lambda b: _byte_ids(tok, b)),
        st.text(max_size=6).map(lambda s: _ids_of(tok, s)),
    ), max_size=10).map(lambda parts: [i for part in parts for i in part]))
    assert "".join(_stream(tok, ids, skip_special_tokens=skip)) == tiny_spm_reference.decode(
        ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.real_model
@pytest.mark.parametrize("skip", [True, False])
def test_gemma3_stream_equals_decode(gemma3_tokenizer, corpus, skip):
    tok = gemma3_tokenizer
    for text in [*corpus, *MULTIBYTE_TEXTS, "<start_of_turn>model\n🙂 \U0001f9ff<end_of_turn>"]:
        ids = _ids_of(tok, text)
        pieces = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces), text
