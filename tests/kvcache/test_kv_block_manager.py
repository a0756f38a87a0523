import pytest

from tokenmill.kvcache import (
    BlockManager,
    IntegrityError,
    NoFreeBlocksError,
    PrefixMatch,
    PrefixStats,
    StalePrefixError,
    hash_blocks,
)

BS = 4


def toks(n, start=0):
    return list(range(start, start + n))


def run_prompt(bm, seq_id, tokens, extra_key=b""):
    """What the engine does for a new prompt: match, allocate, 'compute', commit."""
    m = bm.match_prefix(tokens, extra_key)
    bm.allocate(seq_id, len(tokens), m)
    bm.commit_full_blocks(seq_id, tokens, len(tokens), extra_key)
    bm.check_integrity()
    return m


# ---- allocation / ref counts ----------------------------------------------------


def test_allocate_grow_and_free():
    bm = BlockManager(8, BS)
    assert bm.block_table(1) == [] and bm.num_tokens_allocated(1) == 0
    bm.allocate(1, 5)
    assert bm.block_table(1) == [0, 1]
    assert bm.num_tokens_allocated(1) == 8
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.usage()) == (6, 2, 0.25)
    bm.allocate(1, 8)  # still fits: no new block
    assert len(bm.block_table(1)) == 2
    bm.allocate(1, 9)
    assert len(bm.block_table(1)) == 3
    bm.allocate(1, 3)  # never shrinks
    assert len(bm.block_table(1)) == 3
    bm.check_integrity()
    bm.free(1)
    bm.free(1)  # unknown seq: no-op
    assert bm.num_free_blocks == 8 and bm.block_table(1) == []
    bm.check_integrity()


def test_block_table_is_a_copy():
    bm = BlockManager(4, BS)
    bm.allocate(1, 4)
    bm.block_table(1).append(3)
    assert bm.block_table(1) == [0]


def test_cannot_allocate_changes_nothing():
    bm = BlockManager(4, BS)
    bm.allocate(1, 12)
    before = bm.state_snapshot()
    assert bm.can_allocate(2, 4)
    assert not bm.can_allocate(2, 5)
    assert not bm.can_allocate(1, 17)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2, 5)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1, 17)
    assert bm.state_snapshot() == before
    assert 2 not in bm.state_snapshot().tables


# ---- prefix cache ------------------------------------------------------------------


def test_prefix_shared_while_owner_lives():
    bm = BlockManager(16, BS)
    prompt = toks(10)
    assert run_prompt(bm, 1, prompt).num_tokens == 0
    t1 = bm.block_table(1)
    m = bm.match_prefix(prompt + [99, 98])
    assert m.block_ids == tuple(t1[:2]) and m.num_tokens == 8
    used = bm.num_used_blocks
    bm.allocate(2, 12, m)
    assert bm.block_table(2)[:2] == t1[:2]
    assert bm.num_used_blocks == used + 1  # only the third block is new
    bm.check_integrity()
    assert bm.state_snapshot().ref_counts[t1[0]] == 2
    assert bm.prefix_stats() == PrefixStats(queries=10 + 12, hits=8)


def test_prefix_survives_free_and_revives_from_lru():
    bm = BlockManager(8, BS)
    prompt = toks(12)
    run_prompt(bm, 1, prompt)
    t1 = bm.block_table(1)
    bm.free(1)
    assert bm.num_free_blocks == 8
    m = bm.match_prefix(prompt + [7])
    assert m.block_ids == tuple(t1)  # all three full blocks, from the free pool
    # Reviving costs free blocks: 3 revived + 1 fresh.
    assert bm.can_allocate(2, 13, m)
    bm.allocate(2, 13, m)
    assert bm.block_table(2)[:3] == t1
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_revived_blocks_count_against_free_space():
    bm = BlockManager(4, BS)
    prompt = toks(12)
    run_prompt(bm, 1, prompt)
    bm.free(1)
    m = bm.match_prefix(prompt + [1, 2, 3, 4, 5])  # 3 cached + needs 2 fresh = 5 > 4
    assert len(m.block_ids) == 3
    assert bm.can_allocate(2, 16, m)  # 3 revived + 1 fresh
    assert not bm.can_allocate(2, 17, m)
    before = bm.state_snapshot()
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2, 17, m)
    assert bm.state_snapshot() == before


