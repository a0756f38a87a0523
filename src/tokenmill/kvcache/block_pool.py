"""Fixed-size KV blocks: ref counts, the free pool, the hash -> block prefix index, and the
tokens of cached blocks that prefix matches ending inside a block read (block_tails.py).

Only block ids live here; the K/V tensors are indexed by them elsewhere.
Every mutation goes through a few primitives that log their inverse into a Journal,
so a scheduler step can be undone exactly (see BlockManager.checkpoint).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.kvcache.block_tails import Tail, TailIndex, TailKey, TailMatch
from tokenmill.kvcache.prefix_hash import BlockHash


class NoFreeBlocksError(Exception):
    """Not enough free blocks; the operation that raised it changed nothing."""


class IntegrityError(AssertionError):
    """The block bookkeeping contradicts itself (a bug, never a load condition)."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is in the prefix index; kept after ref_count drops to 0 so
    # a later request can revive the block instead of recomputing it.
    block_hash: BlockHash | None = None
    # Set while the block's first tokens are in the tail index (block_tails.py): a full block in
    # the prefix index, or the partly filled last block of a finished sequence.
    tail: Tail | None = None

    @property
    def cached(self) -> bool:
        """Whether its content may still be read by a later request: it goes last from the pool."""
        return self.block_hash is not None or self.tail is not None


class Journal:
    """Undo log: (function, args) pairs replayed newest first. Inactive (and free)
    unless a checkpoint is open."""

    def __init__(self) -> None:
        self._undo: list[tuple[Callable[..., None], tuple[Any, ...]]] | None = None

    @property
    def active(self) -> bool:
        return self._undo is not None

    def __len__(self) -> int:
        return 0 if self._undo is None else len(self._undo)

    def start(self) -> None:
        self._undo = []

    def stop(self) -> None:
        self._undo = None

    def record(self, fn: Callable[..., None], *args: Any) -> None:
        # (fn, args) rather than a lambda: no late binding of loop variables.
        if self._undo is not None:
            self._undo.append((fn, args))

    def undo_all(self) -> None:
        undo = self._undo
        if undo is None:
            return
        # The inverses must not log themselves while we replay.
        self._undo = None
        try:
            while undo:
                fn, args = undo.pop()
                fn(*args)
        finally:
            self._undo = undo


