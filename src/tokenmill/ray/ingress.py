"""The HTTP front of a Ray deployment, behind Ray Serve's proxy: it reads a request, works out its
routing key (so the prefix-aware router can place it), hands it to a tokenmill replica through the
deployment handle and relays the replica's response, streaming chunk by chunk. Clients see the
same OpenAI and Ollama APIs as from `tokenmill serve`, plus an `x-tokenmill-replica` header.

A replica that dies before its response is complete costs the client nothing: the request is sent
again, and the router no longer offers the dead replica. One that dies mid-stream (after the client
got part of it) ends the stream with an error event in the stream's own format."""
from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from tokenmill.config import Config
from tokenmill.ray.asgi_bridge import ForwardedRequest, ResponseStart
from tokenmill.ray.metrics import render
from tokenmill.ray.router_stats import ROUTER_STATS
from tokenmill.ray.routing_key import RoutingKeyMaker
from tokenmill.server.access import presented_key
from tokenmill.server.errors import APIError, error_response, is_anthropic_path, stream_error_line
from tokenmill.server.metrics import CONTENT_TYPE
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.ray")

ATTEMPTS = 3                 # replicas tried for a request whose replica died before answering
REPLICA_HEADER = b"x-tokenmill-replica"
# Model management acts on one process (or one node's model store); in a deployment the model comes
# from its configuration.
PER_PROCESS_ROUTES = {("POST", "/load"), ("POST", "/api/pull"), ("DELETE", "/api/delete"), ("POST", "/api/copy"),
                      ("POST", "/api/create")}
PER_PROCESS_PREFIXES = ("/api/blobs/",)  # blobs go to one node's store, for /api/create
REPLICA_GONE = (RayActorError, ActorUnavailableError)


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _error_tail(start: ResponseStart, path: str, err: APIError) -> bytes:
    """The last chunk of a stream that broke after it began: an SSE event or an NDJSON line."""
    content_type = dict(start.headers).get(b"content-type", b"")
    line = stream_error_line(err, path)
    if b"event-stream" not in content_type:
        return f"{line}\n".encode()
    # Anthropic's SDK reads an error from an `event: error` event; OpenAI's from any data line.
    event = "event: error\n" if is_anthropic_path(path) else ""
    return f"{event}data: {line}\n\n".encode()


class TokenmillIngress:
    def __init__(self, replicas: DeploymentHandle, settings: Config):
        from tokenmill.store import ensure_model

        self.replicas = replicas.options(stream=True)
        self.settings = settings
        # The tokenizer alone (no weights): the router needs the prompt's tokens, not the model.
        tokenizer = Tokenizer.from_file(ensure_model(settings.model, progress=False))
        self.keys = RoutingKeyMaker(tokenizer, settings.block_size)

    def _authorized(self, request: Request) -> bool:
        if not self.settings.api_key:
            return True
        given = presented_key({k: v for k, v in request.headers.raw})
        return hmac.compare_digest(given, self.settings.api_key.encode())

    async def __call__(self, request: Request) -> Response:
        method, path = request.method, request.url.path
        if method == "GET" and path == "/metrics":
            if not self._authorized(request):
                return error_response(request, APIError(401, "missing or wrong API key", code="unauthorized"))
            return PlainTextResponse(render(ROUTER_STATS), media_type=CONTENT_TYPE)
        if (method, path) in PER_PROCESS_ROUTES or path.startswith(PER_PROCESS_PREFIXES):
            return error_response(request, APIError(
                400, f"{path} is not available on a Ray deployment: every replica serves the configured model; "
                     "change `model` in its configuration and redeploy", code="not_supported_on_ray"))
        try:
            body = await read_body(request, self.settings.max_body_bytes)
        except BodyTooLarge:
            return error_response(request, APIError(413, f"request body is larger than "
                                                         f"{self.settings.max_body_bytes} bytes"))
        headers = tuple((k.lower(), v) for k, v in request.headers.raw)
        client = (request.client.host, request.client.port) if request.client else None
        forwarded = ForwardedRequest(method, path, request.url.query.encode(), headers, body, client,
                                     self.keys.key(path, body, request.headers))
        try:
            start, payload = await self._start(forwarded)
        except APIError as err:
            return error_response(request, err)
        if isinstance(payload, bytes):
            response = Response(payload, status_code=start.status)
        else:
            response = StreamingResponse(self._relay(payload, start, path), status_code=start.status)
        response.raw_headers = [*start.headers, (REPLICA_HEADER, start.replica.encode())]
        return response

    async def _start(self, forwarded: ForwardedRequest):
        """The response's start (status and headers) and then its whole body, or for a stream the
        rest of it, from the first replica that gets that far. A body of known length is read here,
        so a replica that dies before it is complete costs a retry, not a truncated response."""
        problem = "no replica answered"
        for _ in range(ATTEMPTS):
            stream = self.replicas.handle.remote(forwarded)
            try:
                start = await stream.__anext__()
                if not isinstance(start, ResponseStart):
                    raise APIError(500, f"internal error: a replica answered {type(start).__name__} first")
                if any(name == b"content-length" for name, _ in start.headers):
                    return start, b"".join([chunk async for chunk in stream])
                return start, stream
            except REPLICA_GONE as exc:
                problem = f"its replica died: {type(exc).__name__}"
                log.warning("%s %s: %s; sending it to another replica", forwarded.method, forwarded.path, problem)
            except StopAsyncIteration:
                problem = "the replica closed the response without answering"
            except APIError:
                raise
            except Exception as exc:  # noqa: BLE001 - a replica bug: a JSON 500 like the server's own, not Serve's text
                log.exception("%s %s failed on its replica", forwarded.method, forwarded.path)
                raise APIError(500, f"internal error: {type(exc).__name__}") from None
        raise APIError(503, f"the request could not be served: {problem}", code="replica_died", retry_after=1)

    async def _relay(self, stream, start: ResponseStart, path: str) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in stream:
                yield chunk
            finished = True
        except REPLICA_GONE as exc:
            finished = True
            log.warning("replica %s died mid-response on %s: %s", start.replica, path, type(exc).__name__)
            yield _error_tail(start, path, APIError(503, f"the replica serving this request died "
                                                         f"({type(exc).__name__}); send it again", code="replica_died"))
        except Exception as exc:  # noqa: BLE001 - the status is sent: the error travels in the stream
            finished = True
            log.exception("the response from replica %s on %s broke", start.replica, path)
            yield _error_tail(start, path, APIError(500, f"internal error: {type(exc).__name__}"))
        finally:
            if not finished:
                stream.cancel()  # the client left early: stop the replica's work too
