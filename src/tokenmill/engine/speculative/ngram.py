"""Prompt lookup (n-gram) proposals: the context's last n tokens, found earlier in the same context,
propose the tokens that followed them there.

Much real output repeats its input (summaries, code edits, extraction, RAG answers) and itself (lists,
boilerplate). Finding the last n tokens again costs nothing next to a model step, and a proposal the
model does not agree with costs only the rows it took in that step (the engine verifies it).

The search is one vectorised pass over the context per step: the positions holding the last token,
narrowed to those preceded by the token before it, and so on up to max_n (the last few followed one
by one). A few microseconds for 8k tokens, no index to build (a dict of every n-gram took 28 ms and 10 MB for an 8k-token prompt). The
longest match wins (a longer match is likelier to continue the same way), and among equally long ones
the latest (recent text is likelier to be what is being copied now)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


# Occurrences few enough to follow one by one (NgramIndex.find).
_FEW = 16
# A token id no context holds: put between texts looked up together (a request's predicted output and
# its context), no match spans it, and a continuation stops before it (continuation).
SEPARATOR = -1


@dataclass(frozen=True)
class Match:
    start: int  # where the tokens after the earlier occurrence begin
    n: int      # the length of the suffix that matched


class NgramIndex:
    """The token ids of one growing context, kept as an array so that each lookup is vectorised; only
    the ids appended since the last call are copied in. The list must only grow (after anything else,
    make a new one)."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._ids = np.empty(0, dtype=np.int64)
        self._len = 0

    @property
    def num_indexed(self) -> int:
        return self._len

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest (up to max_n) suffix of token_ids at its latest
        earlier occurrence; [] when no suffix of at least min_n tokens occurred before."""
        match = self.find(token_ids)
        return continuation(token_ids, match, k) if match is not None and k > 0 else []

    def find(self, token_ids: Sequence[int]) -> Match | None:
        """The longest suffix of token_ids (min_n..max_n tokens) that occurred earlier, at its latest
        occurrence; None when there is none."""
        ids = self._follow(token_ids)
        n_ids = len(ids)
        if n_ids < 2:
            return None
        # Occurrences ending at p <= n_ids - 2 (the suffix itself ends at n_ids - 1), narrowed a token
        # at a time while there are many; the few left are followed one by one in Python, where each
        # numpy call (~1 us) would cost more than it saves: on bench speculative's contexts a lookup took
        # 6-22 us narrowing to the end, 3.5-6.6 us so.
        ends = np.flatnonzero(ids[:n_ids - 1] == ids[n_ids - 1])
        n = 1
        while ends.size > _FEW and n < self.max_n:
            narrowed = ends[ends >= n]  # room for one more token before the occurrence
            narrowed = narrowed[ids[narrowed - n] == ids[n_ids - 1 - n]]
            if not narrowed.size:
                break
            ends = narrowed
            n += 1
        if not ends.size:
            return None
        if n == self.max_n:  # all of them agree on max_n tokens (thousands, in a long repetitive text): the latest
            return Match(int(ends[-1]) + 1, n) if n >= self.min_n else None
        # Each occurrence left agrees on n tokens: how far does it go, up to max_n? The longest wins,
        # the latest among equals (ends ascend).
        last = n_ids - 1
        best_n, best_end = 0, -1
        for end in ends.tolist():
            length = n
            while length < self.max_n and end >= length and token_ids[end - length] == token_ids[last - length]:
                length += 1
            if length >= best_n:
                best_n, best_end = length, end
        return Match(best_end + 1, best_n) if best_n >= self.min_n else None

    def agreement(self, match: Match, limit: int) -> int:
        """How many of the context's last tokens agree with those before the match's `start`, up to
        `limit` (at least match.n, which find() stopped counting at max_n): a long agreement is text being
        copied, whose next tokens are far likelier to follow than a short match's. For the context find()
        was last given."""
        ids = self._ids[:self._len]
        span = min(limit, match.start)
        if span <= match.n:
            return min(match.n, limit)
        earlier = ids[match.start - span:match.start][::-1]
        latest = ids[self._len - span:][::-1]
        differ = np.flatnonzero(earlier != latest)
        return int(differ[0]) if differ.size else span

    def _follow(self, token_ids: Sequence[int]) -> np.ndarray:
        """The context as an array, copying in only what was appended since the last call."""
        n_ids = len(token_ids)
        if n_ids < self._len:
            raise ValueError("the token list shrank; an NgramIndex only follows a list that grows")
        if n_ids > self._ids.size:
            grown = np.empty(max(n_ids, 2 * self._ids.size, 256), dtype=np.int64)
            grown[:self._len] = self._ids[:self._len]
            self._ids = grown
        if n_ids > self._len:
            self._ids[self._len:n_ids] = token_ids[self._len:n_ids]
            self._len = n_ids
        return self._ids[:n_ids]


def continuation(token_ids: Sequence[int], match: Match, k: int) -> list[int]:
    """k tokens from the match's `start` on, as if the text went on repeating with the period the
    match implies (len(token_ids) - start): a match close to the end, in a loop like "ab ab ab", runs
    into the end of the context, and its continuation is the proposal's own beginning."""
    start = match.start
    n_ids = len(token_ids)
    out: list[int] = []
    for pos in range(start, start + k):
        token = token_ids[pos] if pos < n_ids else out[pos - n_ids]
        if token == SEPARATOR:  # the end of a text looked up before the context
            break
        out.append(token)
    return out
