"""SentencePiece-style (Gemma) tokenizers: ids and text identical to transformers for the same GGUF,
the bytes behind each token, stop ids, and Gemma's built-in chat template."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_spm import BYTE, CONTROL, NORMAL, USER_DEFINED, tiny_spm_metadata, write_tokenizer_gguf
from tokenizer.conftest import assert_parity, sentencepiece_reference
from tokenmill.tokenizer import Tokenizer, TokenizerError
from tokenmill.tokenizer.sentencepiece import _merges_by_hashing, _merges_by_slicing, gemma_merges

# Beyond the shared corpus: Gemma's own special tokens written in text, the whitespace runs Gemma has
# tokens for, a literal "▁", text that looks like a byte token, and characters only bytes can spell.
SPM_TEXTS = [
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>a<eos>b<pad>c<unk>d<mask>e",
    "<start_of_turn<end_of_turn>>",
    "<start_of_turn >",
    "hello world  the\t\tcafé 日本語",
    "  two   three    four     five\t\t\ttabs\n\n\n\nnewlines \n \n",
    "▁▁x ▁ ▁▁▁",
    "<0x41> <0x0A> <0xZZ>",
    "<table><tr>",
    "🙂 \U0001f600 \x00 \x7f \u0301",
    "x" * 300 + " y" * 50,
]

CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]
CHAT_PROMPT = (
    "<bos><start_of_turn>user\nYou are a terse assistant.\n\nWhat is 2+2?<end_of_turn>\n"
    "<start_of_turn>model\n4.<end_of_turn>\n"
    "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
    "<start_of_turn>model\n"
)


def _special_ids(ref) -> set[int]:
    return {i for i, added in ref.added_tokens_decoder.items() if added.special}


def _write(tmp_path, name: str, changes: dict[str, object] | None = None, *, arch: str = "gemma3"):
    return write_tokenizer_gguf(tmp_path / f"{name}.gguf", {**tiny_spm_metadata(), **(changes or {})}, arch=arch)


# --- the tiny vocabulary --------------------------------------------------------------------------


def test_tiny_vocabulary_is_well_formed():
    meta = tiny_spm_metadata()
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(set(tokens)) == len(tokens) == len(types) == len(meta["tokenizer.ggml.scores"])
    assert [tokens[meta[f"tokenizer.ggml.{k}_token_id"]] for k in ("padding", "eos", "bos", "unknown")] == [
        "<pad>", "<eos>", "<bos>", "<unk>"]
    assert {tokens[i] for i, t in enumerate(types) if t == CONTROL} >= {"<start_of_turn>", "<end_of_turn>"}
    assert [tokens[i] for i, t in enumerate(types) if t == BYTE] == [f"<0x{b:02X}>" for b in range(256)]
    assert {"▁", "▁the"} <= {tokens[i] for i, t in enumerate(types) if t == NORMAL}
    assert "  " in {tokens[i] for i, t in enumerate(types) if t == USER_DEFINED}


def test_tiny_parity_with_transformers(tiny_spm_tokenizer, tiny_spm_reference, corpus):
    assert_parity(tiny_spm_tokenizer, tiny_spm_reference, [*corpus, *SPM_TEXTS])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=10), st.sampled_from(
    ["<start_of_turn>", "<end_of_turn>", "<bos>", " ", "  ", "   ", "\n", "\n\n", "\t", "hello", " the", "▁",
     "café", "日本", "🙂", "é"])), max_size=8))
def test_tiny_parity_property(tiny_spm_tokenizer, tiny_spm_reference, pieces):
    text = "".join(pieces)
    ids = tiny_spm_tokenizer.encode(text)
    assert ids == tiny_spm_reference.encode(text)
    assert tiny_spm_tokenizer.decode(ids) == tiny_spm_reference.decode(ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 360), max_size=10), st.booleans())
def test_tiny_decode_of_any_ids_matches_transformers(tiny_spm_tokenizer, tiny_spm_reference, ids, skip):
    # Arbitrary ids: byte tokens in runs that are not valid UTF-8, specials, respelled whitespace, ids
    # past the vocabulary (dropped).
    assert tiny_spm_tokenizer.vocab_size == 352
    assert tiny_spm_tokenizer.decode(ids, skip_special_tokens=skip) == tiny_spm_reference.decode(
        ids, skip_special_tokens=skip)


def test_tiny_attributes_match_transformers(tiny_spm_tokenizer, tiny_spm_reference):
    tok, ref = tiny_spm_tokenizer, tiny_spm_reference
    assert tok.vocab_size == len(ref)
    assert (tok.bos_id, tok.eos_id) == (ref.bos_token_id, ref.eos_token_id) == (2, 1)
    assert tok.add_bos is True
    assert tok.encode("hi")[0] == 2 and tok.encode("hi", add_special_tokens=False)[0] != 2
    assert tok.stop_ids == frozenset({1, 6})  # <eos> and the control token <end_of_turn>
    # Every control token and the named ones (<mask> included) are special; user-defined ones are not.
    assert {i for i in range(tok.vocab_size) if tok.is_special(i)} == _special_ids(ref) == set(range(7))


def test_tiny_token_bytes(tiny_spm_tokenizer):
    tok = tiny_spm_tokenizer
    vocab = {t: i for i, t in enumerate(tiny_spm_metadata()["tokenizer.ggml.tokens"])}
    assert tok.token_bytes(vocab["<0x0A>"]) == b"\n"
    assert tok.token_bytes(vocab["<0xF0>"]) == b"\xf0"
    assert tok.token_bytes(vocab["▁"]) == b" "
    assert tok.token_bytes(vocab["▁café"]) == " café".encode()
    assert tok.token_bytes(vocab["in▁"]) == b"in "
    assert tok.token_bytes(vocab["  "]) == b"  "  # stored with real spaces, looked up as "▁▁"
    assert tok.token_bytes(vocab["\n\n"]) == b"\n\n"
    assert tok.token_bytes(vocab["<end_of_turn>"]) == b"<end_of_turn>"
    assert [tok.token_bytes(i) for i in tok.encode("🙂", add_special_tokens=False)] == [
        b"\xf0", b"\x9f", b"\x99", b"\x82"]
    assert tok.is_byte_fallback(vocab["<0x41>"]) and not tok.is_byte_fallback(vocab["a"])
    for bad in (-1, tok.vocab_size):
        with pytest.raises(TokenizerError):
            tok.token_bytes(bad)


def test_tiny_round_trip_property(tiny_spm_tokenizer):
    # A "▁" in the text is read as a space, as SentencePiece does, so it cannot come back.
    @settings(max_examples=200, deadline=None)
    @given(st.text().map(lambda text: text.replace("▁", "_")))
    def check(text):
        ids = tiny_spm_tokenizer.encode(text, add_special_tokens=False)
        assert tiny_spm_tokenizer.decode(ids) == text
        assert b"".join(tiny_spm_tokenizer.token_bytes(i) for i in ids) == text.encode()

    check()


def test_whitespace_tokens_are_respelled_and_matched_by_bpe(tiny_spm_tokenizer, tiny_spm_reference):
    tok = tiny_spm_tokenizer
    vocab = {t: i for i, t in enumerate(tiny_spm_metadata()["tokenizer.ggml.tokens"])}
    # "  " is user-defined but, as under transformers, reached through BPE as "▁▁", not as an added token.
    assert tok.encode("a  b", add_special_tokens=False) == [vocab["a"], vocab["  "], vocab["b"]]
    assert tok.encode("    ", add_special_tokens=False) == [vocab["▁▁▁▁"]]
    # Newline and tab runs are added tokens, matched whole.
    assert tok.encode("\n\n\n", add_special_tokens=False) == [vocab["\n\n"], vocab["\n"]]
    assert not tok.is_special(vocab["\n"])


def test_mask_token_missing_from_the_vocabulary(tmp_path):
    # GemmaTokenizer defaults its mask token to "<mask>" and, when the file lacks it, transformers adds
    # it under an id past the vocabulary that the model has no embedding for. We keep the vocabulary.
    meta = tiny_spm_metadata()
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[4] = "<unused0>"
    path = _write(tmp_path, "no-mask", {"tokenizer.ggml.tokens": tokens})
    tok, ref = Tokenizer.from_file(path), sentencepiece_reference(path)
    assert len(ref) == tok.vocab_size + 1 and ref.encode("<mask>", add_special_tokens=False) == [tok.vocab_size]
    assert tok.vocab_size == 352 and tok.vocab_size not in tok.encode("<mask>")
    assert tok.decode(tok.encode("<mask>", add_special_tokens=False)) == "<mask>"
    assert_parity(tok, ref, ["hello world", "<start_of_turn>user\nhi<end_of_turn>"])


def test_duplicate_tokens_match_transformers(tmp_path):
    # A token listed twice keeps its last id, and ranks as a merge where it is last listed.
    meta = tiny_spm_metadata()
    path = _write(tmp_path, "dup", {
        "tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"], "he", "▁the", "x"],
        "tokenizer.ggml.scores": [*meta["tokenizer.ggml.scores"], -500.0, -501.0, -502.0],
        "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"], NORMAL, NORMAL, NORMAL],
    })
    tok, ref = Tokenizer.from_file(path), sentencepiece_reference(path)
    # Our size is the file's token count, which the model's embedding has; transformers counts spellings.
    assert tok.vocab_size == len(ref) + 3 == 355
    assert_parity(tok, ref, ["hello the x", " the then", *SPM_TEXTS])
    assert tok.token_bytes(tok.vocab_size - 1) == b"x" and tok.token_bytes(tok.vocab_size - 3) == b"he"
    assert tok.token_bytes(meta["tokenizer.ggml.tokens"].index("x")) == b""  # decode() drops the shadowed id
    assert tok.decode([meta["tokenizer.ggml.tokens"].index("x")]) == ""


# --- merges recovered from the vocabulary ----------------------------------------------------------


def _transformers_merges(tokens: list[str]) -> list[tuple[str, str]]:
    from transformers.tokenization_utils_base import generate_merges

    # What transformers' gemma_tokenizer does: rank by position in the file.
    positions = {token: -index for index, token in enumerate(tokens)}
    return generate_merges({token: index for index, token in enumerate(tokens)}, positions)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="ab▁\x00é", min_size=1, max_size=5), max_size=40))
def test_merges_match_transformers(tokens):
    tokens = ["a", "b", *tokens]
    merges = _transformers_merges(tokens)
    assert gemma_merges(tokens) == _merges_by_slicing(tokens) == merges
    fast = _merges_by_hashing(tokens)
    if len(set(tokens)) == len(tokens):  # the hashed lookup only gives up on duplicate tokens
        assert fast == merges
    else:
        assert fast is None


def test_a_duplicate_beside_a_huge_token_is_refused_not_sliced_for_minutes():
    # A pushed file: one token listed twice sends the merges to the slicing path, whose cost is the
    # square of each token's length (a million characters took 2 minutes of a model load here).
    meta = tiny_spm_metadata()
    tokens = [*meta["tokenizer.ggml.tokens"], "he", "a" * 1_000_000]
    metadata = {**meta, "general.architecture": "gemma3", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": [*meta["tokenizer.ggml.scores"], 0.0, 0.0],
                "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"], NORMAL, NORMAL]}
    with pytest.raises(TokenizerError, match="lists a token twice and holds tokens too long.*1000000 characters"):
        Tokenizer.from_gguf_metadata(metadata)


def test_tiny_merges_match_transformers(tiny_spm_reference):
    from tokenmill.tokenizer.sentencepiece import gemma_spelling

    merges = json.loads(tiny_spm_reference.backend_tokenizer.to_str())["model"]["merges"]
    assert gemma_merges(gemma_spelling(tiny_spm_metadata()["tokenizer.ggml.tokens"])) == [tuple(m) for m in merges]


# --- errors and what is not supported ------------------------------------------------------------


@pytest.mark.parametrize(("changes", "message"), [
    ({"tokenizer.ggml.add_space_prefix": True}, "add_space_prefix=True is not supported"),
    ({"general.architecture": "llama"}, "add_space_prefix=False is not supported"),  # Llama's pipeline prepends
    ({"tokenizer.ggml.pre": "llama-bpe"}, "unsupported pre-tokenizer tokenizer.ggml.pre='llama-bpe'"),
])
def test_unsupported_sentencepiece_files_raise_clear_errors(changes, message):
    metadata = {**tiny_spm_metadata(), "general.architecture": "gemma3", **changes}
    with pytest.raises(TokenizerError, match=re.escape(message)):
        Tokenizer.from_gguf_metadata(metadata)


def test_files_without_pre_or_optional_ids_still_load():
    metadata = {**tiny_spm_metadata(), "general.architecture": "gemma2"}
    for key in ("pre", "padding_token_id", "unknown_token_id", "add_space_prefix"):
        del metadata[f"tokenizer.ggml.{key}"]
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.encode("hello") == [2, tok.encode("hello", add_special_tokens=False)[0]]
    assert tok.is_special(0)  # still a control token


# --- Gemma's built-in chat template ---------------------------------------------------------------


def test_gemma_template_renders_gemmas_format(tiny_spm_tokenizer):
    tok = tiny_spm_tokenizer
    assert tok.apply_chat_template(CHAT) == CHAT_PROMPT
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == CHAT_PROMPT.removesuffix(
        "<start_of_turn>model\n")
    assert tok.apply_chat_template([{"role": "user", "content": "  hi \n"}]) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    # Content given as text parts, as the OpenAI API allows.
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == "<bos><start_of_turn>user\nab<end_of_turn>\n<start_of_turn>model\n"
    # The prompt's special tokens are parsed whole: <bos>, then <start_of_turn> (5) and <end_of_turn> (6).
    ids = tok.encode(CHAT_PROMPT, add_special_tokens=False)
    assert ids[:2] == [2, 5] and ids.count(5) == 4 and ids.count(6) == 3
    assert tok.decode(ids) == CHAT_PROMPT


def test_gemma_template_rejects_roles_out_of_turn(tiny_spm_tokenizer):
    from tokenmill.tokenizer import ChatTemplateError

    for messages in ([{"role": "assistant", "content": "x"}],
                     [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]):
        with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
            tiny_spm_tokenizer.apply_chat_template(messages)


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_gemma_template_is_used_for_every_gemma_architecture(arch):
    tok = Tokenizer.from_gguf_metadata({**tiny_spm_metadata(), "general.architecture": arch})
    assert tok.apply_chat_template(CHAT) == CHAT_PROMPT


def test_a_template_in_the_file_wins():
    tok = Tokenizer.from_gguf_metadata({**tiny_spm_metadata(), "general.architecture": "gemma3",
                                        "tokenizer.chat_template": "{{ messages[0]['content'] }}!"})
    assert tok.apply_chat_template(CHAT) == "You are a terse assistant.!"


def test_other_models_without_a_template_still_have_none(tiny_gguf):
    from tokenmill.gguf import open_gguf

    metadata = {k: v for k, v in open_gguf(tiny_gguf).metadata.items() if k != "tokenizer.chat_template"}
    assert metadata["general.architecture"] == "llama"
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(CHAT)


# --- the real Gemma 3 file ------------------------------------------------------------------------


@pytest.mark.real_model
def test_gemma3_parity_with_transformers(gemma3_tokenizer, gemma3_reference, corpus):
    assert_parity(gemma3_tokenizer, gemma3_reference, [*corpus, *SPM_TEXTS, CHAT_PROMPT])


@pytest.mark.real_model
def test_gemma3_attributes_match_transformers(gemma3_tokenizer, gemma3_reference):
    tok, ref = gemma3_tokenizer, gemma3_reference
    assert tok.vocab_size == len(ref) == 262144
    assert (tok.bos_id, tok.eos_id) == (ref.bos_token_id, ref.eos_token_id) == (2, 1)
    assert tok.add_bos is True
    # <end_of_turn> is a control token in the file, so it stops generation along with <eos>.
    assert tok.stop_ids == frozenset({1, 106})
    special = {i for i in range(tok.vocab_size) if tok.is_special(i)}
    assert special == _special_ids(ref) and len(special) == 6249
    assert tok.is_special(105) and not tok.is_special(107)  # <start_of_turn>; "\n" is user-defined


@pytest.mark.real_model
def test_gemma3_token_bytes(gemma3_tokenizer, corpus):
    tok = gemma3_tokenizer
    assert tok.token_bytes(248) == b"\n" and tok.is_byte_fallback(248)  # <0x0A>
    assert tok.token_bytes(236743) == b" "  # "▁"
    assert tok.token_bytes(138) == b"  "  # stored as two real spaces
    assert tok.token_bytes(106) == b"<end_of_turn>"
    assert sum(tok.is_byte_fallback(i) for i in range(tok.vocab_size)) == 256
    for text in [*corpus, *SPM_TEXTS]:
        if "▁" in text:  # read as a space, so it cannot come back
            continue
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


@pytest.mark.real_model
def test_gemma3_merges_match_transformers(gemma3_path, gemma3_reference):
    from tokenmill.gguf import open_gguf
    from tokenmill.tokenizer.sentencepiece import gemma_spelling

    spelled = gemma_spelling(open_gguf(gemma3_path).metadata["tokenizer.ggml.tokens"])
    merges = json.loads(gemma3_reference.backend_tokenizer.to_str())["model"]["merges"]
    fast = _merges_by_hashing(spelled)
    assert fast is not None and fast == [tuple(m) for m in merges]


@pytest.mark.real_model
def test_gemma3_chat_fallback(gemma3_tokenizer, gemma3_reference):
    tok = gemma3_tokenizer
    assert tok.chat_template is not None
    prompt = tok.apply_chat_template(CHAT)
    assert prompt == CHAT_PROMPT
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids == gemma3_reference.encode(prompt, add_special_tokens=False)
    # <bos>, then <start_of_turn> (105) and <end_of_turn> (106) whole; the prompt ends in "\n" (107).
    assert ids[:2] == [2, 105] and ids.count(105) == 4 and ids.count(106) == 3 and ids[-1] == 107
    assert tok.decode(ids) == prompt
