"""The tokens at the start of cached blocks, for prefix matches that end inside a block.

The prefix index (block_pool.py) keys whole blocks, so a prompt that shares 100 tokens with a
cached one reuses only the full blocks among them and computes the rest again: up to
block_size - 1 tokens a request, the tail of a shared system prompt or of the previous turn
of a conversation. This index finds, among the cached blocks that follow a given parent (the
same chained key as the block before), the one whose first tokens agree longest with the new
prompt's next tokens; the new sequence gets its own block with a copy of that one's K/V, and
computes only from where they differ. Its entries are full blocks in the prefix index and the
last, partly filled block of a sequence that finished (its computed tokens only).

Keys are (parent block key or None, extra_key); each key's blocks are a set, and their tokens
rows of one array, so a lookup compares all candidates in a few vector operations."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenmill.kvcache.prefix_hash import BlockHash

TailKey = tuple[BlockHash | None, bytes]


@dataclass(frozen=True)
class Tail:
    key: TailKey
    num_tokens: int
    stamp: int  # changes whenever the entry does: what a match checks to know it is still live


@dataclass(frozen=True)
class TailMatch:
    block_id: int
    num_tokens: int
    stamp: int


class TailIndex:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._tokens = np.zeros((num_blocks, block_size), dtype=np.int64)
        self._lengths = np.zeros(num_blocks, dtype=np.int64)
        self._tails: list[Tail | None] = [None] * num_blocks
        self._by_key: dict[TailKey, set[int]] = {}
        self._stamps = itertools.count(1)

    def get(self, block_id: int) -> Tail | None:
        return self._tails[block_id]

    def tokens(self, block_id: int) -> tuple[int, ...]:
        tail = self._tails[block_id]
        return tuple(self._tokens[block_id, :tail.num_tokens].tolist()) if tail else ()

    def set(self, block_id: int, key: TailKey, token_ids: Sequence[int]) -> None:
        n = len(token_ids)
        if not 0 < n <= self.block_size:
            raise ValueError(f"a block's tail holds 1..{self.block_size} tokens, got {n}")
        self.drop(block_id)
        self._tokens[block_id, :n] = token_ids
        self._lengths[block_id] = n
        self._tails[block_id] = Tail(key, n, next(self._stamps))
        self._by_key.setdefault(key, set()).add(block_id)

    def restore(self, block_id: int, tail: Tail | None, token_ids: Sequence[int]) -> None:
        """Put back an entry exactly as it was, stamp included (undo of set or drop)."""
        self.drop(block_id)
        if tail is None:
            return
        self._tokens[block_id, :tail.num_tokens] = token_ids
        self._lengths[block_id] = tail.num_tokens
        self._tails[block_id] = tail
        self._by_key.setdefault(tail.key, set()).add(block_id)

    def drop(self, block_id: int) -> None:
        tail = self._tails[block_id]
        if tail is None:
            return
        self._tails[block_id] = None
        self._lengths[block_id] = 0
        blocks = self._by_key[tail.key]
        blocks.discard(block_id)
        if not blocks:
            del self._by_key[tail.key]

    def longest(self, key: TailKey, token_ids: Sequence[int]) -> TailMatch | None:
        """The entry under key whose tokens start like token_ids (at most a block of them) for
        longest, with how many agree; None when none agrees on even the first."""
        blocks = self._by_key.get(key)
        n = min(len(token_ids), self.block_size)
        if not blocks or n == 0:
            return None
        ids = np.fromiter(blocks, dtype=np.int64, count=len(blocks))
        same = self._tokens[ids, :n] == np.asarray(token_ids[:n], dtype=np.int64)
        agree = np.where(same.all(axis=1), n, same.argmin(axis=1))
        agree = np.minimum(agree, self._lengths[ids])
        best = int(agree.argmax())
        if agree[best] == 0:
            return None
        block_id = int(ids[best])
        return TailMatch(block_id, int(agree[best]), self._tails[block_id].stamp)

    def check(self) -> list[str]:
        """Contradictions between the per-block entries and the per-key sets (empty: none)."""
        problems = []
        for b, tail in enumerate(self._tails):
            if tail is None:
                if self._lengths[b]:
                    problems.append(f"block {b} has no tail but a tail length")
            elif b not in self._by_key.get(tail.key, ()) or self._lengths[b] != tail.num_tokens:
                problems.append(f"block {b}'s tail is not indexed as it is")
        for key, blocks in self._by_key.items():
            if not blocks or any(self._tails[b] is None or self._tails[b].key != key for b in blocks):
                problems.append(f"tail key {key!r} names blocks that do not carry it")
        return problems

    def snapshot(self) -> dict[int, tuple[TailKey, tuple[int, ...]]]:
        return {b: (t.key, self.tokens(b)) for b, t in enumerate(self._tails) if t is not None}
