"""Prompt lookup (n-gram) proposals: the context's last n tokens, found earlier in the same context,
propose the tokens that followed them there.

Much real output repeats its input (summaries, code edits, extraction, RAG answers) and itself (lists,
boilerplate). Finding the last n tokens again costs nothing next to a model step, and a proposal the
model does not agree with costs only the rows it took in that step (the engine verifies it).

The index grows with the context, a few dict entries per token: for every n in [min_n, max_n] it maps
each n-gram to where the tokens after its latest occurrence start. A lookup tries the longest n first
(a longer match is likelier to continue the same way), and prefers the latest occurrence (recent text
is likelier to be what is being copied now)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Match:
    start: int  # where the tokens after the earlier occurrence begin
    n: int      # the length of the suffix that matched


class NgramIndex:
    """The n-grams of one growing token list. `propose` indexes whatever was appended since the last
    call, so each token is indexed once; the list must only grow (after anything else, make a new one)."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n = min_n
        self.max_n = max_n
        # n-gram -> position right after its latest indexed occurrence. Keys are tuples of n ids; the
        # sizes never collide because a tuple's length is part of its identity.
        self._follows: dict[tuple[int, ...], int] = {}
        # N-grams ending before this position are indexed. The one ending at the context's last token is
        # left out: it is the one being looked up, and nothing follows it yet.
        self._indexed_end = 0

    @property
    def num_indexed(self) -> int:
        return self._indexed_end

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest (up to max_n) suffix of token_ids at its latest
        earlier occurrence; [] when no suffix of at least min_n tokens occurred before."""
        match = self.find(token_ids)
        return continuation(token_ids, match, k) if match is not None and k > 0 else []

    def find(self, token_ids: Sequence[int]) -> Match | None:
        """The longest suffix of token_ids (min_n..max_n tokens) that occurred earlier, at its latest
        occurrence; None when there is none. Indexes what was appended since the last call."""
        n_ids = len(token_ids)
        if n_ids < self._indexed_end:
            raise ValueError("the token list shrank; an NgramIndex only follows a list that grows")
        self._index_until(token_ids, n_ids - 1)
        for n in range(min(self.max_n, n_ids - 1), self.min_n - 1, -1):
            start = self._follows.get(tuple(token_ids[n_ids - n:]))
            if start is not None:
                return Match(start, n)
        return None

    def _index_until(self, token_ids: Sequence[int], end: int) -> None:
        """Index the n-grams that end at positions [indexed_end, end): a later occurrence overwrites an
        earlier one, so each key points after its latest occurrence."""
        follows = self._follows
        for last in range(self._indexed_end, end):
            for n in range(self.min_n, min(self.max_n, last + 1) + 1):
                follows[tuple(token_ids[last + 1 - n:last + 1])] = last + 1
        self._indexed_end = max(self._indexed_end, end)


def continuation(token_ids: Sequence[int], match: Match, k: int) -> list[int]:
    """k tokens from the match's `start` on, as if the text went on repeating with the period the
    match implies (len(token_ids) - start): a match close to the end, in a loop like "ab ab ab", runs
    into the end of the context, and its continuation is the proposal's own beginning."""
    start = match.start
    n_ids = len(token_ids)
    out: list[int] = []
    for pos in range(start, start + k):
        out.append(token_ids[pos] if pos < n_ids else out[pos - n_ids])
    return out
