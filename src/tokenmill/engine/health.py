"""How well the engine is doing, readable from any thread without waiting for it: the step in
progress (for the watchdog), failed steps in a row (for /health), and the watchdog itself.

The loop thread writes these; other threads only read attributes holding immutable values, so a
reader sees either the old value or the new one, never a step half-way."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.engine.batch import ScheduledBatch

log = logging.getLogger("tokenmill.engine")

# Failed steps in a row after which the engine reports itself unhealthy: one failure is a bad
# request or batch, several in a row are a broken engine (memory, a kernel, the model).
FAILURES_UNHEALTHY = 3


@dataclass(frozen=True)
class StepShape:
    """What one step is computing, for a log line about a step that takes too long."""
    num_seqs: int
    num_tokens: int
    num_decodes: int
    num_prefill_tokens: int
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, batch: ScheduledBatch) -> "StepShape":
        return cls(len(batch.chunks), batch.num_tokens, *batch.decode_and_prefill_counts())

    def describe(self) -> str:
        return (f"{self.num_seqs} sequences, {self.num_tokens} tokens "
                f"({self.num_decodes} decodes, {self.num_prefill_tokens} prefill tokens)")


class StepFaults:
    """Failed steps: how many in a row and the last one's reason."""

    def __init__(self) -> None:
        self.num_failed = 0
        self.num_consecutive = 0
        self.last_error: str | None = None

    def record_failure(self, message: str) -> None:
        self.num_failed += 1
        self.num_consecutive += 1
        self.last_error = message

    def record_success(self) -> None:
        self.num_consecutive = 0

    @property
    def unhealthy(self) -> bool:
        return self.num_consecutive >= FAILURES_UNHEALTHY


@dataclass(frozen=True)
class EngineHealth:
    status: str               # "ok" | "failing" (steps keep failing) | "dead" (the loop thread ended)
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Watchdog:
    """A thread that logs, once per step, a step running longer than `limit` seconds, with its batch
    shape, while it is still running (a hung step never reaches the code after it)."""

    def __init__(self, current: Callable[[], StepShape | None], limit: float):
        self._current = current
        self.limit = limit
        self.num_slow_steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        if self.limit > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the thread and waits for it (it wakes at once): until it has ended it holds the engine
        (through `current`), so an unloaded model's memory would wait for it."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        reported: StepShape | None = None
        interval = min(1.0, self.limit / 4)
        while not self._stop.wait(interval):
            step = self._current()
            if step is None or step is reported:
                continue
            elapsed = time.monotonic() - step.started
            if elapsed > self.limit:
                reported = step
                self.num_slow_steps += 1
                log.warning("engine step running for %.1fs (watchdog limit %.1fs): %s", elapsed, self.limit,
                            step.describe())