def test_uncached_free_blocks_are_used_before_evicting_cached_ones():
    bm = BlockManager(6, BS)
    run_prompt(bm, 1, toks(8))  # 2 cached full blocks
    bm.free(1)
    bm.allocate(2, 16)  # the 4 never-cached blocks
    assert bm.match_prefix(toks(9)).num_tokens == 8
    bm.allocate(2, 20)  # pressure: evicts the LRU cached block
    m = bm.match_prefix(toks(9))
    assert m.num_tokens < 8
    bm.allocate(2, 24)
    assert bm.match_prefix(toks(9)).num_tokens == 0
    assert bm.state_snapshot().hash_index == {}
    bm.check_integrity()


def test_eviction_takes_tail_blocks_first():
    bm = BlockManager(4, BS)
    prompt = toks(16)
    run_prompt(bm, 1, prompt)
    bm.free(1)
    bm.allocate(2, 4)  # one block must be evicted: the chain's last one
    assert bm.match_prefix(prompt + [0]).num_tokens == 12


def test_match_never_covers_the_last_token():
    bm = BlockManager(8, BS)
    prompt = toks(8)
    run_prompt(bm, 1, prompt)
    whole = {"partial": False}
    assert bm.match_prefix(prompt, **whole).num_tokens == 4  # exactly 2 full blocks cached, only 1 usable
    assert bm.match_prefix(prompt[:4], **whole).num_tokens == 0
    assert bm.match_prefix(prompt[:5], **whole).num_tokens == 4
    assert bm.match_prefix(prompt + [0], **whole).num_tokens == 8
    assert bm.match_prefix([]).num_tokens == 0
    # Token-granular: into the next cached block, still short of the last token.
    assert bm.match_prefix(prompt).num_tokens == 7
    assert bm.match_prefix(prompt[:4]).num_tokens == 3
    assert bm.match_prefix(prompt[:5]).num_tokens == 4
    assert bm.match_prefix(prompt + [0]).num_tokens == 8


def test_match_is_read_only_and_keyed_by_extra_key():
    bm = BlockManager(8, BS)
    run_prompt(bm, 1, toks(9), extra_key=b"model-a")
    before = bm.state_snapshot()
    assert bm.match_prefix(toks(9), b"model-a").num_tokens == 8
    assert bm.match_prefix(toks(9), b"model-b").num_tokens == 0
    assert bm.match_prefix(toks(9)).num_tokens == 0
    assert bm.match_prefix([0, 1, 2, 9, 4, 5, 6, 7, 8], b"model-a", partial=False).num_tokens == 0
    assert bm.match_prefix([0, 1, 2, 9, 4, 5, 6, 7, 8], b"model-a").num_tokens == 3  # into block 0
    assert bm.match_prefix([0, 1, 2, 9, 4, 5, 6, 7, 8], b"model-b").num_tokens == 0
    assert bm.state_snapshot() == before


def test_commit_is_incremental_and_idempotent():
    bm = BlockManager(8, BS)
    tokens = toks(10)
    bm.allocate(1, 10)
    bm.commit_full_blocks(1, tokens, 3)
    assert bm.state_snapshot().hash_index == {}
    bm.commit_full_blocks(1, tokens, 6)
    assert len(bm.state_snapshot().hash_index) == 1
    bm.commit_full_blocks(1, tokens, 10)
    snap = bm.state_snapshot()
    bm.commit_full_blocks(1, tokens, 10)
    bm.commit_full_blocks(1, tokens, 8)
    assert bm.state_snapshot() == snap and len(snap.hash_index) == 2
    # Decode: grow one token at a time; the third block is indexed once it fills.
    for n in (11, 12):
        tokens.append(100 + n)
        bm.allocate(1, n)
        bm.commit_full_blocks(1, tokens, n)
    assert len(bm.state_snapshot().hash_index) == 3
    assert bm.match_prefix(tokens + [0]).num_tokens == 12
    bm.check_integrity()


