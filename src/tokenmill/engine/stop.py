"""Stop strings, matched on the detokenized output as it streams.

A stop string can arrive split over any number of token deltas, so text that could still turn
into one is held back until it either completes (we stop, and it is never sent) or diverges (it
is released). Everything the matcher emits is final: the concatenation of all `emit`s is always a
prefix of the text before the first stop string, "first" meaning the first to complete (see
_earliest_match), so the result does not depend on how the text was split into deltas.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class StopResult:
    emit: str  # safe to send now: holds no stop string nor the start of one that may complete
    stopped: bool  # a stop string completed; `emit` ends right before it, the rest is dropped
    stop_string: str | None = None  # which one, when stopped


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]):
        # An empty stop string would match before any text; treat it as absent.
        self.stops: list[str] = [s for s in dict.fromkeys(stop) if s]
        self._held = ""
        self.stopped = False
        self.stop_string: str | None = None
        # Characters emitted so far: once stopped, the cut offset into the generated text (see
        # TokenTextTracker).
        self.emitted_chars = 0

    def push(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True, self.stop_string)
        if not self.stops:
            self.emitted_chars += len(text)
            return StopResult(text, False)
        buf = self._held + text
        # Held text is the longest suffix that is a prefix of some stop string, so no match can
        # start in text already emitted: searching buf is enough.
        hit = self._earliest_match(buf)
        if hit is not None:
            at, s = hit
            self._held = ""
            self.stopped = True
            self.stop_string = s
            self.emitted_chars += at
            return StopResult(buf[:at], True, s)
        keep = self._partial_suffix_len(buf)
        emit = buf[: len(buf) - keep]
        self._held = buf[len(buf) - keep :]
        self.emitted_chars += len(emit)
        return StopResult(emit, False)

    def flush(self) -> str:
        """The generation ended without a stop string: release whatever was held back."""
        if self.stopped:
            return ""
        out, self._held = self._held, ""
        self.emitted_chars += len(out)
        return out

    def _earliest_match(self, buf: str) -> tuple[int, str] | None:
        # The first stop string to *complete* wins, as if text arrived one character at a time:
        # that is the moment generation can end, and it does not depend on how the text was split
        # into deltas. Among those completing on the same character, the one starting earliest.
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            at = buf.find(s)
            if at >= 0 and (best is None or (at + len(s), at) < best[:2]):
                best = (at + len(s), at, s)
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, buf: str) -> int:
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:n]):
                    longest = n
                    break
        return longest


class TokenTextTracker:
    """Maps character offsets of the generated text back to tokens, to keep per-token logprobs
    aligned with text that was cut at a stop string.

    Rule: a token is kept iff its text starts before the cut, i.e. it contributes at least one
    character to the returned text (a token that is only partly before the stop string is kept).
    Tokens whose text lies entirely at or after the cut are dropped. Tokens that decode to ""
    (e.g. the first bytes of a multi-byte character) start where the next text starts, so they
    share the fate of the token that completes the character.

    llama.cpp's server (non-streaming) instead drops as many trailing tokens as the stop string
    tokenizes to, which miscounts when the stop string was generated with other token boundaries
    or when the stopping token also carried text before the stop string.

    The same rule works while streaming: with `emitted` characters sent, logprob entries
    [0, tokens_before(emitted)) can be sent; a later stop can only cut at or after `emitted`, so
    none of them is ever retracted.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._end = 0

    def add(self, piece: str) -> None:
        """Record the text one token produced (its detokenized delta, possibly empty)."""
        self._starts.append(self._end)
        self._end += len(piece)

    def __len__(self) -> int:
        return len(self._starts)

    def tokens_before(self, cut: int) -> int:
        """How many leading tokens have text starting before character offset `cut`."""
        return bisect.bisect_left(self._starts, cut)
