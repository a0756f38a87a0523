"""Which tokens of which sequences go into the next step, and what each sequence does afterwards.

`schedule()` builds the batch: running sequences first, in a rotating order so none starves when the
token budget cannot serve them all; then waiting sequences in the policy's order (engine/policy.py)
while budget, the `parallel` cap and cache blocks allow. When a running sequence needs a block and
none is free, the lowest-priority, newest running sequence is preempted by recompute; under the
"priority" policy a waiting request that cannot be admitted preempts lower-priority running ones.
`fork_samples()` and `update()` are the post-step bookkeeping."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenmill.engine.batch import ScheduledBatch, ScheduledChunk
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.context import shift_context
from tokenmill.engine.policy import WaitingQueue
from tokenmill.engine.request import FinishReason, Sequence, Status
from tokenmill.engine.sampler import SampleResult
from tokenmill.engine.speculative import Speculator, num_accepted, settle_generator
from tokenmill.kvcache import BlockManager
from tokenmill.kvcache.block_manager import PrefixMatch
from tokenmill.structured import grammar_failure

__all__ = ["ScheduledBatch", "ScheduledChunk", "Scheduler"]

log = logging.getLogger("tokenmill.engine")


def _victim_key(seq: Sequence) -> tuple:
    # Lowest priority first (largest value), then the newest: it has the least work to lose.
    return (seq.priority, seq.times.arrival, seq.seq_id)


def proposes(seq: Sequence) -> bool:
    """Whether a sequence may carry proposals this step: it has one token to compute (a decode, or a
    prompt whose cached prefix covers all but its last token), and no samples left to fork, which
    would fork after the proposals and sample from the parent's rows as if they were their own."""
    return seq.num_uncomputed == 1 and not seq.num_pending_forks


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager, stop_ids: frozenset[int],
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.blocks = blocks
        self.stop_ids = stop_ids
        self.clock = clock  # the policy's notion of now (ageing); tests substitute a fake
        self.waiting = WaitingQueue(cfg.policy, cfg.aging_ms)
        self.running: list[Sequence] = []
        self._rotation = 0
        self.num_preemptions = 0
        # Speculative decoding (engine/speculative/): set by the engine when its runner computes
        # proposed rows; None = no sequence proposes.
        self.speculator: Speculator | None = None

    # --- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def find(self, request_id: str) -> list[Sequence]:
        return [s for s in [*self.running, *self.waiting] if s.request_id == request_id]

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None, *, computed: bool = False) -> None:
        """Take a sequence out of the queues for good and release its blocks at once. computed: its
        num_computed_tokens are all in its blocks (it ends after a step that ran), so the partly
        filled last block stays cached for a prompt that continues it (the next turn of a chat).
        Not so for one ended between scheduling and its step (its partial prefix's copy may not
        have run)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if computed:
            self.blocks.free(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
        else:
            self.blocks.free(seq.seq_id)
        if self.speculator is not None:
            self.speculator.forget(seq)
        seq.finish(reason, error)

    def overdue(self, now: float) -> list[Sequence]:
        return [s for s in [*self.running, *self.waiting] if s.deadline is not None and s.deadline <= now]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- batch building ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        n = len(self.running)
        order = self.running[self._rotation % n:] + self.running[:self._rotation % n] if n else []
        self._rotation += 1
        proposals = self._proposals(order)
        for seq in order:
            budget = self.cfg.n_batch - batch.num_tokens
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            speculative = self._speculative_chunk(seq, budget, proposals.get(seq.seq_id, []))
            if speculative is not None:
                batch.add(speculative)
                continue
            num_new = min(seq.num_uncomputed, budget)
            copies = self._reserve(seq, seq.num_computed_tokens + num_new, batch)
            if copies is not None:
                batch.add(self._chunk(seq, num_new, copies))
        if not batch.preempted:  # memory is short this step: let the running ones catch up first
            self._admit(batch)
        # Single-token chunks first: the attention groups them into one batched call.
        batch.chunks.sort(key=lambda c: c.num_new != 1)
        return batch

    def _chunk(self, seq: Sequence, num_new: int, copies: list[tuple[int, int]]) -> ScheduledChunk:
        if seq.times.first_scheduled is None:
            seq.times.first_scheduled = time.monotonic()
        start = seq.num_computed_tokens
        return ScheduledChunk(seq, start, num_new, start + num_new == seq.num_tokens, copies)

    def _proposals(self, order: list[Sequence]) -> dict[int, list[int]]:
        """What each decoding sequence proposes this step, by seq_id, asked of the speculator at once
        (a draft model decodes them as one batch). Each may take its request's whole wish here; the
        step's token budget cuts them where they are scheduled."""
        spec = self.speculator
        if spec is None:
            return {}
        return spec.propose_all([seq for seq in order if proposes(seq)], num_rows=len(self.running))

    def _speculative_chunk(self, seq: Sequence, budget: int, draft: list[int]) -> ScheduledChunk | None:
        """A decoding sequence's chunk with the tokens it proposed (up to what the budget leaves), when
        there are some and there is room for them; else None (it goes the ordinary way). Proposals never
        preempt anyone: their blocks come from free ones, and enough stay free for every running
        sequence's next token."""
        spec = self.speculator
        if spec is None or not proposes(seq):
            return None
        draft = draft[:budget - 1]
        row_constraints = None
        if draft and seq.constraint is not None:
            draft, row_constraints = spec.grammar_rows(seq.constraint, draft)
        if not draft:
            return None
        start = seq.num_computed_tokens
        total = start + 1 + len(draft)
        had = len(self.blocks.block_table(seq.seq_id))
        needed = max(0, -(-total // self.blocks.block_size) - had)
        if self.blocks.num_free_blocks - needed < len(self.running) or not self.blocks.can_allocate(seq.seq_id, total):
            return None
        self.blocks.allocate(seq.seq_id, total)
        if not self.blocks.can_prepare_write(seq.seq_id, start):
            self.blocks.trim(seq.seq_id, had * self.blocks.block_size)
            return None
        copies = self.blocks.prepare_write(seq.seq_id, start)
        return ScheduledChunk(seq, start, 1 + len(draft), True, copies, draft_ids=draft,
                              row_constraints=row_constraints)

    def _reserve(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> list[tuple[int, int]] | None:
        """Make room for `seq` to hold num_tokens and to write its new tokens into blocks of its own,
        preempting running sequences as needed. Returns the copy-on-write pairs, or None if `seq`
        itself had to go."""
        first_write = seq.num_computed_tokens
        if self.blocks.writable(seq.seq_id, num_tokens, first_write):  # most decode rows: nothing to do
            return []
        while True:
            if self.blocks.can_allocate(seq.seq_id, num_tokens):
                self.blocks.allocate(seq.seq_id, num_tokens)  # kept even if the copy below must wait
                # A block shared with a sibling sample is copied before this sequence writes into it.
                if self.blocks.can_prepare_write(seq.seq_id, first_write):
                    return self.blocks.prepare_write(seq.seq_id, first_write)
            victim = max(self.running, key=_victim_key)
            if victim is seq and len(self.running) == 1:
                # Alone and still out of blocks: the cache cannot hold this sequence at all.
                self.finish(seq, FinishReason.LENGTH)
                batch.finished.append(seq)
                return None
            self._preempt(victim, batch)
            if victim is seq:
                return None

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        batch.remove(seq)  # if it was already scheduled this step (its CoW copies go with it)
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        if self.speculator is not None:
            self.speculator.forget(seq)
        seq.reset_for_recompute()
        self.waiting.add(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def _admit(self, batch: ScheduledBatch) -> None:
        # Strictly in policy order: a request that does not fit blocks those behind it, so a big
        # one is not overtaken forever by small ones that happen to fit.
        for seq in self.waiting.ordered(self.clock()):
            budget = self.cfg.n_batch - batch.num_tokens
            if budget <= 0:
                break
            if not self._has_slot(seq) and not self._preempt_lower(seq, batch, lambda: self._has_slot(seq)):
                break
            prefix = self._match(seq)
            cached = prefix.num_tokens if prefix else 0
            num_new = min(seq.num_tokens - cached, self.cfg.n_batch - batch.num_tokens)

            def fits() -> bool:
                return self.blocks.can_allocate(seq.seq_id, cached + num_new, prefix)

            if not fits() and not self._preempt_lower(seq, batch, fits, cached + num_new):
                break
            # A prefix that ends inside a block comes with its K/V to copy into the sequence's own.
            copies = self.blocks.allocate(seq.seq_id, cached + num_new, prefix)
            self.waiting.remove(seq)
            seq.transition(Status.RUNNING)
            seq.num_computed_tokens = cached
            if seq.times.first_scheduled is None:
                # The request's own prefix-cache hit, as usage reports it: a preempted (or shifted)
                # sequence coming back finds its own blocks cached, which is no hit of the request's.
                seq.num_cached_prompt_tokens = min(cached, len(seq.prompt_ids))
            batch.num_cached_tokens += cached
            self.running.append(seq)
            batch.add(self._chunk(seq, num_new, copies))

    def _match(self, seq: Sequence, partial: bool = True) -> PrefixMatch | None:
        # Also for a preempted or shifted sequence coming back: its own old blocks may still be cached.
        if not self.cfg.enable_prefix_caching or seq.wants_prompt_scores:  # cached blocks come without logits
            return None
        return self.blocks.match_prefix(seq.all_token_ids, partial=partial)

    def _has_slot(self, seq: Sequence) -> bool:
        # A request with n samples will run n sequences once its prompt is done; an oversized n is
        # let in alone rather than never.
        weight = 1 + seq.num_pending_forks
        return not self.running or len(self.running) + weight <= self.cfg.parallel

    def _preempt_lower(self, seq: Sequence, batch: ScheduledBatch, fits: Callable[[], bool],
                       num_tokens: int | None = None) -> bool:
        """Priority policy: preempt lower-priority running sequences, lowest and newest first, until
        fits() holds. Gives up without preempting anyone when even all of them would not make room
        (num_tokens: the blocks seq needs, checked against what the victims hold at most)."""
        if self.cfg.policy != "priority":
            return False
        victims = sorted((s for s in self.running if s.priority > seq.priority), key=_victim_key, reverse=True)
        if not victims:
            return False
        if num_tokens is not None:
            held = sum(len(self.blocks.block_table(v.seq_id)) for v in victims)
            if self.blocks.num_free_blocks + held < -(-num_tokens // self.blocks.block_size):
                return False
        for victim in victims:
            self._preempt(victim, batch)
            if fits():
                return True
        return False

    # --- post-step bookkeeping -----------------------------------------------------------------
    def fork_samples(self, batch: ScheduledBatch, new_seq_id: Callable[[], int]) -> None:
        """After the model ran and before sampling: a request whose prompt just finished computing
        forks its other samples. They share every block (no copy now; copy-on-write when each first
        writes) and sample their first token from the parent's logits row."""
        for chunk in batch.sampling_chunks:
            parent = chunk.seq
            if not parent.num_pending_forks:
                continue
            at = batch.chunks.index(chunk)
            end = chunk.start + chunk.num_new
            for k, index in enumerate(parent.unforked_samples(), start=1):
                child = parent.fork(new_seq_id(), index)
                child.num_computed_tokens = end
                self.blocks.fork(parent.seq_id, child.seq_id)
                self.running.append(child)
                batch.chunks.insert(at + k, ScheduledChunk(child, end, 0, True, forked_from=chunk))
            parent.num_pending_forks = 0
            parent.aborted_forks.clear()

    def update(self, batch: ScheduledBatch, result: SampleResult | None) -> list[Sequence]:
        """Advance every scheduled sequence; append sampled tokens; finish the ones that are done,
        shift the context of those that asked for it when it is full. Returns the sequences that got
        a token or finished."""
        changed: list[Sequence] = []
        row = 0
        now = time.monotonic()
        for chunk in batch.chunks:
            seq = chunk.seq
            if chunk.draft_ids:
                assert result is not None
                self._verify(chunk, result, row, now)
                row += chunk.num_sample_rows
                changed.append(seq)
                continue
            seq.num_computed_tokens += chunk.num_new
            if self.cfg.enable_prefix_caching:
                self._commit(seq)
            if not chunk.samples:
                continue
            assert result is not None
            self._append(seq, result, row, now)
            row += 1
            changed.append(seq)
        return changed

    # --- decode steps in a row on the device (engine/decode_steps.py) ----------------------------
    def reserve_decode_steps(self, batch: ScheduledBatch, steps: int) -> bool:
        """Make room for every chunk of a decode-only batch to compute `steps` tokens (positions start
        .. start + steps - 1) in blocks of its own, all or none: False, with nothing changed, when a
        sequence cannot have them without a copy or a preemption (then the step is an ordinary one)."""
        grown: list[ScheduledChunk] = []
        for chunk in batch.chunks:
            seq_id, end = chunk.seq.seq_id, chunk.start + steps
            if not self.blocks.writable(seq_id, end, chunk.start):
                if not self.blocks.can_allocate(seq_id, end):
                    break
                self.blocks.allocate(seq_id, end)
                grown.append(chunk)
                if not self.blocks.writable(seq_id, end, chunk.start):
                    break
        else:
            return True
        for chunk in grown:  # the blocks of the ordinary step stay: it was scheduled with them
            self.blocks.trim(chunk.seq.seq_id, chunk.start + 1)
        return False

    def update_decode_steps(self, batch: ScheduledBatch, results: list[SampleResult]) -> list[Sequence]:
        """update() for len(results) decode steps in a row: each sequence takes its tokens one at a
        time, as that many ordinary steps would have given them; a stop, max_tokens or the context's
        end ends it where it would have ended, and the tokens after are void (their KV, past what the
        sequence computed, is never cached: the blocks go back with the sequence)."""
        now = time.monotonic()
        for row, chunk in enumerate(batch.chunks):
            seq = chunk.seq
            for j, result in enumerate(results):
                seq.num_computed_tokens = chunk.start + j + 1
                going = self._append(seq, result, row, now)
                if not going:
                    break
            if not seq.is_finished:
                if self.cfg.enable_prefix_caching:
                    self._commit(seq)
                self.blocks.trim(seq.seq_id, seq.num_tokens)
        return [c.seq for c in batch.chunks]

    def _append(self, seq: Sequence, result: SampleResult, row: int, now: float) -> bool:
        """Give seq the token sampled at `row`; finish it, or shift its context, if that calls for
        it. Returns whether it may take another token this step (neither happened)."""
        token = result.token_ids[row]
        seq.output_ids.append(token)
        if result.logprobs is not None and result.logprobs[row] is not None:
            seq.output_logprobs.append(result.logprobs[row])
        if result.top_logprobs is not None and seq.params.top_logprobs:
            seq.output_top_logprobs.append(result.top_logprobs[row])
        if seq.times.first_token is None:
            seq.times.first_token = now
        if seq.times.last_token != now:  # a step's tokens (accepted proposals) arrive together, at its time
            seq.times.prev_token, seq.times.last_token = seq.times.last_token, now
        reason = self._finish_reason(seq, token)
        if reason is None and seq.num_tokens >= seq.max_model_len:
            if not seq.shift:
                reason = FinishReason.LENGTH
            else:
                self._shift(seq)
                return False
        if reason is not None:
            self.finish(seq, reason, seq.error, computed=True)
            return False
        return True

    def _verify(self, chunk: ScheduledChunk, result: SampleResult, row: int, now: float) -> None:
        """A speculating sequence takes the proposals the model agreed with and the model's own token
        after them (speculative/verify.py), one at a time, so that a stop token, max_tokens or the
        context's end cuts the run where it would have ended without speculation. The KV the step
        wrote for the rejected proposals is left behind: the positions are past what the sequence has
        computed (and so never cached), and the blocks only they used are given back."""
        seq = chunk.seq
        num_draft = len(chunk.draft_ids)
        sampled = result.token_ids[row:row + num_draft + 1]
        accepted = num_accepted(chunk.draft_ids, sampled)
        self.speculator.observe(seq, num_draft, accepted)
        num_emitted = 0
        going = True
        while going and num_emitted <= accepted:
            # Row i's input (the last token, then proposal i) is now part of the context, computed.
            seq.num_computed_tokens = chunk.start + num_emitted + 1
            going = self._append(seq, result, row + num_emitted, now)
            num_emitted += 1
        if chunk.row_generators is not None and seq.generator is not None:
            settle_generator(seq.generator, chunk.row_generators, num_emitted)
        if going:  # not finished, not shifted: still holds its blocks
            self.blocks.trim(seq.seq_id, seq.num_tokens)
            if self.cfg.enable_prefix_caching:
                self._commit(seq)

    def _commit(self, seq: Sequence) -> None:
        """Index seq's newly full blocks for the prefix cache (its token list is joined only then)."""
        if self.blocks.has_uncommitted(seq.seq_id, seq.num_computed_tokens):
            self.blocks.commit_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if len(seq.output_ids) >= p.min_tokens:
            if (token in self.stop_ids and not p.ignore_eos) or token in p.stop_token_ids:
                return FinishReason.STOP
        if seq.constraint is not None:
            if not seq.constraint.accept(token):
                seq.error = grammar_failure(len(seq.output_ids) - 1, seq.constraint.error)
                return FinishReason.ERROR
            if seq.constraint.is_complete:  # nothing may follow: end now rather than sample an EOS
                return FinishReason.STOP
        if p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def _shift(self, seq: Sequence) -> None:
        """Context shift by recompute: keep num_keep tokens and the newer half of the rest, drop the
        cache and compute the kept tokens again at positions from 0, like a preempted sequence (but
        still running). Its leading blocks usually come straight back from the prefix cache."""
        kept, dropped = shift_context(seq.all_token_ids, seq.num_keep)
        log.info("request %s sample %d: context full at %d tokens, shifted out %d tokens after the first %d",
                 seq.request_id, seq.sample_index, seq.num_tokens, dropped, min(seq.num_keep, len(kept) - 1))
        self.blocks.free(seq.seq_id)
        seq.shift_context(kept, dropped)
        # Whole blocks only: a partial one's copy would have to wait for the next step's chunk.
        prefix = self._match(seq, partial=False)
        # The blocks just freed cost nothing to revive, so this always fits; checked all the same.
        if prefix and prefix.num_tokens and self.blocks.can_allocate(seq.seq_id, prefix.num_tokens, prefix):
            self.blocks.allocate(seq.seq_id, prefix.num_tokens, prefix)
            seq.num_computed_tokens = prefix.num_tokens
