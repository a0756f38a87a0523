"""Tokenizer: ids and text identical to transformers for the same GGUF, plus the API around them."""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenizer.conftest import assert_parity
from tokenmill.tokenizer import Tokenizer, TokenizerError
from tokenmill.tokenizer import tokenizer as tokenizer_module

CONTROL, USER_DEFINED, NORMAL = 3, 4, 1


def test_tiny_parity_with_transformers(tiny_tokenizer, tiny_reference, corpus):
    assert_parity(tiny_tokenizer, tiny_reference, corpus)


def test_long_texts_match_transformers_on_the_gil_free_path(tiny_tokenizer, tiny_reference, corpus):
    # Past GIL_FREE_CHARS the backend's batch encoder is used (it releases the GIL); same ids.
    text = "\n<|im_start|>".join(corpus) * 8
    assert len(text) > tokenizer_module.GIL_FREE_CHARS
    assert tiny_tokenizer.encode(text) == tiny_reference.encode(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=12), st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>",
                                                                  " ", "  ", "\n", "hello", " the", "1"])),
                max_size=8))
def test_tiny_parity_property(tiny_tokenizer, tiny_reference, pieces):
    text = "".join(pieces)
    assert tiny_tokenizer.encode(text) == tiny_reference.encode(text)


@pytest.mark.real_model
def test_smollm2_parity_with_transformers(smollm2_tokenizer, smollm2_reference, corpus):
    assert_parity(smollm2_tokenizer, smollm2_reference, corpus)
    # SmolLM2's other control tokens are parsed whole, as transformers does.
    assert_parity(smollm2_tokenizer, smollm2_reference, ["<repo_name>tokenmill<file_sep>src/a.py\n<jupyter_code>x"])


