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
    num_new: int      # rows computed this step (the proposals of a speculating sequence included)
    samples: bool     # this chunk catches the sequence up: its last row is sampled
    # (src, dst) KV blocks to copy before the step writes: dst is this sequence's private copy of a
    # block it shares with a sibling sample (copy-on-write).
    copies: list[tuple[int, int]] = field(default_factory=list)
    # A forked sample computes nothing this step; it samples from the logits row of this chunk.
    forked_from: "ScheduledChunk | None" = None
    # Speculative decoding (engine/speculative/): tokens proposed after the sequence's last one. They
    # are computed after it at the next positions, and every row from the last token on is sampled
    # (1 + len(draft_ids) rows); the step keeps the proposals the model agrees with.
    draft_ids: list[int] = field(default_factory=list)
    # Seeded requests: a generator per sampled row (speculative/verify.py), set when sampling.
    row_generators: list | None = None
    # Constrained requests: the grammar's state after each proposal (row j + 1 samples under the mask
    # of row_constraints[j]; the first row under the sequence's own).
    row_constraints: list | None = None

    def mask_keys(self) -> list:
        """For each sampled row, the key its grammar mask is computed under (engine.step): the
        sequence's id for its own state (a forked sample's parent's, whose state it copies), (id, j)
        for the state after proposal j; None without a grammar."""
        if self.seq.constraint is None:
            return [None] * self.num_sample_rows
        own = (self.forked_from.seq if self.forked_from else self.seq).seq_id
        return [own] + [(own, j) for j in range(1, self.num_sample_rows)]

    def mask_states(self) -> list:
        """(key, grammar state) of the masks this chunk's rows need beyond the sequence's own."""
        return [((self.seq.seq_id, j), c) for j, c in enumerate(self.row_constraints or (), 1)]

    @property
    def token_ids(self) -> list[int]:
        return self.input_ids(self.start, self.num_new)

    def input_ids(self, start: int, num_new: int) -> list[int]:
        """The token ids of positions [start, start + num_new) of this chunk (a micro-batch's piece):
        the sequence's own, then its proposals."""
        ids = self.seq.token_ids_between(start, min(start + num_new, self.seq.num_tokens))
        if self.draft_ids and len(ids) < num_new:
            first_draft = self.seq.num_tokens  # position of draft_ids[0]
            ids = ids + self.draft_ids[max(0, start - first_draft):start + num_new - first_draft]
        return ids

    @property
    def num_sample_rows(self) -> int:
        return (1 + len(self.draft_ids)) if self.samples else 0

    def sample_rows_in(self, start: int, num_new: int) -> range:
        """Which rows of the piece [start, start + num_new) get logits, as offsets into the piece:
        the chunk's last row, or every row from the last token on when it carries proposals."""
        first = self.start + self.num_new - self.num_sample_rows
        return range(max(first, start) - start, num_new) if self.samples and start + num_new > first else range(0)


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

    def decode_and_prefill_counts(self) -> tuple[int, int]:
        """(decodes, prefill tokens) in one pass over the chunks: a decode continues a generation (one
        new token, or one and its proposals); every other chunk's tokens are prefill."""
        decodes = prefill = 0
        for c in self.chunks:
            if _is_decode(c):
                decodes += 1
            else:
                prefill += c.num_new
        return decodes, prefill

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.samples]

    @property
    def copies(self) -> list[tuple[int, int]]:
        return [pair for c in self.chunks for pair in c.copies]

    def logit_rows(self) -> list[int] | None:
        """For each sampled row of each sampling chunk, the row of the runner's logits it samples
        from; None when every chunk has its own rows (no forks this step)."""
        if not any(c.forked_from for c in self.chunks):
            return None
        rows: list[int] = []
        own: dict[int, list[int]] = {}
        num_own = 0
        for c in self.sampling_chunks:
            if c.forked_from is None:
                own[id(c)] = list(range(num_own, num_own + c.num_sample_rows))
                num_own += c.num_sample_rows
                rows += own[id(c)]
            else:
                rows += own[id(c.forked_from)]  # the parent comes first in chunk order
        return rows


def _is_decode(chunk: ScheduledChunk) -> bool:
    return bool(chunk.draft_ids) or (chunk.num_new == 1 and not chunk.seq.is_prefilling)
