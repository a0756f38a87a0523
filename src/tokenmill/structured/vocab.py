"""The grammar library's view of a model's vocabulary, built from our GGUF tokenizer and cached per
tokenizer (one per loaded model).

llguidance only needs each id's exact bytes (Tokenizer.token_bytes already resolves byte-level BPE
spellings and SentencePiece byte fallback), which ids are special, and an encoder. Special tokens are
spelled with a leading 0xFF byte, llguidance's convention (as its llama.cpp bridge does): no grammar
can then produce them by accident, and they stay out of the token trie used for masks."""
from __future__ import annotations

import threading
import weakref

import llguidance

from tokenmill.tokenizer import Tokenizer

_SPECIAL_PREFIX = b"\xff"

_cache: "weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class _Vocabulary:
    """The duck-typed object llguidance.TokenizerWrapper reads (eos/bos ids, tokens, specials, a
    bytes -> ids encoder)."""

    def __init__(self, tokenizer: Tokenizer):
        specials = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        special_set = set(specials)
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.stop_ids, default=0)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = specials
        self.tokens = [_SPECIAL_PREFIX + tokenizer.token_bytes(i) if i in special_set else tokenizer.token_bytes(i)
                       for i in range(tokenizer.vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for `tokenizer`, built on first use (0.15 s for SmolLM2's 49k
    tokens, 1 s for Gemma's 262k) and kept as long as the tokenizer lives."""
    with _lock:
        cached = _cache.get(tokenizer)
        if cached is None:
            stop_ids = sorted(tokenizer.stop_ids) or None
            cached = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)),
                                            n_vocab=tokenizer.vocab_size, eos_token=stop_ids)
            _cache[tokenizer] = cached
        return cached
