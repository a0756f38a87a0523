"""Step and request statistics the engine keeps for the server's /metrics."""
from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field

from tokenmill.engine.request import Sequence
from tokenmill.engine.speculative.proposer import SpecCounters


class Histogram:
    """Cumulative-bucket histogram in Prometheus' shape (upper bounds, counts, sum)."""

    def __init__(self, buckets: list[float]):
        self.buckets = sorted(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[tuple[float, int]]:
        out, total = [], 0
        for bound, c in zip([*self.buckets, float("inf")], self.counts):
            total += c
            out.append((bound, total))
        return out


LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0]
TOKENS_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]


@dataclass
class StepRecord:
    num_tokens: int
    num_seqs: int
    num_decode_seqs: int
    num_prefill_tokens: int
    seconds: float
    num_cached_tokens: int = 0  # prompt tokens admitted sequences took from the prefix cache


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0          # prompt tokens computed (not those taken from the prefix cache)
    num_cached_prompt_tokens: int = 0   # prompt tokens taken from the prefix cache instead
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    tokens_per_step: Histogram = field(default_factory=lambda: Histogram(TOKENS_BUCKETS))
    seqs_per_step: Histogram = field(default_factory=lambda: Histogram(TOKENS_BUCKETS))
    spec: SpecCounters = field(default_factory=SpecCounters)  # speculative decoding, written by the scheduler
    last_step: StepRecord | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_step(self, rec: StepRecord) -> None:
        with self.lock:
            self.num_steps += 1
            self.last_step = rec
            self.tokens_per_step.observe(rec.num_tokens)
            self.seqs_per_step.observe(rec.num_seqs)
            self.num_prompt_tokens += rec.num_prefill_tokens
            self.num_cached_prompt_tokens += rec.num_cached_tokens

    def record_token(self, seq: Sequence, num_tokens: int = 1) -> None:
        """seq got num_tokens tokens this step (more than one when its proposals were accepted)."""
        with self.lock:
            self.num_generation_tokens += num_tokens
            t = seq.times
            if len(seq.output_ids) == 1 and t.first_token is not None:
                self.ttft.observe(t.first_token - t.arrival)
            elif t.prev_token is not None and t.last_token is not None and num_tokens > 0:
                # Tokens that came together (accepted proposals, decode steps in a row) share the time
                # since the step before: one observation each, summing to the first-to-last token time.
                self.itl.observe((t.last_token - t.prev_token) / num_tokens, num_tokens)

    def record_finish(self, seq: Sequence) -> None:
        with self.lock:
            reason = seq.finish_reason.value if seq.finish_reason else "unknown"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if seq.times.finished is not None:
                self.e2e.observe(seq.times.finished - seq.times.arrival)
            if seq.times.first_scheduled is not None:
                self.queue_time.observe(seq.times.first_scheduled - seq.times.arrival)


@dataclass
class HistogramSnapshot:
    buckets: list[tuple[float, int]]  # (upper bound, cumulative count), the last bound +Inf
    sum: float
    count: int

    @classmethod
    def of(cls, h: Histogram) -> "HistogramSnapshot":
        return cls(h.cumulative(), h.sum, h.count)


HISTOGRAM_NAMES = ("ttft", "itl", "e2e", "queue_time", "tokens_per_step", "seqs_per_step")


@dataclass
class StatsSnapshot:
    """The engine's numbers at one moment, consistent with each other (LLMEngine.stats_snapshot)."""
    num_running: int
    num_waiting: int
    kv_usage: float
    num_used_blocks: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generation_tokens: int
    num_steps: int
    finished: dict[str, int]                 # by finish reason
    histograms: dict[str, HistogramSnapshot]  # by HISTOGRAM_NAMES
    # Speculative decoding, vLLM's spec_decode_* counters: verifications with proposals, tokens proposed,
    # tokens accepted, and accepted tokens by position in the proposal (0 = the first proposed token).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    taken_at: float = field(default_factory=time.monotonic)
