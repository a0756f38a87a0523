"""Admission control: a bounded count of in-flight engine requests (running + waiting). Rejecting
at the door with 503 + Retry-After keeps latency bounded under overload instead of letting an
unbounded queue grow; while draining for shutdown, everything new is turned away. A request that
could not fit even in an empty server is a 400: no wait would let it in."""
from __future__ import annotations

from tokenmill.server.errors import APIError

RETRY_AFTER_SECONDS = 1


class Slot:
    """Held for a request's lifetime; release() is idempotent so every exit path may call it."""

    def __init__(self, admission: "Admission", n: int):
        self._admission = admission
        self._n = n

    def release(self) -> None:
        if self._n:
            self._admission.in_flight -= self._n
            self._n = 0


class Admission:
    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.in_flight = 0
        self.num_rejected = 0
        self.draining = False

    def enter(self, n: int = 1) -> Slot:
        # Only the event loop thread calls this, so no lock: check and increment cannot interleave.
        if self.draining:
            self.num_rejected += n
            raise APIError(503, "server is shutting down", code="shutting_down", retry_after=RETRY_AFTER_SECONDS)
        if n > self.max_queue:
            # Retrying could never help: 503 + Retry-After would have clients retry it forever.
            self.num_rejected += n
            raise APIError(400, f"this request alone needs {n} sequences (prompts x n), more than the server's "
                                f"limit of {self.max_queue} in flight; send fewer prompts or a smaller n",
                           code="too_many_sequences")
        if self.in_flight + n > self.max_queue:
            self.num_rejected += n
            raise APIError(503, f"server busy: {self.in_flight} requests in flight, the limit is {self.max_queue}",
                           code="queue_full", retry_after=RETRY_AFTER_SECONDS)
        self.in_flight += n
        return Slot(self, n)