def test_duplicate_content_keeps_the_first_block_canonical():
    bm = BlockManager(8, BS)
    bm.allocate(1, 5)
    bm.allocate(2, 5)  # same prompt, computed independently in the same step
    bm.commit_full_blocks(1, toks(5), 5)
    bm.commit_full_blocks(2, toks(5), 5)
    canonical = bm.block_table(1)[0]
    assert bm.match_prefix(toks(5)).block_ids == (canonical,)
    assert len(bm.state_snapshot().hash_index) == 1
    bm.free(1)
    assert bm.match_prefix(toks(5)).block_ids == (canonical,)  # from the free pool
    bm.check_integrity()


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    run_prompt(bm, 1, toks(9))
    assert bm.match_prefix(toks(9)) == PrefixMatch((), 0)
    assert bm.state_snapshot().hash_index == {}
    assert bm.prefix_stats() == PrefixStats(0, 0)


def test_stale_prefix_is_refused():
    bm = BlockManager(3, BS)
    run_prompt(bm, 1, toks(9))  # 2 cached blocks + 1
    bm.free(1)
    m = bm.match_prefix(toks(9))
    assert m.num_tokens == 8
    bm.allocate(2, 12)  # takes every block, evicting the cached ones
    bm.free(2)
    with pytest.raises(StalePrefixError):
        bm.can_allocate(3, 9, m)
    with pytest.raises(StalePrefixError):
        bm.allocate(3, 9, m)


# ---- prefixes that end inside a block ---------------------------------------------


def test_a_match_into_a_cached_full_block_copies_it():
    bm = BlockManager(8, BS)
    run_prompt(bm, 1, toks(12))  # 3 full blocks, all cached
    other = toks(6) + [99, 98, 97]  # 1 block and 2 tokens of the 2nd shared
    m = bm.match_prefix(other)
    assert (m.block_ids, m.num_tokens) == ((0,), 6) and (m.partial.block_id, m.partial.num_tokens) == (1, 2)
    copies = bm.allocate(2, len(other), m)
    table = bm.block_table(2)
    assert table[0] == 0 and table[1] not in (0, 1, 2) and copies == [(1, table[1])]
    assert bm.prefix_stats().hits == 6
    assert bm.prepare_write(2, 6) == []  # the copy is its own block: nothing shared to write into
    bm.check_integrity()


def test_a_finished_sequence_keeps_its_partly_filled_block():
    bm = BlockManager(8, BS)
    turn = toks(10)
    run_prompt(bm, 1, turn)
    bm.free(1, turn, 10)  # blocks 0, 1 full and indexed; block 2 holds tokens 8, 9
    assert bm.state_snapshot().tails[2] == ((hash_blocks(turn, BS)[-1], b""), (8, 9))
    order = bm.state_snapshot().free_order
    assert set(order[-3:]) == {0, 1, 2}  # cached ones go last, the partly filled one among them
    follow_up = turn + [50, 51]
    m = bm.match_prefix(follow_up)
    assert m.num_tokens == 10 and m.partial.block_id == 2
    assert bm.allocate(2, len(follow_up), m) == [(2, bm.block_table(2)[2])]
    bm.check_integrity()


def test_no_partly_filled_block_is_kept_while_shared_or_unindexed():
    bm = BlockManager(8, BS)
    turn = toks(10)
    run_prompt(bm, 1, turn)
    bm.fork(1, 2)
    bm.free(1, turn, 10)  # seq 2 still holds block 2 and may write into it
    assert 2 not in bm.state_snapshot().tails
    bm.free(2)
    bm.allocate(3, 6)  # computed, never committed: no chain key for its 2nd block
    bm.free(3, toks(6, 40), 6)
    assert set(bm.state_snapshot().tails) == {0, 1}  # the full blocks seq 1 committed
    bm.check_integrity()


