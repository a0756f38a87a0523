"""Turn a stream of generated token ids into text as it arrives, for streaming responses.

A byte-level token can end in the middle of a UTF-8 character (emoji and CJK often span two or three
tokens), so the bytes of an unfinished character are held back until the character is complete.
The pieces add up to exactly `tokenizer.decode(all_ids)`.
"""
from __future__ import annotations

import codecs

from tokenmill.tokenizer.tokenizer import Tokenizer

_Utf8Decoder = codecs.getincrementaldecoder("utf-8")


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Python's UTF-8 decoder replaces invalid bytes per maximal subpart, like Rust's
        # from_utf8_lossy that `tokenizers` uses, so both produce the same U+FFFD count.
        self._utf8 = _Utf8Decoder(errors="replace")

    def push(self, token_id: int) -> str:
        """The text completed by this token: empty while a character is still unfinished."""
        tok = self._tokenizer
        # decode() silently drops ids outside the vocabulary and, when asked, special tokens;
        # neither closes an unfinished character.
        if not 0 <= token_id < tok.vocab_size or (self._skip_special and tok.is_special(token_id)):
            return ""
        # Added tokens too: decode() joins every token's bytes before turning them into text.
        return self._utf8.decode(tok.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is held back, with an unfinished character replaced by U+FFFD."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
