"""The async side: the engine loop on a background thread, and per-request async streams.

Only the loop thread touches the engine. Callers talk to it through a command queue; each request's
events come back on its own asyncio.Queue via call_soon_threadsafe."""
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
from tokenmill.engine.request import FinishReason, Priority
from tokenmill.engine.sampling_params import SamplingParams

log = logging.getLogger("tokenmill.engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

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
        self.engine.check_request(prompt_ids, params, num_ctx, n=n, **options)  # bad input raises here
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = stream
        self._submit(lambda: self._add(rid, prompt_ids, params, priority, num_ctx, n, options))
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
        """Run fn(engine) on the loop thread between steps (e.g. embeddings, stats snapshots)."""
        fut: Future = Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)

        self._submit(run)
        return fut

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
        for ev in events:
            with self._lock:
                stream = self._streams.get(ev.request_id)
            if stream is None:
                continue
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, ev)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _loop(self) -> None:
        while not self._stopping:
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    command()
                except Exception:  # noqa: BLE001
                    log.exception("engine command failed")
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
            except Exception:  # noqa: BLE001 - the loop must survive anything a step throws
                log.exception("engine step crashed")
        # Shutting down: whoever still waits gets an abort.
        for rid in list(self._streams):
            self._deliver(self.engine.abort(rid))
