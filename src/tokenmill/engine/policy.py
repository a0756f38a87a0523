"""The waiting queue and the order it is admitted in.

A policy is a sort key over waiting sequences, evaluated at admission time (`now`), smallest first:

  fifo      arrival time.
  priority  (priority, arrival): HIGH before NORMAL before LOW, FIFO within a level.
  sjf       shortest expected job first: the work still to do (tokens to compute before the first
            new token, plus the tokens it may generate), minus one token per `aging_ms` waited, so a
            long job's score keeps falling until it beats newly arrived short ones: no starvation.

The queue is a plain list sorted on demand: queues are short (bounded by client concurrency) and
sjf's scores change with time anyway."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from tokenmill.engine.request import Sequence

SortKey = Callable[[Sequence], tuple]


def expected_work(seq: Sequence) -> int:
    """Tokens still to compute or generate: the whole context (waiting sequences hold no cache)
    plus what max_tokens (or the context limit) still allows."""
    left = seq.max_model_len - seq.num_tokens
    if seq.params.max_tokens is not None:
        left = min(left, seq.params.max_tokens - len(seq.output_ids))
    return seq.num_tokens + max(0, left)


def sort_key(policy: str, now: float, aging_ms: float) -> SortKey:
    if policy == "fifo":
        return lambda s: (s.times.arrival, s.seq_id)
    if policy == "priority":
        return lambda s: (int(s.priority), s.times.arrival, s.seq_id)
    if policy == "sjf":
        def score(s: Sequence) -> tuple:
            waited_ms = (now - s.times.arrival) * 1000.0
            return (expected_work(s) - waited_ms / aging_ms, s.times.arrival, s.seq_id)
        return score
    raise ValueError(f"unknown scheduling policy {policy!r}")


class WaitingQueue:
    """Sequences not running: new ones and preempted ones (which keep their arrival time, so they
    go back near the front rather than behind everything that came after them)."""

    def __init__(self, policy: str, aging_ms: float):
        self.policy = policy
        self.aging_ms = aging_ms
        self._seqs: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self._seqs.append(seq)

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def ordered(self, now: float) -> list[Sequence]:
        """Admission order at time now (a snapshot: safe to change the queue while iterating)."""
        return sorted(self._seqs, key=sort_key(self.policy, now, self.aging_ms))

    def oldest_arrival(self) -> float | None:
        return min((s.times.arrival for s in self._seqs), default=None)

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs
