"""Who may call the server and how much they may send: an API key (Bearer, as vLLM and llama-server
take it) on every route but /health, CORS origins as Ollama's OLLAMA_ORIGINS (localhost origins by
default, so a web page elsewhere cannot drive a local server), a request body size limit, and a
time limit on receiving the body (a client that sends headers then dribbles the body gets 408).

Plain ASGI middleware, outside the routes: a rejected request never reaches a handler, and a
handler never has to remember to check."""
from __future__ import annotations

import asyncio
import hmac
import re

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import APIError, error_response

# Probes must work without a key: load balancers and orchestrators do not carry one.
OPEN_PATHS = frozenset({"/health"})

# Ollama's default allowed origins (envconfig.AllowedOrigins).
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0")
DEFAULT_ORIGINS = (
    *(f"{scheme}://{host}{port}" for host in _LOCAL_HOSTS for scheme in ("http", "https") for port in ("", ":*")),
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
)


def origin_regex(patterns: list[str]) -> str:
    """One regex for origin patterns where `*` stands for anything (Starlette fullmatches it)."""
    return "|".join(re.escape(p).replace(r"\*", ".*") for p in patterns)


def parse_origins(extra: str) -> list[str]:
    return [*DEFAULT_ORIGINS, *(o.strip() for o in extra.split(",") if o.strip())]


async def _reject(scope: Scope, receive: Receive, send: Send, err: APIError, headers: dict[str, str] | None = None
                  ) -> None:
    response = error_response(Request(scope), err)
    response.headers.update(headers or {})
    await response(scope, receive, send)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # Constant-time comparison: the time taken says nothing about how much of a guess was right.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            err = APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")
            await _reject(scope, receive, send, err, {"WWW-Authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body declared or found to be larger than max_bytes. The count is kept as the body
    arrives, so a client that sends no Content-Length (chunked) is held to the limit too."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            err = APIError(413, f"request body is {int(declared)} bytes; the limit is {self.max_bytes}")
            await _reject(scope, receive, send, err)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the handler that reads the body: the app's handler renders it.
                    raise APIError(413, f"request body exceeds the limit of {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)


class BodyTimeoutMiddleware:
    """408 when a request's body has not fully arrived `seconds` after its headers. One deadline for
    the whole body, not per piece: a byte every few seconds would otherwise hold a connection and
    a handler forever. Once the body is in, receive() (a disconnect watch) is left alone."""

    def __init__(self, app: ASGIApp, seconds: float):
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.seconds
        body_done = False

        async def timed() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                # Raised inside the handler that reads the body: the app's handler renders it.
                raise APIError(408, f"the request body did not arrive within {self.seconds:g} s",
                               code="body_timeout") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed, send)


def middleware(api_key: str, origins: str, max_body_bytes: int, body_timeout: float = 30.0) -> list[Middleware]:
    """Outermost first: CORS answers preflights (which carry no key) and adds its headers to every
    response, 401s included; then the key; then the body deadline and size limit."""
    stack = [Middleware(CORSMiddleware, allow_origin_regex=origin_regex(parse_origins(origins)),
                        allow_methods=["*"], allow_headers=["*"])]
    if api_key:
        stack.append(Middleware(APIKeyMiddleware, api_key=api_key))
    stack.append(Middleware(BodyTimeoutMiddleware, seconds=body_timeout))
    stack.append(Middleware(BodyLimitMiddleware, max_bytes=max_body_bytes))
    return stack
