"""A request's life, as an explicit state machine.

    WAITING ──admit──► RUNNING ──finish──► FINISHED (stop | length | abort | error)
       ▲                  │
       └───preempt────────┘   (blocks freed; recomputed from scratch when readmitted)

One rule drives every phase: each step computes some of the tokens the sequence knows but has not
yet put in the cache (`num_tokens - num_computed_tokens`); when a step catches up, the last row's
logits are sampled. Prefill, chunked prefill, decode and recompute after preemption are all that."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


from tokenmill.engine.sampler import make_generator
from tokenmill.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"      # EOS/EOT, a stop token, or (on the output side) a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"    # the client went away or asked to cancel
    ERROR = "error"    # the engine failed while running this sequence


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
    prev_token: float | None = None  # the token before last, for inter-token latency
    finished: float | None = None


@dataclass
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
    times: SequenceTimes = field(default_factory=SequenceTimes)

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = make_generator(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < len(self.prompt_ids)

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

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the cache content is gone, the tokens are not."""
        self.transition(Status.WAITING)
        self.num_computed_tokens = 0
        self.num_preemptions += 1
