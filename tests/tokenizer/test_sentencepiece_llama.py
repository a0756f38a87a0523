"""Llama-style SentencePiece tokenizers (Llama 2, Mistral 7B up to v0.3, TinyLlama: tokenizer.ggml.model
"llama" outside Gemma): ids and text identical to transformers for the same GGUF, merges recovered from
the scores as transformers recovers them, BOS by default, and a tiny Llama with such a vocabulary and a
Mistral-style [INST] template answering end to end."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_model import TinyLlamaSpec, write_tiny_llama
from tiny_spm import BYTE, CONTROL, NORMAL, write_tokenizer_gguf
from tokenizer.conftest import assert_parity, sentencepiece_reference
from tokenmill.tokenizer import Tokenizer, TokenizerError
from tokenmill.tokenizer.sentencepiece_llama import score_merges

# Llama 2's first ids (unk, bos, eos), Mistral v0.3's [INST] controls, the 256 bytes, then pieces whose
# scores rank their merges (Llama files: the piece's log probability, falling; ties among some).
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
PIECES = ["▁", "e", "t", "a", "o", "i", "n", "h", "l", "r", "s", "d", "c", "w", "u", "m", "y", "H", "W", ",", ".",
          "!", "?", "é", "日", "本", "▁t", "he", "▁th", "▁the", "in", "er", "▁a", "on", "ll", "el", "hel", "ell",
          "hello", "▁hello", "He", "Hel", "Hello", "▁w", "or", "▁wor", "ld", "▁world", "▁▁", "▁▁▁▁", "日本", "▁i",
          "▁in", "de", "▁de"]
TEXTS = ["hello world", " hello", "  two  spaces", "\nnew line", "Hello, world!", "héllo 日本語 🙂",
         "[INST] hi [/INST]", "<s>a</s>b<unk>c", "▁▁x ▁", "<0x41> <0xZZ>", "", " ", "x" * 200 + " y" * 30]
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] "
                    "+ ' [/INST]' }}{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}"
                    "{% endfor %}")


def llama_spm_metadata() -> dict[str, object]:
    tokens = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
    types = [2, CONTROL, CONTROL, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(PIECES)
    scores = [0.0] * (len(SPECIALS) + 256) + [-float(i // 2) for i in range(len(PIECES))]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = write_tokenizer_gguf(tmp_path_factory.mktemp("llama-spm") / "l.gguf", llama_spm_metadata(), arch="llama")
    return Tokenizer.from_file(path), sentencepiece_reference(path)


def test_parity_with_transformers(pair, corpus):
    ours, ref = pair
    assert_parity(ours, ref, [*corpus, *TEXTS])
    assert ours.add_bos and ours.encode("hi")[0] == 1  # no add_bos_token key: BOS, as llama.cpp and transformers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=8), st.sampled_from(
    ["[INST]", "[/INST]", "<s>", "</s>", " ", "  ", "\n", "hello", " the", "▁", "日本", "🙂", "é"])), max_size=8))
def test_parity_property(pair, pieces):
    ours, ref = pair
    text = "".join(pieces)
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids) == ref.decode(ids)


def test_merges_are_the_ones_transformers_recovers_from_the_scores(pair):
    meta = llama_spm_metadata()
    merges = json.loads(pair[1].backend_tokenizer.to_str())["model"]["merges"]
    assert score_merges(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]) == [tuple(m) for m in merges]


def test_a_file_that_turns_the_prefix_space_off_or_has_no_scores_is_refused():
    base = {**llama_spm_metadata(), "general.architecture": "llama"}
    with pytest.raises(TokenizerError, match="add_space_prefix=False is not supported"):
        Tokenizer.from_gguf_metadata({**base, "tokenizer.ggml.add_space_prefix": False})
    without = {k: v for k, v in base.items() if k != "tokenizer.ggml.scores"}
    with pytest.raises(TokenizerError, match="needs tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata(without)


def test_a_tiny_llama_with_this_vocabulary_chats_end_to_end(tmp_path):
    from tokenmill.engine import EngineConfig, SamplingParams
    from tokenmill.engine.llm import LLM
    from tokenmill.gguf.validate import validate_gguf

    meta = {**llama_spm_metadata(), "tokenizer.chat_template": MISTRAL_TEMPLATE}
    path = write_tiny_llama(tmp_path / "mistralish.gguf", TinyLlamaSpec(), chat_template=None, tokenizer=meta)
    assert validate_gguf(path, ("llama",)).architecture == "llama"  # a pushed file of this kind is taken
    llm = LLM(path, EngineConfig(dtype="fp32"))
    tok = llm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert prompt == "<s>[INST] hello world [/INST]"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [1, 3] and ids[-1] == 4  # <s>, [INST] ... [/INST], whole
    [out] = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 6 and torch.tensor(out.token_ids).lt(tok.vocab_size).all()
    # Greedy: the same tokens when it is asked again beside another prompt (batched).
    both = llm.generate([ids, tok.encode("hello")], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert both[0].token_ids == out.token_ids
