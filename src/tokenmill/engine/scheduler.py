"""Which tokens of which sequences go into the next step, and what each sequence does afterwards.

`schedule()` builds the batch: running sequences first, in a rotating order so none starves when the
token budget cannot serve them all; then waiting sequences in FIFO order while budget, the `parallel`
cap and cache blocks allow. When a running sequence needs a block and none is free, the newest
running sequence is preempted by recompute. `update()` is the post-step bookkeeping."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.request import FinishReason, Sequence, Status
from tokenmill.engine.sampler import SampleResult
from tokenmill.kvcache import BlockManager


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int        # first position computed this step
    num_new: int
    samples: bool     # this chunk catches the sequence up: its last row is sampled

    @property
    def token_ids(self) -> list[int]:
        return self.seq.all_token_ids[self.start:self.start + self.num_new]


@dataclass
class ScheduledBatch:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended while scheduling (cache too small)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.samples]


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager, stop_ids: frozenset[int]):
        self.cfg = cfg
        self.blocks = blocks
        self.stop_ids = stop_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._rotation = 0
        self.num_preemptions = 0

    # --- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def find(self, request_id: str) -> list[Sequence]:
        return [s for s in [*self.running, *self.waiting] if s.request_id == request_id]

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Take a sequence out of the queues for good and release its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.finish(reason, error)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- batch building ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.cfg.n_batch
        n = len(self.running)
        order = self.running[self._rotation % n:] + self.running[:self._rotation % n] if n else []
        self._rotation += 1
        for seq in order:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_uncomputed, budget)
            if not self._reserve(seq, seq.num_computed_tokens + num_new, batch):
                continue
            budget -= num_new
            batch.chunks.append(self._chunk(seq, num_new))
        if not batch.preempted:
            budget = self._admit(batch, budget)
        # Single-token chunks first: the attention groups them into one batched call.
        batch.chunks.sort(key=lambda c: c.num_new != 1)
        return batch

    def _chunk(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        if seq.times.first_scheduled is None:
            seq.times.first_scheduled = time.monotonic()
        start = seq.num_computed_tokens
        return ScheduledChunk(seq, start, num_new, start + num_new == seq.num_tokens)

    def _reserve(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Make room for `seq` to hold num_tokens, preempting the newest running sequences as
        needed. False if `seq` itself had to go."""
        while not self.blocks.can_allocate(seq.seq_id, num_tokens):
            victim = max((s for s in self.running), key=lambda s: (s.priority, s.times.arrival))
            if victim is seq and len(self.running) == 1:
                # Alone and still out of blocks: the cache cannot hold this sequence at all.
                self.finish(seq, FinishReason.LENGTH)
                batch.finished.append(seq)
                return False
            self._preempt(victim, batch)
            if victim is seq:
                return False
        self.blocks.allocate(seq.seq_id, num_tokens)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        for chunk in batch.chunks:
            if chunk.seq is seq:  # already scheduled this step: take it back out
                batch.chunks.remove(chunk)
                break
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.parallel:
            seq = self.waiting[0]
            prefix = self.blocks.match_prefix(seq.all_token_ids) if self.cfg.enable_prefix_caching else None
            cached = prefix.num_tokens if prefix else 0
            num_new = min(seq.num_tokens - cached, budget)
            if not self.blocks.can_allocate(seq.seq_id, cached + num_new, prefix):
                break
            self.blocks.allocate(seq.seq_id, cached + num_new, prefix)
            self.waiting.popleft()
            seq.transition(Status.RUNNING)
            seq.num_computed_tokens = cached
            seq.num_cached_prompt_tokens = min(cached, len(seq.prompt_ids))
            self.running.append(seq)
            batch.chunks.append(self._chunk(seq, num_new))
            budget -= num_new
        return budget

    # --- post-step bookkeeping -----------------------------------------------------------------
    def update(self, batch: ScheduledBatch, result: SampleResult | None) -> list[Sequence]:
        """Advance every scheduled sequence; append sampled tokens; finish the ones that are done.
        Returns the sequences that got a token or finished."""
        changed: list[Sequence] = []
        row = 0
        now = time.monotonic()
        for chunk in batch.chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_new
            if self.cfg.enable_prefix_caching:
                self.blocks.commit_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
            if not chunk.samples:
                continue
            assert result is not None
            token = result.token_ids[row]
            seq.output_ids.append(token)
            if result.logprobs is not None and result.logprobs[row] is not None:
                seq.output_logprobs.append(result.logprobs[row])
            if result.top_logprobs is not None and seq.params.top_logprobs:
                seq.output_top_logprobs.append(result.top_logprobs[row])
            row += 1
            if seq.times.first_token is None:
                seq.times.first_token = now
            seq.times.prev_token, seq.times.last_token = seq.times.last_token, now
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
            changed.append(seq)
        return changed

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if len(seq.output_ids) >= p.min_tokens:
            if (token in self.stop_ids and not p.ignore_eos) or token in p.stop_token_ids:
                return FinishReason.STOP
        if p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= seq.max_model_len:
            return FinishReason.LENGTH
        return None
