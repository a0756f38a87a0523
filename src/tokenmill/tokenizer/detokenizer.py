"""Turn a stream of generated token ids into text as it arrives, for streaming responses.

A byte-level token can end in the middle of a UTF-8 character (emoji and CJK often span two or three
tokens), so the bytes of an unfinished character are held back until the character is complete.
SentencePiece byte-fallback tokens (`<0xXX>`) are held back until their run ends, because decode()
reads a run as a whole (see `_end_run`). The pieces add up to exactly `tokenizer.decode(all_ids)`.
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
        self._run = bytearray()  # bytes of the byte-fallback tokens since the last other token

    def push(self, token_id: int) -> str:
        """The text completed by this token: empty while a character is still unfinished."""
        tok = self._tokenizer
        # decode() silently drops ids outside the vocabulary and, when asked, special tokens;
        # neither closes an unfinished character nor ends a run of byte-fallback tokens.
        if not 0 <= token_id < tok.vocab_size or (self._skip_special and tok.is_special(token_id)):
            return ""
        if tok.is_byte_fallback(token_id):
            self._run += tok.token_bytes(token_id)
            return ""
        # Added tokens too: decode() joins every token's bytes before turning them into text.
        return self._end_run() + self._utf8.decode(tok.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is held back, with an unfinished character replaced by U+FFFD."""
        text = self._end_run() + self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    def _end_run(self) -> str:
        # The ByteFallback decoder turns a run of byte tokens into its text when the whole run is valid
        # UTF-8, and otherwise into one U+FFFD per byte, even for the valid characters in it.
        run = bytes(self._run)
        self._run.clear()
        try:
            return run.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(run)
