"""Ollama's model-management endpoints: /, /api/version, /api/tags, /api/show, /api/ps, /api/pull."""
from __future__ import annotations

import importlib.metadata
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tokenmill.server import model_info
from tokenmill.server.errors import APIError
from tokenmill.server.pulling import pull_events
from tokenmill import kernels
from tokenmill.server.streaming import ndjson_response
from tokenmill.server.validation import get_bool, get_str, read_json, warn_unknown
from tokenmill.store import StoreError
from tokenmill.store.catalog import lookup

# Clients gate features on the Ollama version they talk to; this is the API level we implement.
OLLAMA_API_VERSION = "0.12.6"
SHOW_FIELDS = {"model", "name", "verbose", "system", "template", "options"}
PULL_FIELDS = {"model", "name", "insecure", "stream", "username", "password"}


def tokenmill_version() -> str:
    try:
        return importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


async def root(request: Request) -> Response:
    # Exactly Ollama's text: some clients probe for it.
    return PlainTextResponse("Ollama is running")


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_API_VERSION, "tokenmill": tokenmill_version(),
                         "kernels": kernels.describe()})


async def tags(request: Request) -> Response:
    entries = await run_in_threadpool(model_info.installed_entries, request.app.state.host)
    return JSONResponse({"models": [model_info.ollama_tag(e) for e in entries]})


async def show(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, SHOW_FIELDS, "/api/show")
    name = get_str(body, "model") or get_str(body, "name", required=True, label="model")
    host = request.app.state.host
    entry = await run_in_threadpool(model_info.find_entry, host, name)
    if entry is None:
        raise APIError(404, f"model {name!r} not found", param="model")
    served = host.current
    metadata = served.engine.loaded.gguf.metadata if served is not None and served.matches(name) else None
    verbose = bool(get_bool(body, "verbose", False))
    return JSONResponse(await run_in_threadpool(model_info.show, entry, verbose, metadata))


async def ps(request: Request) -> Response:
    served = request.app.state.host.current
    if served is None:
        return JSONResponse({"models": []})
    e = await run_in_threadpool(model_info.served_entry, served)
    # Loaded until the server stops; Ollama clients expect some expiry, so give a far one.
    expires = model_info.iso_time(time.time() + 10 * 365 * 86400)
    return JSONResponse({"models": [{
        "name": e.name, "model": e.name, "size": e.size, "digest": e.digest,
        "details": model_info.ollama_details(e), "expires_at": expires, "size_vram": 0,
        "context_length": served.engine.max_model_len,
    }]})


async def pull(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, PULL_FIELDS, "/api/pull")
    name = get_str(body, "model") or get_str(body, "name", required=True, label="model")
    try:
        spec = lookup(name)
    except StoreError as exc:
        raise APIError(404, f"pull model manifest: {exc}", param="model") from None
    events = pull_events(spec, request.app.state.fetcher)
    if get_bool(body, "stream", True):
        return ndjson_response(_store_errors(events))
    last = {}
    async for last in _store_errors(events):
        pass
    return JSONResponse(last)


async def _store_errors(events):
    try:
        async for e in events:
            yield e
    except StoreError as exc:
        raise APIError(500, str(exc)) from None


def routes() -> list[Route]:
    return [
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/api/version", version, methods=["GET"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/ps", ps, methods=["GET"]),
        Route("/api/pull", pull, methods=["POST"]),
    ]
