"""What one step computes: per sequence, a chunk of its uncomputed tokens, and the bookkeeping the
engine must do around the model call (copy-on-write copies before it, forks of parallel samples
after it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.request import Sequence


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int        # first position computed this step
    num_new: int
    samples: bool     # this chunk catches the sequence up: its last row is sampled
    # (src, dst) KV blocks to copy before the step writes: dst is this sequence's private copy of a
    # block it shares with a sibling sample (copy-on-write).
    copies: list[tuple[int, int]] = field(default_factory=list)
    # A forked sample computes nothing this step; it samples from the logits row of this chunk.
    forked_from: "ScheduledChunk | None" = None

    @property
    def token_ids(self) -> list[int]:
        return self.seq.all_token_ids[self.start:self.start + self.num_new]


@dataclass
class ScheduledBatch:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended while scheduling (cache too small)
    num_tokens: int = 0  # tokens computed this step, kept up to date by add/remove
    num_cached_tokens: int = 0  # tokens admitted sequences took from the prefix cache

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.num_tokens += chunk.num_new

    def remove(self, seq: Sequence) -> None:
        """Take seq's chunk back out (it was preempted after being scheduled)."""
        for chunk in self.chunks:
            if chunk.seq is seq:
                self.chunks.remove(chunk)
                self.num_tokens -= chunk.num_new
                return

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.samples]

    @property
    def copies(self) -> list[tuple[int, int]]:
        return [pair for c in self.chunks for pair in c.copies]

    def logit_rows(self) -> list[int] | None:
        """For each sampling chunk, the row of the runner's logits it samples from; None when every
        chunk has its own row (no forks this step)."""
        if not any(c.forked_from for c in self.chunks):
            return None
        rows: list[int] = []
        own: dict[int, int] = {}
        for c in self.sampling_chunks:
            if c.forked_from is None:
                own[id(c)] = len(own)
                rows.append(own[id(c)])
            else:
                rows.append(own[id(c.forked_from)])  # the parent comes first in chunk order
        return rows