@pytest.mark.real_model
def test_smollm2_attributes_match_transformers(smollm2_tokenizer, smollm2_reference):
    tok, ref = smollm2_tokenizer, smollm2_reference
    assert tok.vocab_size == len(ref) == 49152
    assert (tok.bos_id, tok.eos_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    assert tok.add_bos is False
    assert tok.stop_ids == frozenset({0, 2})  # <|im_end|> and <|endoftext|>
    # is_special means "decode(skip_special_tokens=True) drops it": every control token, not only the named ones.
    special = {i for i, added in ref.added_tokens_decoder.items() if added.special}
    assert {i for i in range(tok.vocab_size) if tok.is_special(i)} == special == set(range(17))


@pytest.mark.real_model
def test_smollm2_round_trip(smollm2_tokenizer, corpus):
    for text in corpus:
        assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text
        # A merged multi-byte token is undone to the exact UTF-8 bytes of the text.
        assert b"".join(smollm2_tokenizer.token_bytes(i) for i in smollm2_tokenizer.encode(text)) == text.encode()


def test_tiny_round_trip_property(tiny_tokenizer):
    @settings(max_examples=200, deadline=None)
    @given(st.text())
    def check(text):
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        assert tiny_tokenizer.decode(ids) == text
        assert b"".join(tiny_tokenizer.token_bytes(i) for i in ids) == text.encode()

    check()


def test_special_tokens_in_text_are_parsed(tiny_tokenizer):
    assert tiny_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tiny_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    assert tiny_tokenizer.decode([1, 2, 0]) == "<|im_start|><|im_end|><|endoftext|>"
    assert tiny_tokenizer.decode([1, 2, 0], skip_special_tokens=True) == ""


def test_token_bytes_and_is_special(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.token_bytes(tok.encode(" ", add_special_tokens=False)[0]) == b" "
    assert tok.token_bytes(tok.encode(" the")[0]) == b" the"
    assert tok.token_bytes(1) == b"<|im_start|>"
    # 'é' is two byte tokens: each stands for one raw, non-UTF-8 byte.
    assert [tok.token_bytes(i) for i in tok.encode("é")] == [b"\xc3", b"\xa9"]
    assert tok.is_special(0) and tok.is_special(2) and not tok.is_special(tok.encode("a")[0])
    for bad in (-1, tok.vocab_size):
        with pytest.raises(TokenizerError):
            tok.token_bytes(bad)


def test_pre_tokenizer_splits_match_transformers(make_tokenizer_gguf, reference_for, corpus):
    splits = {}
    for pre in ["gpt-2", "llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"]:
        # Merges across a space before a digit, across digits and across whitespace runs make
        # differences in the split visible in the ids too.
        path = make_tokenizer_gguf(f"pre-{pre}", pre=pre,
                                   extra=(("Ġ1", NORMAL), ("ĠĠ", NORMAL), ("ĊĊ", NORMAL), ("12", NORMAL)),
                                   extra_merges=("Ġ 1", "Ġ Ġ", "Ċ Ċ", "1 2"))
        ours, ref = Tokenizer.from_file(path), reference_for(path)
        assert_parity(ours, ref, corpus)
        # The split itself, independent of which merges this small vocabulary happens to have.
        split = [ours._backend.pre_tokenizer.pre_tokenize_str(text) for text in corpus]
        assert split == [ref.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text) for text in corpus], pre
        splits[pre] = repr(split)
    assert len(set(splits.values())) == len(splits)  # the corpus tells every regex apart


def test_bos_is_added_only_when_asked(make_tokenizer_gguf, reference_for):
    path = make_tokenizer_gguf("bos", add_bos=True, bos_id=0)
    tok, ref = Tokenizer.from_file(path), reference_for(path)
    assert tok.add_bos is True
    assert tok.encode("hi")[0] == 0 and tok.encode("hi", add_special_tokens=False)[0] != 0
    assert_parity(tok, ref, ["hi", "", "<|im_start|>x"])


def test_user_defined_tokens_match_whole_but_are_not_special(make_tokenizer_gguf, reference_for):
    path = make_tokenizer_gguf("user", extra=(("<think>", USER_DEFINED),))
    tok, ref = Tokenizer.from_file(path), reference_for(path)
    think = tok.vocab_size - 1
    assert tok.encode("a<think>b")[1] == think
    assert not tok.is_special(think)
    assert tok.decode([think], skip_special_tokens=True) == "<think>"
    assert_parity(tok, ref, ["a<think>b", "<think>\n</think>", "<thin k>"])


def test_raw_text_control_tokens_keep_their_own_id(make_tokenizer_gguf):
    # DeepSeek-style files store these as raw text, not in the byte alphabet. transformers cuts them into
    # bytes (and gives a raw-text BOS an id past the vocabulary); we match them whole, like llama.cpp.
    bos, user = "<｜begin▁of▁sentence｜>", "<｜User｜>"
    path = make_tokenizer_gguf("raw", extra=((bos, CONTROL), (user, CONTROL), ("<a b>", USER_DEFINED)),
                               bos_id=271, add_bos=True)
    tok = Tokenizer.from_file(path)
    assert tok.vocab_size == 274 and tok.bos_id == 271
    assert tok.encode(f"{user}hi<a b>") == [271, 272, *tok.encode("hi", add_special_tokens=False), 273]
    assert tok.token_bytes(272) == user.encode()
    assert tok.decode([271, 272, 273]) == f"{bos}{user}<a b>"
    assert tok.decode([271, 272, 273], skip_special_tokens=True) == "<a b>"


def test_stop_ids_include_end_of_turn_tokens(make_tokenizer_gguf):
    path = make_tokenizer_gguf("eot", extra=(("<|eot_id|>", CONTROL), ("<|custom|>", CONTROL)), eos_id=0,
                               eom_token_id=1)
    tok = Tokenizer.from_file(path)
    # EOS, the named EOM, the control tokens named like an end of turn; not arbitrary control tokens.
    assert tok.stop_ids == frozenset({0, 1, 2, 271})


@pytest.mark.parametrize(("changes", "message"), [
    ({"tokenizer.ggml.model": "llama"}, "SentencePiece"),
    ({"tokenizer.ggml.model": "bert"}, "unsupported tokenizer.ggml.model='bert'"),
    ({"tokenizer.ggml.pre": "some-new-model"}, "unsupported pre-tokenizer tokenizer.ggml.pre='some-new-model'"),
    ({"tokenizer.ggml.tokens": []}, "no tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.merges": []}, "no tokenizer.ggml.merges"),
])
def test_unsupported_tokenizers_raise_clear_errors(tiny_gguf, changes, message):
    from tokenmill.gguf import open_gguf

    metadata = {**open_gguf(tiny_gguf).metadata, **changes}
    with pytest.raises(TokenizerError, match=re.escape(message)):
        Tokenizer.from_gguf_metadata(metadata)


def test_decode_rejects_negative_ids_and_drops_unknown_ones(tiny_tokenizer, tiny_reference):
    with pytest.raises(TokenizerError):
        tiny_tokenizer.decode([-1])
    ids = [*tiny_tokenizer.encode("hi"), tiny_tokenizer.vocab_size + 5]
    assert tiny_tokenizer.decode(ids) == tiny_reference.decode(ids) == "hi"
