"""A request's life, as an explicit state machine.

    WAITING ──admit──► RUNNING ──finish──► FINISHED (stop | length | abort | error)
       ▲                  │
       └───preempt────────┘   (blocks freed; recomputed from scratch when readmitted)

One rule drives every phase: each step computes some of the tokens the sequence knows but has not
yet put in the cache (`num_tokens - num_computed_tokens`); when a step catches up, the last row's
logits are sampled. Prefill, chunked prefill, decode, recompute after preemption and recompute after
a context shift are all that.

Parallel samples (n > 1) are sibling sequences with one request_id and sample indices 0..n-1. Only
sample 0 exists until its prompt is computed; then the others are forked from it (`fork`), sharing
its KV blocks, so the prompt is computed once."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tokenmill.engine.sampler import make_generator
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.structured import Constraint

if TYPE_CHECKING:
    import torch

    from tokenmill.engine.speculative.proposer import SpecState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"      # EOS/EOT, a stop token, or (on the output side) a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"    # the client went away or asked to cancel
    ERROR = "error"    # the engine failed while running this sequence
    TIMEOUT = "timeout"  # the request's deadline (request_timeout) passed; clients see `length`

    @property
    def client_value(self) -> str:
        """The reason as the HTTP APIs spell it: a deadline is one more limit the output hit."""
        return "length" if self is FinishReason.TIMEOUT else self.value


ALLOWED = {
    Status.WAITING: {Status.RUNNING, Status.FINISHED},
    Status.RUNNING: {Status.WAITING, Status.FINISHED},
    Status.FINISHED: set(),
}


class Priority(enum.IntEnum):
    HIGH = 0
    NORMAL = 1
    LOW = 2


@dataclass
class SequenceTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prev_token: float | None = None  # the step before last's tokens, for inter-token latency
    finished: float | None = None


@dataclass(eq=False)  # a sequence is itself, not its fields: the queues remove it by identity
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_model_len: int
    priority: Priority = Priority.NORMAL
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache, not computed
    num_preemptions: int = 0
    num_emitted: int = 0  # output tokens already handed to the client
    generator: "torch.Generator | None" = None
    constraint: Constraint | None = None  # grammar state, advanced with every output token
    times: SequenceTimes = field(default_factory=SequenceTimes)
    # Parallel samples: this sequence's index, and how many siblings it still has to fork, those
    # numbered after it (only the sequence computing the prompt has any: sample 0, or the next one
    # when sample 0 is aborted first, hand_over).
    sample_index: int = 0
    num_pending_forks: int = 0
    aborted_forks: set[int] = field(default_factory=set)  # of those siblings, the ones aborted already
    # Context management: a context shift keeps the first num_keep tokens and drops the older half
    # of the rest; without shift, a full context ends the sequence with `length`.
    num_keep: int = 0
    shift: bool = False
    num_shifted_tokens: int = 0   # dropped by context shifts so far
    # After a shift the model sees shifted_ids + output_ids[shifted_output_start:]: the kept tokens
    # of the old context, then what was generated since. output_ids keeps everything generated.
    shifted_ids: list[int] | None = None
    shifted_output_start: int = 0
    deadline: float | None = None  # time.monotonic() after which the engine finishes it (timeout)
    # params.prompt_logprobs: entry j scores prompt token j + 1 (logprob, top alternatives), from the
    # row of position j. Filled as the prompt's chunks are computed; forked samples share it.
    prompt_scores: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # Speculative decoding (engine/speculative/): this sequence's n-gram index and back-off record,
    # made on its first proposal.
    spec: "SpecState | None" = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            # Sample i of a seeded request draws from seed + i: reproducible, yet the samples differ.
            self.generator = make_generator(self.params.seed + self.sample_index)
        if self.constraint is None and self.params.constraint is not None:
            self.constraint = self.params.constraint.new_constraint()

    @property
    def num_tokens(self) -> int:
        """Tokens in the context (what the cache holds once computed)."""
        if self.shifted_ids is not None:
            return len(self.shifted_ids) + len(self.output_ids) - self.shifted_output_start
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The context the model sees: prompt + output, minus what context shifts dropped."""
        if self.shifted_ids is not None:
            return self.shifted_ids + self.output_ids[self.shifted_output_start:]
        return self.prompt_ids + self.output_ids

    def _context_parts(self) -> tuple[list[int], list[int]]:
        """all_token_ids as its two lists, unjoined: (prompt, output), or after a shift what it kept."""
        if self.shifted_ids is not None:
            return self.shifted_ids, self.output_ids[self.shifted_output_start:]
        return self.prompt_ids, self.output_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without joining the whole context (a decode row's one input id,
        every step)."""
        head, tail = self._context_parts()
        n = len(head)
        if end <= n:
            return head[start:end]
        if start >= n:
            return tail[start - n:end - n]
        return head[start:] + tail[:end - n]

    def last_token_ids(self, n: int) -> list[int]:
        """The context's last n ids (all of them for n < 0), without joining the whole context: the
        penalty window of every sampled row, every step."""
        if n < 0:
            return self.all_token_ids
        if n == 0:
            return []
        head, tail = self._context_parts()
        if len(tail) >= n:
            return tail[-n:]
        return head[max(0, len(head) - (n - len(tail))):] + tail

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        prompt = len(self.shifted_ids) if self.shifted_ids is not None else len(self.prompt_ids)
        return self.num_computed_tokens < prompt

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def transition(self, new: Status) -> None:
        if new not in ALLOWED[self.status]:
            raise RuntimeError(f"sequence {self.request_id}: illegal transition {self.status.value} -> {new.value}")
        self.status = new

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.transition(Status.FINISHED)
        self.finish_reason = reason
        self.error = error
        self.times.finished = time.monotonic()

    @property
    def wants_prompt_scores(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_scores) < len(self.prompt_ids) - 1

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the cache content is gone, the tokens are not."""
        self.transition(Status.WAITING)
        self.num_computed_tokens = 0
        self.num_preemptions += 1

    def shift_context(self, kept_ids: list[int], num_dropped: int) -> None:
        """Replace the context by kept_ids (ending with the newest token); the cache must be redone."""
        self.shifted_ids = kept_ids
        self.shifted_output_start = len(self.output_ids)
        self.num_shifted_tokens += num_dropped
        self.num_computed_tokens = 0

    def unforked_samples(self) -> list[int]:
        """The indices of the siblings this sequence is still to fork, the aborted ones left out."""
        first = self.sample_index + 1
        return [i for i in range(first, first + self.num_pending_forks) if i not in self.aborted_forks]

    def hand_over(self) -> None:
        """This sample is aborted before its prompt was computed, its siblings not: the sequence goes on
        computing the prompt as the first of them, with that sample's generator (no draw was made yet)."""
        last = self.sample_index + self.num_pending_forks
        self.sample_index = self.unforked_samples()[0]
        self.num_pending_forks = last - self.sample_index
        self.aborted_forks = {i for i in self.aborted_forks if i > self.sample_index}
        if self.params.seed is not None:
            self.generator = make_generator(self.params.seed + self.sample_index)

    def fork(self, seq_id: int, sample_index: int) -> "Sequence":
        """A sibling sample that has everything this one has computed (the blocks are forked by the
        caller). Born running; it keeps its own generator and output from here on."""
        child = replace(
            self, seq_id=seq_id, sample_index=sample_index, num_pending_forks=0, aborted_forks=set(), generator=None,
            constraint=None if self.constraint is None else self.constraint.fork(),
            output_ids=list(self.output_ids), output_logprobs=list(self.output_logprobs),
            output_top_logprobs=list(self.output_top_logprobs),
            shifted_ids=None if self.shifted_ids is None else list(self.shifted_ids),
            times=replace(self.times), spec=None,
        )  # replace() runs __post_init__, which seeds the child's own generator
        return child