def test_a_partial_match_whose_block_was_reused_is_stale():
    bm = BlockManager(3, BS)
    run_prompt(bm, 1, toks(6))
    bm.free(1, toks(6), 6)
    m = bm.match_prefix(toks(6) + [7])
    assert m.partial is not None and m.num_tokens == 6
    bm.allocate(2, 12)  # every block, evicting the cached ones
    bm.free(2)
    with pytest.raises(StalePrefixError):
        bm.allocate(3, 7, m)
    assert bm.match_prefix(toks(6) + [7]).num_tokens == 0


def test_prefix_is_ignored_for_a_sequence_that_has_blocks():
    bm = BlockManager(8, BS)
    run_prompt(bm, 1, toks(9))
    m = bm.match_prefix(toks(9))
    bm.allocate(2, 2)
    bm.allocate(2, 9, m)
    assert set(bm.block_table(2)).isdisjoint(bm.block_table(1))


# ---- fork / copy-on-write ----------------------------------------------------------


def test_fork_then_copy_on_write():
    bm = BlockManager(8, BS)
    bm.allocate(1, 6)  # blocks [0, 1], the second half full
    bm.fork(1, 2)
    assert bm.block_table(2) == bm.block_table(1) == [0, 1]
    assert bm.state_snapshot().ref_counts[:2] == (2, 2)
    # Parent writes position 6: block 1 is shared, so it gets a private copy.
    assert bm.can_prepare_write(1, 6)
    pairs = bm.prepare_write(1, 6)
    assert pairs == [(1, 2)]
    assert bm.block_table(1) == [0, 2]
    # Child now owns block 1 alone: writes in place.
    assert bm.prepare_write(2, 6) == []
    assert bm.block_table(2) == [0, 1]
    assert bm.state_snapshot().ref_counts[:3] == (2, 1, 1)
    bm.check_integrity()
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_prepare_write_covers_every_block_from_first_pos():
    bm = BlockManager(8, BS)
    bm.allocate(1, 12)
    bm.fork(1, 2)
    pairs = bm.prepare_write(2, 5)  # writes into blocks 1 and 2
    assert [src for src, _ in pairs] == [1, 2]
    assert bm.block_table(2)[0] == 0
    assert bm.prepare_write(2, 100) == []
    assert bm.prepare_write(99, 0) == []
    bm.check_integrity()


def test_prepare_write_without_free_blocks_changes_nothing():
    bm = BlockManager(2, BS)
    bm.allocate(1, 8)
    bm.fork(1, 2)
    before = bm.state_snapshot()
    assert not bm.can_prepare_write(2, 0)
    with pytest.raises(NoFreeBlocksError):
        bm.prepare_write(2, 0)
    assert bm.state_snapshot() == before
    assert bm.can_prepare_write(2, 8)  # past the table: nothing to copy


def test_rewriting_a_cached_block_unindexes_it():
    bm = BlockManager(8, BS)
    run_prompt(bm, 1, toks(9))
    assert bm.match_prefix(toks(9)).num_tokens == 8
    assert bm.prepare_write(1, 6) == []  # sole owner rewrites from inside block 1
    assert bm.match_prefix(toks(9)).num_tokens == 4
    bm.commit_full_blocks(1, toks(9), 9)  # recomputed: indexed again
    assert bm.match_prefix(toks(9)).num_tokens == 8
    bm.check_integrity()


def test_fork_errors():
    bm = BlockManager(4, BS)
    bm.allocate(1, 4)
    with pytest.raises(KeyError):
        bm.fork(7, 8)
    bm.allocate(2, 1)
    with pytest.raises(ValueError):
        bm.fork(1, 2)


# ---- checkpoint / rollback ---------------------------------------------------------


