"""Ollama's model-management endpoints: /, /api/version, /api/tags, /api/show, /api/ps, /api/pull,
/api/push (refused: there is no registry), /api/delete, /api/copy, /api/create."""
from __future__ import annotations

import asyncio
import importlib.metadata
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tokenmill.server import model_info
from tokenmill.server.errors import APIError
from tokenmill.server.pulling import pull_events
from tokenmill import cpu_threads, kernels
from tokenmill.server.streaming import ndjson_response
from tokenmill.server.validation import get_bool, get_model_name, model_field, read_json, warn_unknown
from tokenmill.store import StoreError
from tokenmill.store.catalog import UnknownModelError, lookup
from tokenmill.store.derived import ModelInUseError, find_derived, normalize_name, save_derived
from tokenmill.store.names import DeletedModel, copy_model, delete_model, resolve_requested
from tokenmill.server.model_create import CREATE_FIELDS, create_request

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
    threads = cpu_threads.current_threads() or cpu_threads.default_threads()
    return JSONResponse({"version": OLLAMA_API_VERSION, "tokenmill": tokenmill_version(),
                         "kernels": kernels.describe(),
                         "threads": {"count": threads.count, "reason": threads.reason,
                                     "torch_intra_op": cpu_threads.torch_threads()}})


async def tags(request: Request) -> Response:
    entries = await run_in_threadpool(model_info.installed_entries, request.app.state.host)
    return JSONResponse({"models": [model_info.ollama_tag(e) for e in entries]})


async def show(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, SHOW_FIELDS, "/api/show")
    name = model_field(body)
    host = request.app.state.host
    entry = await run_in_threadpool(model_info.find_entry, host, name)
    if entry is None:
        raise APIError(404, f"model {name!r} not found", param="model")
    served = host.find_loaded(name) if entry.derived is None else host.find_loaded(entry.derived.base)
    metadata = served.engine.loaded.gguf.metadata if served is not None else None
    verbose = bool(get_bool(body, "verbose", False))
    return JSONResponse(await run_in_threadpool(model_info.show, entry, verbose, metadata))


async def ps(request: Request) -> Response:
    """Each loaded model with its size in memory (weights + KV cache), how much of it is on a GPU
    (size_vram, as Ollama: all of it for a model on the GPU, 0 on the CPU) and when it will unload."""
    models = []
    for served in request.app.state.host.loaded_models():
        e = await run_in_threadpool(model_info.served_entry, served)
        # Kept forever (keep_alive < 0): Ollama shows a far-future expiry too.
        expires = served.expires_at if served.expires_at is not None else time.time() + 10 * 365 * 86400
        models.append({"name": e.name, "model": e.name, "size": served.size_bytes, "digest": e.digest,
                       "details": model_info.ollama_details(e), "expires_at": model_info.iso_time(expires),
                       "size_vram": served.gpu_bytes, "context_length": served.engine.max_model_len})
    return JSONResponse({"models": models})


async def delete(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, {"model", "name"}, "/api/delete")
    name = model_field(body)
    host = request.app.state.host
    try:
        # A created model goes without resolving its base (whose blob may be gone); a base model is
        # looked up as any request's name is (never a path).
        if await run_in_threadpool(find_derived, name) is None:
            await run_in_threadpool(resolve_requested, name, host.served_files())
        # The store checks (models made from it, where its file is) before it removes anything, and
        # only then does the model stop being served: a refused delete changes nothing.
        deleted = await run_in_threadpool(delete_model, name)
    except UnknownModelError:
        raise APIError(404, f"model \"{name}\" not found", param="model") from None
    except ModelInUseError as exc:
        raise APIError(409, str(exc), param="model") from None
    except StoreError as exc:
        raise APIError(400, str(exc), param="model") from None
    for key in _served_by(host, deleted):  # as Ollama: a deleted model stops being served
        if host.unload(key):
            await _unloaded(host, key)
    return JSONResponse({})


def _served_by(host, deleted: DeletedModel) -> list[str]:
    """Names that unload what served the deleted model. A base model: its own name. A derived model:
    the engine loaded under its own name (one made from a blob), or the one on the blob that went
    with it; never its base's, which a copy of an installed model shares with the base."""
    if not deleted.derived:
        return [deleted.name]
    gone = normalize_name(deleted.name)
    removed = deleted.removed.resolve() if deleted.removed is not None else None
    return [str(m.path) for m in host.loaded_models() if normalize_name(m.name) == gone or m.path.resolve() == removed]


async def _unloaded(host, name: str, timeout: float = 10.0) -> None:
    """Wait (without blocking the loop) for an unload the host started; requests in flight finish first."""
    deadline = time.monotonic() + timeout
    while host.find_loaded(name) is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def copy(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, {"source", "destination"}, "/api/copy")
    source = get_model_name(body, "source", required=True)
    destination = get_model_name(body, "destination", required=True)
    try:
        await run_in_threadpool(resolve_requested, source, request.app.state.host.served_files())
        await run_in_threadpool(copy_model, source, destination)
    except UnknownModelError:
        raise APIError(404, f"model \"{source}\" not found", param="source") from None
    except StoreError as exc:
        raise APIError(400, str(exc), param="destination") from None
    return JSONResponse({})


async def create(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, CREATE_FIELDS, "/api/create")
    name = model_field(body)
    try:
        made = await run_in_threadpool(create_request, body)  # compiles a TEMPLATE: off the loop
        # Merging adapters reads and writes the whole model (seconds): off the loop too.
        await run_in_threadpool(save_derived, name, made.base, made.profile, made.adapters)
    except UnknownModelError as exc:
        raise APIError(404, f"base model not found: {exc}", param="from") from None
    except StoreError as exc:
        raise APIError(400, str(exc), param=_create_param(body, exc)) from None
    statuses = [{"status": "using existing layers"}, {"status": "writing manifest"}, {"status": "success"}]
    if get_bool(body, "stream", True):
        async def events():
            for s in statuses:
                yield s
        return ndjson_response(events())
    return JSONResponse(statuses[-1])


def _create_param(body: dict, exc: StoreError) -> str:
    """The field a refused create's error is about."""
    if body.get("adapters") and "adapter" in str(exc):
        return "adapters"
    return "files" if body.get("files") else "modelfile" if body.get("modelfile") else "from"


async def pull(request: Request) -> Response:
    body = await read_json(request)
    warn_unknown(body, PULL_FIELDS, "/api/pull")
    name = model_field(body)
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


async def push(request: Request) -> Response:
    """Ollama's push uploads to a registry; there is none here. Said so, rather than a bare 404
    that the client reads as "model not found"."""
    body = await read_json(request)
    warn_unknown(body, PULL_FIELDS, "/api/push")
    model_field(body)
    raise APIError(501, "push is not supported: tokenmill has no registry to push models to")


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
        Route("/api/push", push, methods=["POST"]),
        Route("/api/delete", delete, methods=["DELETE"]),
        Route("/api/copy", copy, methods=["POST"]),
        Route("/api/create", create, methods=["POST"]),
    ]
