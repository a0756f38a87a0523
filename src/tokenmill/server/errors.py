"""One exception type for every client-facing failure, rendered in the shape each API's clients
parse: Anthropic's under /v1/messages, OpenAI's envelope elsewhere under /v1, Ollama's
`{"error": "..."}` everywhere else.

Whatever a message says, a client never reads where the server keeps its files in it: a path under
the models directory, TOKENMILL_HOME, the home, working or temporary directory is cut to its last
part (`.../models/tiny.gguf` -> `tiny.gguf`) when the body is rendered, whichever exception it came
from. And no message breaks its response: characters UTF-8 cannot carry (lone surrogates a client
sent) are escaped."""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger("tokenmill.server")

# OpenAI's `type` for each status; its SDK maps status codes to exception classes, not types.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}
# Anthropic's error `type` for each status (its SDK, too, picks the exception class by status).
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str] | None:
        if self.status == 408:  # the rest of the body may still come: the connection cannot be reused
            return {"Connection": "close"}
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None

    @property
    def public_message(self) -> str:
        return client_safe(self.message)

    def openai_body(self) -> dict:
        kind = _OPENAI_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        param = client_safe(self.param) if self.param is not None else None
        return {"error": {"message": self.public_message, "type": kind, "param": param, "code": self.code}}

    def ollama_body(self) -> dict:
        return {"error": self.public_message}

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.public_message}}


def _server_roots() -> list[str]:
    """Directories whose paths are the server's business, longest first (so the most specific wins)."""
    from tokenmill.store.local import models_dir

    roots = {str(models_dir()), os.environ.get("TOKENMILL_HOME", ""), str(Path.home()), tempfile.gettempdir()}
    try:
        roots |= {str(models_dir().resolve()), os.getcwd()}
    except OSError:
        pass
    return sorted((r.rstrip("/") for r in roots if r and r.rstrip("/")), key=len, reverse=True)


def redact_paths(text: str) -> str:
    """`text` with every path under a server directory cut to its last part."""
    roots = _server_roots()
    if not any(root in text for root in roots):
        return text
    # A root counts only as a whole path component: `/tmp` in `/var/tmp2/x` is left alone.
    pattern = r"(?<![\w./~-])(?:" + "|".join(map(re.escape, roots)) + r")(?![\w.~-])(?:/[^\s'\"`,;)]*)?"

    def last_part(match: re.Match) -> str:
        path = match.group(0).rstrip("/.")
        return path.rsplit("/", 1)[-1] or "."

    return re.sub(pattern, last_part, text)


def client_safe(text: str) -> str:
    """A message as a client may read it: no server paths, nothing that cannot be sent as UTF-8."""
    return redact_paths(text).encode("utf-8", "backslashreplace").decode("utf-8")


def shown_value(value: object, limit: int = 60) -> str:
    """A bad value as an error message repeats it: as JSON, cut to `limit` characters, so a value
    the client sent by mistake (a 300-digit number, a whole prompt) does not come back in full."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def body_for_path(path: str, err: APIError) -> dict:
    """The error body in the shape of the API a path belongs to."""
    if is_anthropic_path(path):
        return err.anthropic_body()
    return err.openai_body() if path.startswith("/v1/") else err.ollama_body()


def error_body(request: Request, err: APIError) -> dict:
    return body_for_path(request.url.path, err)


def error_response(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(error_body(request, err), status_code=err.status, headers=err.headers)


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(request, exc)


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    # Routing errors (404 unknown path, 405 wrong method) in the same envelope as ours.
    assert isinstance(exc, HTTPException)
    return error_response(request, APIError(exc.status_code, str(exc.detail)))


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


def stream_error_line(err: APIError, path: str) -> str:
    """An error that happens after a stream began: the status is already sent, so it travels as the
    final chunk (an SSE event's data for OpenAI and Anthropic clients, an NDJSON line for Ollama's)."""
    return json.dumps(body_for_path(path, err))
