"""Random operation sequences against BlockManager, with a model of the K/V storage.

The model writes each token into the block/offset the manager assigns it, applying the
copy-on-write pairs exactly as the engine would. Checking that every sequence reads its
own tokens back catches any sharing bug (a write into a block someone else still uses),
and checking a prefix match's content (and every cached block's indexed first tokens) catches
any stale prefix-cache entry.
"""
import copy

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.kvcache import BlockManager, NoFreeBlocksError

BS = 4
NUM_BLOCKS = 12
# Shared document starts make prefix hits common; a tiny vocabulary makes
# coincidental equal blocks (duplicate content) common too.
DOCS = ([1, 2, 3, 0] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3)
TAIL = st.lists(st.integers(0, 3), max_size=6)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS)
        self.storage = {b: [None] * BS for b in range(NUM_BLOCKS)}  # K/V stand-in
        self.seqs: dict[int, list[int]] = {}  # seq -> computed tokens
        self.next_id = 0
        self.saved = None  # (checkpoint, snapshot, storage, seqs)

    # ---- helpers ---------------------------------------------------------------

    def _pick(self, i):
        ids = sorted(self.seqs)
        return ids[i % len(ids)]

    def _write(self, sid, tokens, first_pos):
        table = self.bm.block_table(sid)
        for p in range(first_pos, len(tokens)):
            self.storage[table[p // BS]][p % BS] = tokens[p]

    def _read(self, table, n):
        return [self.storage[table[p // BS]][p % BS] for p in range(n)]

    def _expect_refusal(self, fn, *args):
        before = self.bm.state_snapshot()
        with pytest.raises(NoFreeBlocksError):
            fn(*args)
        assert self.bm.state_snapshot() == before

    def _compute(self, sid, tokens, first_pos):
        """prepare_write + copies + write + commit, like one engine step."""
        if not self.bm.can_prepare_write(sid, first_pos):
            self._expect_refusal(self.bm.prepare_write, sid, first_pos)
            return False
        for src, dst in self.bm.prepare_write(sid, first_pos):
            self.storage[dst] = list(self.storage[src])
        self._write(sid, tokens, first_pos)
        self.bm.commit_full_blocks(sid, tokens, len(tokens))
        self.seqs[sid] = list(tokens)
        return True

    # ---- rules -----------------------------------------------------------------

    @rule(doc=st.sampled_from(DOCS), keep=st.integers(0, 24), tail=TAIL, use_prefix=st.booleans())
    def add(self, doc, keep, tail, use_prefix):
        tokens = doc[:keep] + tail or [0]
        sid, self.next_id = self.next_id, self.next_id + 1
        m = self.bm.match_prefix(tokens)
        full = len(m.block_ids) * BS
        assert full <= m.num_tokens < len(tokens)
        assert self._read(list(m.block_ids), full) == tokens[:full]
        if m.partial is not None:  # a cached block that starts with the next tokens
            assert m.num_tokens == full + m.partial.num_tokens and m.partial.num_tokens > 0
            assert m.partial.block_id not in m.block_ids
            assert self.storage[m.partial.block_id][: m.partial.num_tokens] == tokens[full : m.num_tokens]
        else:
            assert m.num_tokens == full
        prefix = m if use_prefix else None
        if not self.bm.can_allocate(sid, len(tokens), prefix):
            self._expect_refusal(self.bm.allocate, sid, len(tokens), prefix)
            return
        copies = self.bm.allocate(sid, len(tokens), prefix)
        done = m.num_tokens if use_prefix else 0
        if use_prefix:
            assert self.bm.block_table(sid)[: len(m.block_ids)] == list(m.block_ids)
            assert copies == ([(m.partial.block_id, self.bm.block_table(sid)[len(m.block_ids)])] if m.partial else [])
            # As the engine does: every copy of the step reads its source before anything is written.
            sources = [list(self.storage[src]) for src, _ in copies]
            for (_, dst), content in zip(copies, sources):
                self.storage[dst] = content
        else:
            assert copies == []
        assert self.bm.prepare_write(sid, done) == []  # a new sequence's own blocks are private
        self._write(sid, tokens, done)
        self.bm.commit_full_blocks(sid, tokens, len(tokens))
        self.seqs[sid] = tokens

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), new=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def grow(self, i, new):
        sid = self._pick(i)
        old = self.seqs[sid]
        tokens = old + new
        if not self.bm.can_allocate(sid, len(tokens)):
            self._expect_refusal(self.bm.allocate, sid, len(tokens))
            return
        self.bm.allocate(sid, len(tokens))
        assert self.bm.num_tokens_allocated(sid) >= len(tokens)
        self._compute(sid, tokens, len(old))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), back=st.integers(1, 9), data=st.data())
    def rewrite(self, i, back, data):
        """Rewind the tail of a sequence and write other tokens in its place (e.g.
        rejected speculative tokens), keeping its length."""
        sid = self._pick(i)
        old = self.seqs[sid]
        pos = max(0, len(old) - back)
        tail = data.draw(st.lists(st.integers(0, 3), min_size=len(old) - pos, max_size=len(old) - pos))
        self._compute(sid, old[:pos] + tail, pos)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        parent = self._pick(i)
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.seqs[child] = list(self.seqs[parent])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), keep_tail=st.booleans())
    def free(self, i, keep_tail):
        """keep_tail: as a finished sequence, whose partly filled last block a later prompt may continue."""
        sid = self._pick(i)
        if keep_tail:
            self.bm.free(sid, self.seqs[sid], len(self.seqs[sid]))
        else:
            self.bm.free(sid)
        del self.seqs[sid]
        assert self.bm.block_table(sid) == []

    @rule()
    def checkpoint(self):
        cp = self.bm.checkpoint()
        self.saved = (cp, self.bm.state_snapshot(), copy.deepcopy(self.storage), copy.deepcopy(self.seqs))

    @precondition(lambda self: self.saved is not None)
    @rule()
    def rollback(self):
        cp, snap, storage, seqs = self.saved
        self.bm.rollback(cp)
        assert self.bm.state_snapshot() == snap
        # Rollback is for reservations whose K/V was never written: model that.
        self.storage, self.seqs = copy.deepcopy(storage), copy.deepcopy(seqs)

    @precondition(lambda self: self.saved is not None)
    @rule()
    def release_checkpoint(self):
        self.bm.release_checkpoint(self.saved[0])
        self.saved = None

    # ---- invariants --------------------------------------------------------------

    @invariant()
    def integrity(self):
        self.bm.check_integrity()
        used = set()
        for sid, tokens in self.seqs.items():
            table = self.bm.block_table(sid)
            assert self._read(table, len(tokens)) == tokens
            used.update(table)
        assert self.bm.num_used_blocks == len(used)
        # Every block a partial match may copy from still holds the tokens it is indexed by.
        for b, (_, tokens) in self.bm.state_snapshot().tails.items():
            assert self.storage[b][: len(tokens)] == list(tokens)
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == NUM_BLOCKS

    def teardown(self):
        for sid in list(self.seqs):
            self.bm.free(sid)
        self.bm.check_integrity()
        assert self.bm.num_free_blocks == NUM_BLOCKS
        assert all(r == 0 for r in self.bm.state_snapshot().ref_counts)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerStateful = BlockManagerMachine.TestCase