# Free-pool priority: (is_cached, stamp). Uncached blocks are handed out first, so a
# cached block is evicted only when nothing else is left; among cached ones the
# least recently freed goes first (LRU). Stamps only ever increase.
_FreeKey = tuple[int, int]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, journal: Journal) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._journal = journal
        self._stamp = itertools.count()
        # The free pool is _free_key; the heap is only an index into it with lazy
        # deletion: an entry counts only if it still equals _free_key[block_id].
        # That makes removal from the middle (reviving a cached block) O(1) and lets
        # rollback put a block back at its exact old position.
        self._free_key: dict[int, _FreeKey] = {}
        self._heap: list[tuple[int, int, int]] = []
        for b in range(num_blocks):
            self._put_free_raw(b, (0, next(self._stamp)))
        self._hash_to_block: dict[BlockHash, int] = {}
        self._tails = TailIndex(num_blocks, block_size)

    # ---- queries -------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free_key)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free_key

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._hash_to_block.get(block_hash)

    def free_order(self) -> list[int]:
        """Free blocks in the order they would be handed out (debug/tests; O(n log n))."""
        return [b for b, _ in sorted(self._free_key.items(), key=lambda kv: kv[1])]

    def hash_index(self) -> dict[BlockHash, int]:
        return dict(self._hash_to_block)

    def longest_tail(self, key: TailKey, token_ids: list[int]) -> TailMatch | None:
        return self._tails.longest(key, token_ids)

    def tail_is_live(self, match: TailMatch) -> bool:
        tail = self.blocks[match.block_id].tail
        return tail is not None and tail.stamp == match.stamp

    def tail_snapshot(self) -> dict[int, tuple[TailKey, tuple[int, ...]]]:
        return self._tails.snapshot()

    # ---- operations ----------------------------------------------------------

    def take_free(self) -> int:
        """Hand out the highest-priority free block with ref_count 1, evicting its hash."""
        while self._heap:
            cached, stamp, b = self._heap[0]
            if self._free_key.get(b) == (cached, stamp):
                break
            heapq.heappop(self._heap)  # stale entry
        else:
            raise NoFreeBlocksError("no free KV blocks")
        self._drop_free(b)
        if self.blocks[b].block_hash is not None:
            self._set_hash(b, None)
        if self.blocks[b].tail is not None:
            self._set_tail(b, None)
        self._set_ref(b, 1)
        return b

    def acquire(self, block_id: int) -> None:
        """One more reference; a free (cached) block is revived out of the pool."""
        blk = self.blocks[block_id]
        if blk.ref_count == 0:
            self._drop_free(block_id)
        self._set_ref(block_id, blk.ref_count + 1)

    def release(self, block_id: int) -> None:
        """One reference fewer; at zero the block joins the free pool, hash kept."""
        blk = self.blocks[block_id]
        if blk.ref_count <= 0:
            raise IntegrityError(f"release of unreferenced block {block_id}")
        self._set_ref(block_id, blk.ref_count - 1)
        if blk.ref_count == 0:
            self._put_free(block_id, (int(blk.cached), next(self._stamp)))

    def register(self, block_id: int, block_hash: BlockHash, tail_key: TailKey | None = None,
                 token_ids: list[int] | None = None) -> bool:
        """Index a referenced full block under its hash (and its tokens under tail_key, when
        given). False (and no change) if the hash already names another block: two sequences
        computed the same content independently, and the first one stays canonical."""
        blk = self.blocks[block_id]
        if blk.ref_count == 0:
            raise IntegrityError(f"register of free block {block_id}")
        if blk.block_hash == block_hash:
            return True
        if blk.block_hash is not None:
            raise ValueError(
                f"block {block_id} is already cached under another hash: "
                "token_ids/extra_key disagree with what was committed before"
            )
        if block_hash in self._hash_to_block:
            return False
        self._set_hash(block_id, block_hash)
        if tail_key is not None and token_ids:
            self._set_tail(block_id, tail_key, token_ids)
        return True

    def set_tail(self, block_id: int, key: TailKey, token_ids: list[int]) -> None:
        """Index a referenced block's first tokens (its computed ones) under key, before the
        last reference goes: the block then stays in the pool as a cached one."""
        if self.blocks[block_id].ref_count == 0:
            raise IntegrityError(f"set_tail of free block {block_id}")
        self._set_tail(block_id, key, token_ids)

    def unregister(self, block_id: int) -> None:
        """Drop a referenced block from the index (its content is about to change)."""
        if self.blocks[block_id].ref_count == 0:
            # A free block's pool priority depends on its hash; never change it there.
            raise IntegrityError(f"unregister of free block {block_id}")
        if self.blocks[block_id].block_hash is not None:
            self._set_hash(block_id, None)
        if self.blocks[block_id].tail is not None:
            self._set_tail(block_id, None)

    # ---- journaled primitives -------------------------------------------------

    def _set_ref(self, b: int, value: int) -> None:
        self._journal.record(self._set_ref_raw, b, self.blocks[b].ref_count)
        self.blocks[b].ref_count = value

    def _set_ref_raw(self, b: int, value: int) -> None:
        self.blocks[b].ref_count = value

    def _put_free(self, b: int, key: _FreeKey) -> None:
        self._journal.record(self._drop_free_raw, b)
        self._put_free_raw(b, key)

    def _put_free_raw(self, b: int, key: _FreeKey) -> None:
        self._free_key[b] = key
        heapq.heappush(self._heap, (key[0], key[1], b))

    def _drop_free(self, b: int) -> None:
        self._journal.record(self._put_free_raw, b, self._free_key[b])
        self._drop_free_raw(b)

    def _drop_free_raw(self, b: int) -> None:
        del self._free_key[b]
        # Stale heap entries are skipped on pop; rebuild before they dominate.
        if len(self._heap) > 2 * len(self._free_key) + 64:
            self._heap = [(k[0], k[1], blk) for blk, k in self._free_key.items()]
            heapq.heapify(self._heap)

    def _set_hash(self, b: int, block_hash: BlockHash | None) -> None:
        self._journal.record(self._set_hash_raw, b, self.blocks[b].block_hash)
        self._set_hash_raw(b, block_hash)

    def _set_hash_raw(self, b: int, block_hash: BlockHash | None) -> None:
        blk = self.blocks[b]
        if blk.block_hash is not None:
            del self._hash_to_block[blk.block_hash]
        blk.block_hash = block_hash
        if block_hash is not None:
            self._hash_to_block[block_hash] = b

    def _set_tail(self, b: int, key: TailKey | None, token_ids: list[int] = ()) -> None:
        """key None: drop the block's entry."""
        if self._journal.active:
            self._journal.record(self._restore_tail, b, self.blocks[b].tail, self._tails.tokens(b))
        if key is None:
            self._tails.drop(b)
        else:
            self._tails.set(b, key, token_ids)
        self.blocks[b].tail = self._tails.get(b)

    def _restore_tail(self, b: int, tail: Tail | None, token_ids: tuple[int, ...]) -> None:
        self._tails.restore(b, tail, token_ids)
        self.blocks[b].tail = tail

    # ---- integrity -----------------------------------------------------------

    def check(self) -> None:
        """Raise IntegrityError on any internal contradiction of the pool itself."""
        for blk in self.blocks:
            b = blk.block_id
            if blk.ref_count < 0:
                raise IntegrityError(f"block {b} has negative ref_count {blk.ref_count}")
            free = b in self._free_key
            if free != (blk.ref_count == 0):
                where = "in" if free else "not in"
                raise IntegrityError(f"block {b} has ref_count {blk.ref_count} but is {where} the free pool")
            if free and self._free_key[b][0] != int(blk.cached):
                raise IntegrityError(f"free block {b} has a stale cached flag in its pool priority")
            if blk.block_hash is not None and self._hash_to_block.get(blk.block_hash) != b:
                raise IntegrityError(f"block {b} has a hash that the index maps elsewhere")
            if blk.tail is not self._tails.get(b):
                raise IntegrityError(f"block {b}'s tail is not the tail index's")
        for h, b in self._hash_to_block.items():
            if not 0 <= b < self.num_blocks or self.blocks[b].block_hash != h:
                raise IntegrityError(f"hash index names block {b}, which does not carry that hash")
        # Every free block must be reachable through the heap, or take_free loses it.
        live = {b for c, s, b in self._heap if self._free_key.get(b) == (c, s)}
        if live != set(self._free_key):
            missing = sorted(set(self._free_key) - live)
            raise IntegrityError(f"free blocks {missing[:10]} are unreachable in the free heap")
        problems = self._tails.check()
        if problems:
            raise IntegrityError(problems[0])
        keys = list(self._free_key.values())
        if len(set(keys)) != len(keys):
            raise IntegrityError("two free blocks share one position in the free order")
