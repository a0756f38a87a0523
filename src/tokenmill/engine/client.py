"""The async side: the engine loop on a background thread, and per-request async streams.

Only the loop thread touches the engine. Callers talk to it through a command queue; each request's
events come back on its own asyncio.Queue via call_soon_threadsafe. What observers need (statistics,
health) the loop publishes after every step, so reading it never waits for a step to end.

If the loop thread dies, or has stopped after shutdown(), every waiting stream gets an error, pending
calls fail, and new requests are refused at once (EngineDeadError) instead of queueing for a thread
that will never run them."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.engine import LLMEngine, TokenEvent
from tokenmill.engine.health import EngineHealth, Watchdog
from tokenmill.engine.request import FinishReason, Priority
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.stats import StatsSnapshot

log = logging.getLogger("tokenmill.engine")


_SHUT_DOWN = "the engine has shut down (its model was unloaded)"


class EngineDeadError(RuntimeError):
    """The engine loop thread has ended; nothing submitted now would ever run."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    n: int = 1


class _Call:
    """fn(engine) to run on the loop thread, with the future its caller awaits."""

    def __init__(self, fn: Callable[[LLMEngine], Any], engine: LLMEngine):
        self.fn, self.engine, self.future = fn, engine, Future()

    def __call__(self) -> None:
        if self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(self.fn(self.engine))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self.future.set_exception(exc)

    def fail(self, exc: BaseException) -> None:
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(exc)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = False  # the loop has stopped for good (after shutdown): nothing new gets in
        self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)
        self.crash: str | None = None  # why the loop thread died, once it has
        # The statistics as of the last step; replaced whole, never mutated, so any thread may read it.
        self.snapshot: StatsSnapshot = engine.stats_snapshot()
        self.watchdog = Watchdog(lambda: engine.current_step, engine.cfg.watchdog_seconds)

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        self._thread.start()
        self.watchdog.start()
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self.watchdog.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def health(self) -> EngineHealth:
        """Never waits for the engine: a dead loop, or steps failing in a row, or ok."""
        if self.crash is not None:
            return EngineHealth("dead", f"the engine thread crashed: {self.crash}")
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping:
            return EngineHealth("dead", "the engine thread is not running")
        faults = self.engine.faults
        if faults.unhealthy:
            return EngineHealth("failing", f"{faults.num_consecutive} engine steps failed in a row; "
                                           f"the last: {faults.last_error}")
        return EngineHealth("ok")

    def _check_alive(self) -> None:
        health = self.health()
        if health.status == "dead":
            raise EngineDeadError(health.reason)
        if self._closed:
            raise EngineDeadError(_SHUT_DOWN)

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._streams)

    # --- requests ------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                       priority: Priority = Priority.NORMAL, num_ctx: int | None = None, n: int = 1,
                       **options: Any) -> AsyncIterator[TokenEvent]:
        """Stream a request's events (for n samples: keyed by ev.index, ending when all n ended);
        leaving the loop early (client gone) aborts it. options: num_keep, truncate, shift."""
        self._check_alive()
        self.engine.check_request(prompt_ids, params, num_ctx, n=n, **options)  # bad input raises here
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), n)
        with self._lock:
            if self._closed:  # a model being unloaded: whoever leased it last is refused, not left waiting
                raise EngineDeadError(_SHUT_DOWN)
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = stream
        self._submit(lambda: self._add(rid, prompt_ids, params, priority, num_ctx, n, options))
        self._fail_if_gone()  # the thread may have died or stopped between the check above and now
        num_finished = 0
        finished = False
        try:
            while not finished:
                ev: TokenEvent = await stream.queue.get()
                num_finished += ev.finished
                finished = num_finished >= n
                yield ev
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort a request, or only its sample `index`."""
        self._submit(lambda: self._deliver(self.engine.abort(request_id, index)))

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run fn(engine) on the loop thread between steps (e.g. embeddings)."""
        command = _Call(fn, self.engine)
        self._submit(command)
        self._fail_if_gone()
        return command.future

    # --- loop thread ---------------------------------------------------------------------------
    def _submit(self, command: Callable[[], Any]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _add(self, rid: str, prompt_ids: list[int], params: SamplingParams, priority: Priority,
             num_ctx: int | None, n: int, options: dict[str, Any]) -> None:
        with self._lock:
            if rid not in self._streams:  # the caller left before the loop saw the request
                return
        try:
            self.engine.add_request(prompt_ids, params, request_id=rid, priority=priority, num_ctx=num_ctx, n=n,
                                    **options)
        except Exception as exc:  # noqa: BLE001 - reported to that request only
            self._deliver([TokenEvent(rid, [], None, None, FinishReason.ERROR, str(exc), len(prompt_ids), 0, 0, i)
                           for i in range(n)])

    def _deliver(self, events: list[TokenEvent]) -> None:
        """A step's events onto their streams' queues: one callback per event loop, not per event (each
        call_soon_threadsafe wakes the loop through its self-pipe, and a step of 256 sequences made 256)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenEvent]]] = {}
        with self._lock:
            for ev in events:
                stream = self._streams.get(ev.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, ev))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported through health(); nobody joins this thread
            log.exception("the engine thread crashed")
            self.crash = f"{type(exc).__name__}: {exc}"
            self._fail_everyone(f"the engine thread crashed: {self.crash}")

    def _fail_if_gone(self) -> None:
        if self.crash is not None:
            self._fail_everyone(f"the engine thread crashed: {self.crash}")
        elif self._closed:
            self._fail_everyone(_SHUT_DOWN)

    def _fail_everyone(self, error: str) -> None:
        """After a crash, or once the loop has stopped: end every stream with an error and fail every
        pending call. This touches only the client side (after a crash the engine's state is unknown)."""
        with self._lock:
            streams = dict(self._streams)
        for rid, stream in streams.items():
            self._deliver([TokenEvent(rid, [], None, None, FinishReason.ERROR, error, 0, 0, 0, i)
                           for i in range(stream.n)])
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Call):
                command.fail(EngineDeadError(error))

    def _publish(self) -> None:
        self.snapshot = self.engine.stats_snapshot()

    def _run(self) -> None:
        while not self._stopping:
            ran = False
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                ran = True
                try:
                    command()
                except Exception:  # noqa: BLE001
                    log.exception("engine command failed")
            if ran:  # else the snapshot after the last step still holds (~15 us a step saved)
                self._publish()
            if not self.engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            delay = self.engine.step_delay()  # max_wait_ms: let a burst of arrivals gather
            if delay > 0:
                self._wake.wait(delay)
                self._wake.clear()
                continue
            try:
                self._deliver(self.engine.step())
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything a step throws
                log.exception("engine step crashed")
                self.engine.faults.record_failure(f"{type(exc).__name__}: {exc}")
            self._publish()
        # Shutting down: whoever still waits gets an abort; then nobody new gets in, and whoever got in
        # meanwhile (a request submitted after the last commands were read) gets an error.
        for rid in list(self._streams):
            self._deliver(self.engine.abort(rid))
        with self._lock:
            self._closed = True
        self._fail_everyone(_SHUT_DOWN)


def _put_all(items: list[tuple[asyncio.Queue, TokenEvent]]) -> None:
    """On a stream's event loop: each event into its queue, in the engine's order."""
    for q, ev in items:
        q.put_nowait(ev)
