"""Per-sequence block tables over a BlockPool: allocation, prefix reuse, fork and
copy-on-write, integrity checks, and checkpoint/rollback of a scheduler step.

Prefix reuse is token-granular: a match adopts the cached full blocks, then may end inside the
next block, whose K/V a cached block with the same first tokens (after the same prefix) gives
by copy into the sequence's own block (block_tails.py).

Token at position p of a sequence lives in block_table[p // block_size] at offset
p % block_size. The caller (the engine) owns the K/V tensors and the token lists;
this class only decides which block ids hold what.

Every mutating call is check-then-commit: it either raises before touching anything
or completes, so a failed call never leaves half an allocation behind.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.kvcache.block_pool import BlockPool, IntegrityError, Journal, NoFreeBlocksError
from tokenmill.kvcache.block_tails import TailKey, TailMatch
from tokenmill.kvcache.prefix_hash import BlockHash, hash_block


class StalePrefixError(ValueError):
    """A PrefixMatch no longer describes the cache (one of its blocks was evicted and
    reused since match_prefix). Match again right before allocating."""


@dataclass(frozen=True)
class PrefixMatch:
    block_ids: tuple[int, ...]  # cached full blocks, in order
    num_tokens: int  # len(block_ids) * block_size, plus partial.num_tokens
    # The keys the blocks were found under, so allocate() can tell a stale match from
    # a live one (a block id alone may have been evicted and refilled meanwhile).
    block_hashes: tuple[BlockHash, ...] = ()
    # A cached block whose first tokens are the next ones: allocate() has its K/V copied into
    # the sequence's first own block.
    partial: TailMatch | None = None


@dataclass(frozen=True)
class PrefixStats:
    """Prefix-cache effectiveness, counted when allocate() starts a sequence:
    queries = tokens that first allocate() asked for (the prompt, or its first chunk),
    hits = tokens of it covered by adopted cached blocks."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class Checkpoint:
    epoch: int


@dataclass(frozen=True)
class StateSnapshot:
    """Everything observable about the manager, for tests and debugging."""

    tables: dict[int, tuple[int, ...]]
    ref_counts: tuple[int, ...]
    free_order: tuple[int, ...]
    hash_index: dict[BlockHash, int]
    tails: dict[int, tuple[TailKey, tuple[int, ...]]]
    seq_hashes: dict[int, tuple[BlockHash, ...]]
    prefix_stats: PrefixStats


@dataclass
class _Seq:
    table: list[int] = field(default_factory=list)
    # Chained keys of this sequence's committed full blocks, whether or not the block
    # itself got into the index; kept so each commit hashes only the new blocks.
    hashes: list[BlockHash] = field(default_factory=list)
    extra_key: bytes | None = None