def test_rollback_restores_exactly():
    bm = BlockManager(10, BS)
    run_prompt(bm, 1, toks(9))
    run_prompt(bm, 2, toks(6, 50))
    bm.free(2)
    before = bm.state_snapshot()
    cp = bm.checkpoint()
    run_prompt(bm, 3, toks(13))  # revives nothing of seq 2, shares seq 1's blocks
    bm.fork(1, 4)
    bm.prepare_write(4, 8)
    bm.allocate(5, 16)  # evicts seq 2's cached blocks
    bm.free(1)
    bm.commit_full_blocks(3, toks(13), 13)
    assert bm.state_snapshot() != before
    bm.rollback(cp)
    assert bm.state_snapshot() == before
    bm.check_integrity()
    # Still live after a rollback, and the restored free order is really used.
    run_prompt(bm, 6, toks(6, 50))
    assert bm.prefix_stats().hits > before.prefix_stats.hits
    bm.rollback(cp)
    assert bm.state_snapshot() == before


def test_only_the_newest_checkpoint_is_live():
    bm = BlockManager(4, BS)
    cp1 = bm.checkpoint()
    cp2 = bm.checkpoint()
    with pytest.raises(ValueError):
        bm.rollback(cp1)
    bm.allocate(1, 4)
    bm.release_checkpoint(cp2)
    with pytest.raises(ValueError):
        bm.rollback(cp2)
    assert bm.block_table(1) == [0]


def test_rollback_of_a_failed_batch():
    """The engine's use: reserve for a whole batch, undo it all if one seq does not fit."""
    bm = BlockManager(4, BS)
    bm.allocate(1, 4)
    before = bm.state_snapshot()
    cp = bm.checkpoint()
    bm.allocate(1, 8)
    bm.allocate(2, 8)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(3, 4)
    bm.rollback(cp)
    assert bm.state_snapshot() == before


# ---- integrity ----------------------------------------------------------------------


def _healthy():
    bm = BlockManager(8, BS)
    run_prompt(bm, 1, toks(9))
    bm.fork(1, 2)
    run_prompt(bm, 3, toks(5, 30))
    bm.free(3)
    bm.check_integrity()
    return bm


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda bm: setattr(bm._pool.blocks[0], "ref_count", 3), "ref_count"),
        (lambda bm: bm._seqs[2].table.append(7), "table entries"),
        (lambda bm: bm._seqs[2].table.append(bm._seqs[2].table[0]), "twice"),
        (lambda bm: bm._pool._free_key.pop(7), "free pool"),
        (lambda bm: bm._pool._hash_to_block.update({b"x" * 16: 5}), "hash"),
        (lambda bm: setattr(bm._pool.blocks[1], "block_hash", b"y" * 16), "hash"),
        (lambda bm: bm._pool._heap.clear(), "unreachable"),
        (lambda bm: setattr(bm._pool.blocks[0], "ref_count", -1), "negative"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message):
    bm = _healthy()
    corrupt(bm)
    with pytest.raises(IntegrityError, match=message):
        bm.check_integrity()


def test_writable_exactly_when_allocate_and_prepare_write_would_change_nothing():
    bm = BlockManager(8, BS)
    tokens = toks(2 * BS + 1)
    run_prompt(bm, 1, tokens)                      # 3 blocks, the first two full and indexed
    n = len(tokens)
    assert bm.writable(1, n + 1, n)                # the next token goes into its own last block
    assert not bm.writable(1, 3 * BS + 1, n)       # ... a token past it needs a fresh block
    assert not bm.writable(1, n + 1, BS)           # rewriting an indexed (full, committed) block
    assert not bm.writable(2, 1, 0)                # unknown sequence
    bm.fork(1, 3)                                  # a sample shares every block
    assert not bm.writable(1, n + 1, n) and not bm.writable(3, n + 1, n)
    before = (bm.block_table(1), bm.num_free_blocks)
    assert bm.prepare_write(3, n) != []            # the fork's write copies the shared last block
    assert bm.writable(3, n + 1, n) and bm.writable(1, n + 1, n)
    assert bm.block_table(1) == before[0]
