"""Ollama's blob endpoints, how its clients push a model file before creating a model from it:
`HEAD /api/blobs/sha256:<hex>` (200 held, 404 not) and `POST /api/blobs/sha256:<hex>` with the file
as the body (201 kept; 200 if it was held already).

The body streams to a temp file in the store while it is hashed (never into memory), held to
`--max-blob-gb` (413) rather than the generic body limit, and to a time limit that grows with what
has arrived: after the first `--body-timeout` seconds the upload must keep an average of MIN_RATE,
so a large file on a slow link gets through and a trickle does not hold a connection forever. Only
a body whose sha256 is the one the URL names and that is a valid GGUF model is kept (400 otherwise);
anything that fails leaves nothing behind."""
from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from tokenmill.server.errors import APIError
from tokenmill.server.streaming import ClientGone
from tokenmill.store.blobs import (
    BlobError,
    BlobTooLargeError,
    BlobUpload,
    has_blob,
    parse_digest,
)

log = logging.getLogger("tokenmill.server")

PREFIX = "/api/blobs/"
MIN_RATE = 256 * 1024  # bytes per second, on average, once the first body_timeout has passed
_FLUSH = 1 << 20       # bytes gathered before a write on a worker thread


def _digest(request: Request) -> str:
    try:
        return parse_digest(request.path_params["digest"])
    except BlobError as exc:
        raise APIError(400, f"invalid blob digest: {exc}", param="digest") from None


def _limit(request: Request) -> int:
    return int(request.app.state.settings.max_blob_gb * 1e9)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the blob is larger than the limit of {limit} bytes (the server's --max-blob-gb)")


async def _body(request: Request) -> AsyncIterator[bytes]:
    """The body's pieces, each waited for no longer than the time limit leaves; 408 past it, 499 if
    the client goes away."""
    loop = asyncio.get_running_loop()
    grace = request.app.state.settings.body_timeout
    start, received = loop.time(), 0
    pieces = request.stream().__aiter__()
    while True:
        deadline = start + grace + received / MIN_RATE
        try:
            piece = await asyncio.wait_for(pieces.__anext__(), max(deadline - loop.time(), 0.0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise APIError(408, f"the blob arrived slower than {MIN_RATE // 1024} KiB/s (after the first "
                                f"{grace:g} s)", code="body_timeout") from None
        except ClientDisconnect:
            raise ClientGone() from None
        received += len(piece)
        yield piece


async def head_blob(request: Request) -> Response:
    held = await run_in_threadpool(has_blob, _digest(request))
    return Response(status_code=200 if held else 404)


async def push_blob(request: Request) -> Response:
    digest = _digest(request)
    limit = _limit(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    if await run_in_threadpool(has_blob, digest):
        # Held already (as Ollama, 200): the body is read and dropped so the client's send completes.
        received = 0
        async for piece in _body(request):
            received += len(piece)
            if received > limit:
                raise _too_large(limit)
        return Response(status_code=200)
    upload = await run_in_threadpool(BlobUpload, digest, limit)
    try:
        pending = bytearray()
        async for piece in _body(request):
            pending += piece
            if len(pending) >= _FLUSH:
                await run_in_threadpool(upload.write, bytes(pending))
                pending.clear()
        await run_in_threadpool(upload.write, bytes(pending))
        await run_in_threadpool(upload.commit)
    except BlobTooLargeError:
        raise _too_large(limit) from None
    except BlobError as exc:
        raise APIError(400, str(exc), param="digest") from None
    except OSError as exc:  # the store's disk: full, read-only, ... (the message names no path)
        log.error("storing blob sha256:%s failed: %s", digest, exc)
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise APIError(507 if full else 500, f"the server could not store the blob: {exc.strerror or 'I/O error'}"
                       ) from None
    finally:
        await run_in_threadpool(upload.abort)
    log.info("blob sha256:%s stored (%d bytes)", digest, upload.size)
    return Response(status_code=201)


def routes() -> list[Route]:
    return [
        Route(PREFIX + "{digest}", head_blob, methods=["HEAD"]),
        Route(PREFIX + "{digest}", push_blob, methods=["POST"]),
    ]
