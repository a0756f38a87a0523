"""An HTTP request carried from the ingress to a replica as plain data, and its replay against the
replica's own tokenmill app (the same Starlette app `tokenmill serve` runs), in process: the
response comes back as its start (status, headers) and then its body chunks as the app sends them,
so streaming stays streaming across Ray. Closing the stream early is the client going away: the
app sees `http.disconnect` and aborts the generation, as it would under uvicorn."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tokenmill.ray.prefix_summary import RoutingKey

Headers = tuple[tuple[bytes, bytes], ...]
# How long a closed stream's app gets to notice the disconnect and abort its request.
DISCONNECT_GRACE_SECONDS = 2.0


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: Headers
    body: bytes
    client: tuple[str, int] | None = None
    routing: RoutingKey = RoutingKey()   # read by the router, not by the replica


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: Headers
    replica: str = ""   # which replica answers (the ingress passes it on as a header)


def _scope(req: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
        "root_path": "", "query_string": req.query_string, "headers": [list(h) for h in req.headers],
        "client": req.client, "server": ("127.0.0.1", 0), "state": {},
    }


async def replay(app, req: ForwardedRequest, replica: str = "") -> AsyncIterator[ResponseStart | bytes]:
    """Run `req` through the ASGI `app`; yields one ResponseStart, then the body's chunks."""
    messages: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.create_task(app(_scope(req), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple(tuple(h) for h in message.get("headers", ())), replica)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task  # re-raises what the app raised instead of answering (its error handlers answer)
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_SECONDS)
            task.cancel()
