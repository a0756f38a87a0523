"""Streaming responses (Ollama's NDJSON, OpenAI's SSE, typed SSE events) and client-disconnect handling.

Whatever way a response ends (finished, client gone, error), the body iterator is closed, which
aborts its engine requests, and the request's admission slot is released."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.server.errors import APIError

log = logging.getLogger("tokenmill.server")
# An event stream is not cached, nor buffered by a proxy in front (nginx's X-Accel-Buffering).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


class StreamResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], *, media_type: str, on_close: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(content, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # Starlette cancels the body when the client disconnects (uvicorn speaks ASGI 2.3).
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            if self._on_close is not None:
                self._on_close()


def as_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    log.exception("error while streaming a response")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def ndjson_response(items: AsyncIterator[dict], *, on_close: Callable[[], None] | None = None) -> StreamResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for obj in items:
                yield json.dumps(obj) + "\n"
        except Exception as exc:  # noqa: BLE001 - the status is sent; the error is the last line
            yield json.dumps(as_api_error(exc).ollama_body()) + "\n"
        finally:
            await items.aclose()  # type: ignore[attr-defined]

    return StreamResponse(body(), media_type="application/x-ndjson", on_close=on_close)


def sse_response(items: AsyncIterator[dict], *, on_close: Callable[[], None] | None = None,
                 openai_errors: bool = True, done_marker: bool = True) -> StreamResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for obj in items:
                yield f"data: {json.dumps(obj)}\n\n"
        except Exception as exc:  # noqa: BLE001 - the status is sent; the error is the last event
            err = as_api_error(exc)
            yield f"data: {json.dumps(err.openai_body() if openai_errors else err.ollama_body())}\n\n"
        finally:
            await items.aclose()  # type: ignore[attr-defined]
        if done_marker:
            yield "data: [DONE]\n\n"

    return StreamResponse(body(), media_type="text/event-stream", on_close=on_close, headers=SSE_HEADERS)


def event_stream_response(events: AsyncIterator[dict], *, on_close: Callable[[], None] | None = None
                          ) -> StreamResponse:
    """Typed server-sent events, each as an `event: <its type>` line and its JSON (OpenAI's Responses
    API and Anthropic's Messages API stream so); the generator sends its own error event."""
    async def body() -> AsyncIterator[str]:
        try:
            async for ev in events:
                yield f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n"
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    return StreamResponse(body(), media_type="text/event-stream", on_close=on_close, headers=SSE_HEADERS)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work` (a non-streaming generation) but cancel it, aborting its engine requests, if the
    client hangs up first. The request body must already have been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()