def _truncate(items: list, n: int) -> None:
    del items[n:]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, *, enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._journal = Journal()
        self._pool = BlockPool(num_blocks, block_size, self._journal)
        self._seqs: dict[int, _Seq] = {}
        self._stats = PrefixStats()
        self._epoch = 0

    # ---- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, including cached ones that could still be revived."""
        return self._pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._pool.num_free

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_table(self, seq_id: int) -> list[int]:
        seq = self._seqs.get(seq_id)
        return list(seq.table) if seq else []

    def num_tokens_allocated(self, seq_id: int) -> int:
        seq = self._seqs.get(seq_id)
        return len(seq.table) * self.block_size if seq else 0

    def prefix_stats(self) -> PrefixStats:
        return self._stats

    def cached_block_hashes(self, limit: int | None = None) -> list[BlockHash]:
        """Keys of the full blocks the prefix cache holds (in use or evictable), oldest
        registered first, at most the newest `limit`: what a router needs to send a
        request to the replica that already holds its prefix. The index is copied in one
        C-level call, so another thread may ask while the engine thread runs."""
        keys = list(self._pool.hash_index())
        if limit is None or limit >= len(keys):
            return keys
        return keys[len(keys) - max(limit, 0):]

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], extra_key: bytes = b"", *, partial: bool = True) -> PrefixMatch:
        """Longest run of cached full blocks at the start of token_ids, and (partial) the
        cached block that continues it furthest into the next block. Read-only.

        Never covers the last token: the caller must compute at least one position to
        get logits, so at most len-1 tokens match."""
        if not self.enable_prefix_caching:
            return PrefixMatch((), 0)
        bs = self.block_size
        ids: list[int] = []
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(max(0, (len(token_ids) - 1) // bs)):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], extra_key)
            b = self._pool.lookup(parent)
            if b is None:
                break
            ids.append(b)
            hashes.append(parent)
        start = len(ids) * bs
        tail = None
        if partial and start < len(token_ids) - 1:
            key = (hashes[-1] if hashes else None, extra_key)
            tail = self._pool.longest_tail(key, list(token_ids[start : min(start + bs, len(token_ids) - 1)]))
        return PrefixMatch(tuple(ids), start + (tail.num_tokens if tail else 0), tuple(hashes), tail)

    def _adoptable(self, seq: _Seq | None, prefix: PrefixMatch | None) -> tuple[int, ...]:
        """Prefix blocks allocate() would adopt; raises StalePrefixError if outdated."""
        if prefix is None or (seq is not None and seq.table):
            # A sequence that already has blocks has computed its own prefix.
            return ()
        if prefix.partial is not None and not self._pool.tail_is_live(prefix.partial):
            raise StalePrefixError(f"prefix block {prefix.partial.block_id} changed since match_prefix")
        if prefix.block_hashes and len(prefix.block_hashes) != len(prefix.block_ids):
            raise ValueError("PrefixMatch.block_hashes does not match block_ids")
        for i, b in enumerate(prefix.block_ids):
            h = self._pool.blocks[b].block_hash
            if h is None or (prefix.block_hashes and prefix.block_hashes[i] != h):
                raise StalePrefixError(f"prefix block {b} was evicted since match_prefix")
        return prefix.block_ids

    # ---- allocation ----------------------------------------------------------

    def _plan(self, seq_id: int, num_tokens: int, prefix: PrefixMatch | None) -> tuple[tuple[int, ...], int, int]:
        """(blocks to adopt, fresh blocks to take, free blocks consumed in total)."""
        seq = self._seqs.get(seq_id)
        adopt = self._adoptable(seq, prefix)
        have = len(seq.table) if seq else 0
        fresh = max(0, self._blocks_for(num_tokens) - max(have, len(adopt)))
        # A cached block sitting in the free pool leaves it when revived, so it costs
        # a free block just like a fresh one.
        revived = sum(1 for b in adopt if self._pool.is_free(b))
        return adopt, fresh, fresh + revived

    def can_allocate(self, seq_id: int, num_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Could seq_id's table grow to hold num_tokens tokens in total?"""
        return self._plan(seq_id, num_tokens, prefix)[2] <= self._pool.num_free

    def allocate(self, seq_id: int, num_tokens: int, prefix: PrefixMatch | None = None) -> list[tuple[int, int]]:
        """Grow seq_id's table to cover num_tokens tokens (never shrinks).

        A new sequence (no blocks yet) first adopts prefix's cached blocks; for one
        that has blocks the prefix is ignored. Returns the (src, dst) block pairs whose
        K/V the caller must copy before the sequence writes: a partial match's block
        into the sequence's first own block (prefix.num_tokens must not exceed num_tokens).
        Raises NoFreeBlocksError, changing nothing, if the blocks are not there."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        adopt, fresh, cost = self._plan(seq_id, num_tokens, prefix)
        if cost > self._pool.num_free:
            raise NoFreeBlocksError(
                f"seq {seq_id} needs {cost} free blocks for {num_tokens} tokens, {self._pool.num_free} free"
            )
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _Seq()
            self._journal.record(self._seqs.pop, seq_id)
        starting = not seq.table
        self._journal.record(_truncate, seq.table, len(seq.table))
        self._journal.record(_truncate, seq.hashes, len(seq.hashes))
        for b in adopt:
            self._pool.acquire(b)
            seq.table.append(b)
            seq.hashes.append(self._pool.blocks[b].block_hash)
        for _ in range(fresh):
            seq.table.append(self._pool.take_free())
        # The copy's source may be among the blocks just taken (a cached block is evicted last,
        # but evicted all the same): its K/V is still there until the step writes, and the caller
        # copies before any write of the step.
        partial = prefix.partial if starting and prefix is not None and len(seq.table) > len(adopt) else None
        if starting and num_tokens > 0 and self.enable_prefix_caching:
            hits = len(adopt) * self.block_size + (partial.num_tokens if partial else 0)
            self._set_stats(PrefixStats(self._stats.queries + num_tokens, self._stats.hits + hits))
        return [(partial.block_id, seq.table[len(adopt)])] if partial else []

    def has_uncommitted(self, seq_id: int, num_computed_tokens: int) -> bool:
        """Whether commit_full_blocks would index anything: a block filled up since the last commit.
        Lets the scheduler skip joining a sequence's token list on the steps (most) where none did."""
        seq = self._seqs.get(seq_id)
        return seq is not None and self.enable_prefix_caching and num_computed_tokens // self.block_size > len(seq.hashes)

    def commit_full_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int, extra_key: bytes = b""
    ) -> None:
        """Index the sequence's blocks that are now full and computed, so later prompts
        can reuse them. token_ids is the sequence's whole token list. Idempotent."""
        seq = self._seqs.get(seq_id)
        if seq is None or not self.enable_prefix_caching:
            return
        if seq.extra_key is None:
            self._journal.record(setattr, seq, "extra_key", None)
            seq.extra_key = extra_key
        elif seq.extra_key != extra_key:
            raise ValueError(f"seq {seq_id} committed with a different extra_key before")
        bs = self.block_size
        n_full = min(min(num_computed_tokens, len(token_ids)) // bs, len(seq.table))
        if n_full <= len(seq.hashes):
            return
        self._journal.record(_truncate, seq.hashes, len(seq.hashes))
        for i in range(len(seq.hashes), n_full):
            parent = seq.hashes[-1] if seq.hashes else None
            tokens = token_ids[i * bs : (i + 1) * bs]
            h = hash_block(parent, tokens, extra_key)
            self._pool.register(seq.table[i], h, (parent, extra_key), tokens)
            seq.hashes.append(h)

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Shrink seq_id's table to the blocks that hold its first num_tokens tokens, releasing
        the rest (tail first): what a step wrote past them is void (rejected speculative
        tokens). Released blocks keep their prefix-cache keys, as with free(): a key is only
        ever given to a full block of computed tokens, which a write past them cannot touch.
        Never grows the table; unknown ids: no-op."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        seq = self._seqs.get(seq_id)
        keep = self._blocks_for(num_tokens)
        if seq is None or len(seq.table) <= keep:
            return
        dropped = seq.table[keep:]
        self._journal.record(seq.table.extend, dropped)
        _truncate(seq.table, keep)
        if len(seq.hashes) > keep:
            self._journal.record(seq.hashes.extend, seq.hashes[keep:])
            _truncate(seq.hashes, keep)
        for b in reversed(dropped):
            self._pool.release(b)

    def free(self, seq_id: int, token_ids: Sequence[int] | None = None, num_computed_tokens: int = 0,
             extra_key: bytes = b"") -> None:
        """Drop the sequence; its blocks lose one reference each. Unknown ids: no-op.

        With token_ids (the sequence's tokens, of which the first num_computed_tokens have their
        K/V in its blocks), a last block they fill only in part, held by this sequence alone, stays
        cached for a later prompt to continue (a conversation's next turn)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._journal.record(self._seqs.__setitem__, seq_id, seq)
        if token_ids is not None and self.enable_prefix_caching:
            self._keep_tail(seq, token_ids, num_computed_tokens, extra_key)
        # Tail first: freed blocks queue in this order, so a prompt's last blocks are
        # evicted before its first ones (a tail block is useless without its prefix).
        for b in reversed(seq.table):
            self._pool.release(b)

    def _keep_tail(self, seq: _Seq, token_ids: Sequence[int], num_computed_tokens: int, extra_key: bytes) -> None:
        bs = self.block_size
        i, n = divmod(min(num_computed_tokens, len(token_ids)), bs)
        if not n or i >= len(seq.table) or len(seq.hashes) != i:
            return  # block-aligned, or its full blocks are not all indexed (a chain key is missing)
        b = seq.table[i]
        if self._pool.blocks[b].ref_count != 1 or self._pool.blocks[b].block_hash is not None:
            return  # a sibling still shares it and may write into it
        if seq.extra_key is not None and seq.extra_key != extra_key:
            raise ValueError("free: extra_key differs from the one the sequence committed with")
        key: TailKey = (seq.hashes[-1] if seq.hashes else None, extra_key)
        self._pool.set_tail(b, key, list(token_ids[i * bs : i * bs + n]))

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """child shares every block of parent (parallel samples). Needs no free block:
        divergence is paid for later by prepare_write."""
        parent = self._seqs.get(parent_seq_id)
        if parent is None:
            raise KeyError(f"fork of unknown seq {parent_seq_id}")
        if child_seq_id in self._seqs:
            raise ValueError(f"fork target seq {child_seq_id} already exists")
        for b in parent.table:
            self._pool.acquire(b)
        self._seqs[child_seq_id] = _Seq(list(parent.table), list(parent.hashes), parent.extra_key)
        self._journal.record(self._seqs.pop, child_seq_id)

    def writable(self, seq_id: int, num_tokens: int, first_pos: int) -> bool:
        """Whether seq_id's table already holds num_tokens tokens and every block from first_pos on
        is its own and unindexed: then allocate() and prepare_write() would change nothing (the
        scheduler's fast path for a decode row inside its last block)."""
        seq = self._seqs.get(seq_id)
        if seq is None or len(seq.table) < self._blocks_for(num_tokens):
            return False
        start = max(0, first_pos) // self.block_size
        if len(seq.hashes) > start:
            return False
        blocks = self._pool.blocks
        for b in seq.table[start:]:  # a loop, not all(<generator>): this runs for every decode row, every step
            block = blocks[b]
            if block.ref_count != 1 or block.block_hash is not None or block.tail is not None:
                return False
        return True

    # ---- copy-on-write -------------------------------------------------------

    def _shared_targets(self, seq: _Seq, first_pos: int) -> list[int]:
        start = max(0, first_pos) // self.block_size
        return [i for i in range(start, len(seq.table)) if self._pool.blocks[seq.table[i]].ref_count > 1]

    def can_prepare_write(self, seq_id: int, first_pos: int) -> bool:
        seq = self._seqs.get(seq_id)
        return seq is None or len(self._shared_targets(seq, first_pos)) <= self._pool.num_free

    def prepare_write(self, seq_id: int, first_pos: int) -> list[tuple[int, int]]:
        """Make every block the sequence will write into (from first_pos to the end of
        its table) private to it. Returns (src, dst) block pairs whose K/V the caller
        must copy before writing. Raises NoFreeBlocksError, changing nothing, if there
        are not enough free blocks for the copies."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return []
        targets = self._shared_targets(seq, first_pos)
        if len(targets) > self._pool.num_free:
            raise NoFreeBlocksError(f"seq {seq_id} needs {len(targets)} blocks for copy-on-write")
        pairs: list[tuple[int, int]] = []
        for i in targets:
            src = seq.table[i]
            dst = self._pool.take_free()
            self._pool.release(src)  # still > 0: the other sharers keep it
            self._journal.record(seq.table.__setitem__, i, src)
            seq.table[i] = dst
            pairs.append((src, dst))
        start = max(0, first_pos) // self.block_size
        # From `start` on, this sequence's content is about to change: its chain keys
        # no longer hold, and a block still indexed that it alone owns would be
        # advertising content it is overwriting.
        if len(seq.hashes) > start:
            self._journal.record(seq.hashes.extend, seq.hashes[start:])
            _truncate(seq.hashes, start)
        for b in seq.table[start:]:
            self._pool.unregister(b)
        return pairs

    # ---- checkpoint / rollback -----------------------------------------------

    def checkpoint(self) -> Checkpoint:
        """Start recording an undo log. rollback(cp) then restores the exact state of
        this moment (tables, ref counts, free order, hash index, stats) in
        O(changes since). Only the newest checkpoint is live: taking one supersedes
        the previous, which bounds the log to one scheduler step. The checkpoint stays
        live after a rollback, until the next checkpoint() or release_checkpoint()."""
        self._epoch += 1
        self._journal.start()
        return Checkpoint(self._epoch)

    def rollback(self, cp: Checkpoint) -> None:
        self._require_live(cp)
        self._journal.undo_all()

    def release_checkpoint(self, cp: Checkpoint) -> None:
        """Keep everything since cp and stop recording (not needed if the caller takes
        a new checkpoint each step anyway)."""
        self._require_live(cp)
        self._journal.stop()
        self._epoch += 1

    def _require_live(self, cp: Checkpoint) -> None:
        if cp.epoch != self._epoch or not self._journal.active:
            raise ValueError(f"checkpoint {cp.epoch} is no longer live (current {self._epoch})")

    def _set_stats(self, stats: PrefixStats) -> None:
        self._journal.record(setattr, self, "_stats", self._stats)
        self._stats = stats

    # ---- integrity -----------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise IntegrityError naming the first contradiction found. O(blocks + table
        entries); meant for tests and debug builds, not every step in production."""
        self._pool.check()
        refs = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            if len(set(seq.table)) != len(seq.table):
                raise IntegrityError(f"seq {seq_id} holds a block twice: {seq.table}")
            if len(seq.hashes) > len(seq.table):
                raise IntegrityError(f"seq {seq_id} has {len(seq.hashes)} block keys for {len(seq.table)} blocks")
            for b in seq.table:
                if not 0 <= b < self.num_blocks:
                    raise IntegrityError(f"seq {seq_id} holds nonexistent block {b}")
                refs[b] += 1
        for blk in self._pool.blocks:
            if blk.ref_count != refs[blk.block_id]:
                raise IntegrityError(
                    f"block {blk.block_id} has ref_count {blk.ref_count} "
                    f"but {refs[blk.block_id]} table entries point at it"
                )

    def state_snapshot(self) -> StateSnapshot:
        return StateSnapshot(
            tables={s: tuple(q.table) for s, q in self._seqs.items()},
            ref_counts=tuple(b.ref_count for b in self._pool.blocks),
            free_order=tuple(self._pool.free_order()),
            hash_index=self._pool.hash_index(),
            tails=self._pool.tail_snapshot(),
            seq_hashes={s: tuple(q.hashes) for s, q in self._seqs.items()},
            prefix_stats=self._stats,
        )
