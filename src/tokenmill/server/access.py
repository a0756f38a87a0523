"""Who may call the server and how much they may send: on a server that listens on loopback, only
requests addressed to a loopback name (the DNS rebinding guard), an API key (Bearer, as vLLM and
llama-server take it, or x-api-key, as Anthropic's clients send it) on every route but /health, CORS
origins as Ollama's OLLAMA_ORIGINS (localhost origins by default, so a web page elsewhere cannot drive
a local server), a request body size limit, and a time limit on receiving the body (a client that
sends headers then dribbles the body gets 408).

Plain ASGI middleware, outside the routes: a rejected request never reaches a handler, and a
handler never has to remember to check."""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re
import socket

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


def host_name(header: str) -> str:
    """The name in a Host header, without its port, brackets or trailing dot, lower case."""
    host = header.strip().lower()
    if host.startswith("["):  # [::1]:11434
        return host[1:].partition("]")[0]
    if host.count(":") == 1:  # name:port (more than one colon: a bare IPv6 address)
        host = host.partition(":")[0]
    return host.rstrip(".")


def _loopback_address(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def is_loopback_host(host: str) -> bool:
    """localhost, *.localhost (RFC 6761: always loopback), 127.0.0.0/8 or ::1. A DNS rebinding attack
    needs a name the attacker's DNS answers for; none of these is one."""
    return host == "localhost" or host.endswith(".localhost") or _loopback_address(host)


def listens_on_loopback(bind_host: str) -> bool:
    """Whether a server bound to `bind_host` (an address or a name) is reachable from this machine only."""
    host = host_name(bind_host) if bind_host.startswith("[") else bind_host.strip().lower()
    if not host:
        return False
    if is_loopback_host(host):
        return True
    try:
        ipaddress.ip_address(host)
        return False  # 0.0.0.0, ::, or an interface's address
    except ValueError:
        pass
    try:  # a name: loopback when everything it resolves to is
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(_loopback_address(info[4][0]) for info in infos)


class HostGuardMiddleware:
    """Ollama's DNS rebinding guard (CVE-2024-28224): a web page on evil.example whose name the
    attacker then points at 127.0.0.1 would otherwise drive a local server from the victim's
    browser, same-origin, with no CORS check to stop it. Its requests still carry `Host:
    evil.example`; a server that listens on loopback answers only Host headers that are loopback
    names or addresses, or that the operator allowed (`--allowed-hosts`, `*` patterns, `*` alone: any),
    and refuses the rest with 403. A request without a Host header (HTTP/1.0) passes: browsers always
    send one, so it cannot come from a rebound page. Install it only on a loopback server: one that
    listens on 0.0.0.0 or an interface is reachable by any name, as Ollama's is."""

    def __init__(self, app: ASGIApp, allowed: list[str]):
        self.app = app
        names = [host_name(a) if a.strip() != "*" else "*" for a in allowed if a.strip()]
        self.allowed = re.compile(origin_regex(names)) if names else None

    def allows(self, header: bytes | None) -> bool:
        if not header:
            return True
        host = host_name(header.decode("latin-1"))
        return is_loopback_host(host) or (self.allowed is not None and self.allowed.fullmatch(host) is not None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"host")
        if not self.allows(header):
            shown = header.decode("latin-1")[:100]
            err = APIError(403, f"Host {shown!r} is not allowed: this server listens on loopback and answers "
                                "loopback names only (DNS rebinding guard); start it with --allowed-hosts to "
                                "allow another name", code="host_not_allowed")
            await _reject(scope, receive, send, err)
            return
        await self.app(scope, receive, send)


def parse_allowed_hosts(value: str) -> list[str]:
    return [h.strip() for h in value.split(",") if h.strip()]


def presented_key(headers: dict[bytes, bytes]) -> bytes:
    """The API key a request carries: `Authorization: Bearer <key>` (OpenAI's and Ollama's clients), or
    `x-api-key: <key>` (Anthropic's SDK, as llama-server takes it); b"" without one."""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer":
        return token.strip()
    return headers.get(b"x-api-key", b"").strip()


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        # Constant-time comparison: the time taken says nothing about how much of a guess was right.
        if not hmac.compare_digest(presented_key(dict(scope["headers"])), self.key):
            err = APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
                           code="invalid_api_key")
            await _reject(scope, receive, send, err, {"WWW-Authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)


# Routes that bound their own bodies: a blob upload is a model file, held to --max-blob-gb and to a
# time limit that grows with what has arrived (server/blobs.py), not to the limits for JSON bodies.
OWN_BODY_LIMITS = ("/api/blobs/",)


def _own_limits(scope: Scope) -> bool:
    return scope["path"].startswith(OWN_BODY_LIMITS)


class BodyLimitMiddleware:
    """413 for a body declared or found to be larger than max_bytes. The count is kept as the body
    arrives, so a client that sends no Content-Length (chunked) is held to the limit too."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _own_limits(scope):
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
        if scope["type"] != "http" or _own_limits(scope):
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


def middleware(api_key: str, origins: str, max_body_bytes: int, body_timeout: float = 30.0, *,
               listen_host: str | None = None, allowed_hosts: str = "") -> list[Middleware]:
    """Outermost first: the Host guard when the server listens on loopback (`listen_host`; None: not
    known to listen anywhere, an app driven in process); CORS answers preflights (which carry no
    key) and adds its headers to every response, 401s included; then the key; then the body deadline
    and size limit."""
    stack = []
    if listen_host is not None and listens_on_loopback(listen_host):
        stack.append(Middleware(HostGuardMiddleware, allowed=parse_allowed_hosts(allowed_hosts)))
    stack.append(Middleware(CORSMiddleware, allow_origin_regex=origin_regex(parse_origins(origins)),
                            allow_methods=["*"], allow_headers=["*"]))
    if api_key:
        stack.append(Middleware(APIKeyMiddleware, api_key=api_key))
    stack.append(Middleware(BodyTimeoutMiddleware, seconds=body_timeout))
    stack.append(Middleware(BodyLimitMiddleware, max_bytes=max_body_bytes))
    return stack
