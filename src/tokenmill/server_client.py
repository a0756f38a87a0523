"""The CLI's side of talking to a running tokenmill (or Ollama) server: where it is
(TOKENMILL_HOST, as OLLAMA_HOST), whether one answers, and JSON calls that turn HTTP errors into
one-line messages."""
from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tokenmill.config import DEFAULT_PORT, ConfigError, split_host_port


class ServerError(RuntimeError):
    """The server answered with an error (the message is the server's), or could not be reached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def server_url(explicit: str | None = None) -> str:
    """The server's base URL; a value that is no host[:port] is a ServerError naming where it came from."""
    if explicit:
        source, value = "--server", explicit
    else:
        source = next((n for n in ("TOKENMILL_HOST", "OLLAMA_HOST") if os.environ.get(n)), "")
        value = os.environ.get(source, "") if source else ""
    try:
        host, port = split_host_port(value) if value else ("127.0.0.1", None)
    except ConfigError as exc:
        raise ServerError(f"{source}: {exc}") from None
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"  # a server listening everywhere is reached on loopback
    host = f"[{host}]" if ":" in host else host
    # A server behind HTTPS (serve --ssl-certfile, or a proxy): https://host, port 443 unless given.
    secure = value.strip().lower().startswith("https://")
    return f"{'https' if secure else 'http'}://{host}:{port or (443 if secure else DEFAULT_PORT)}"


def _request(url: str, method: str, body: dict | None) -> urllib.request.Request:
    data = json.dumps(body).encode() if body is not None else None
    return urllib.request.Request(url, data, _headers("application/json"), method=method)


def _headers(content_type: str) -> dict[str, str]:
    headers = {"Content-Type": content_type}
    key = os.environ.get("TOKENMILL_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _error(base: str, exc: urllib.error.HTTPError) -> ServerError:
    if exc.code == 401:
        return _unauthorized(base)
    detail = exc.read().decode(errors="replace")
    try:
        obj = json.loads(detail)
        err = obj.get("error")
        detail = err.get("message") if isinstance(err, dict) else (err or detail)
    except (ValueError, AttributeError):
        pass
    return ServerError(f"server answered {exc.code}: {_cut(detail)}", exc.code)


def _cut(text: str, limit: int = 300) -> str:
    """A server's message on one line and of a readable length (an HTML error page or a huge body
    would otherwise fill the terminal)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _json(base: str, raw: bytes) -> dict:
    """A response body as JSON; anything else (a proxy's HTML page) is a ServerError, not a traceback."""
    try:
        return json.loads(raw)
    except ValueError:
        raise ServerError(f"{base} answered something that is not JSON: {_cut(raw.decode(errors='replace'), 80)}") \
            from None


def _unauthorized(base: str) -> ServerError:
    """A 401: a server is there, but wants a key (no fallback to the local store or in-process)."""
    if os.environ.get("TOKENMILL_API_KEY"):
        return ServerError(f"the server at {base} refused the API key in TOKENMILL_API_KEY", 401)
    return ServerError(f"the server at {base} requires an API key (set TOKENMILL_API_KEY)", 401)


def _unreachable(base: str, exc: Exception) -> ServerError:
    """A connection that failed or broke off (refused, reset, a body cut short: IncompleteRead is an
    HTTPException, not an OSError)."""
    if isinstance(exc, http.client.IncompleteRead):
        return ServerError(f"the server at {base} closed the connection before its answer was complete")
    return ServerError(f"cannot reach {base}: {getattr(exc, 'reason', None) or exc}")


def call(base: str, method: str, path: str, body: dict | None = None, timeout: float = 600) -> dict:
    try:
        with urllib.request.urlopen(_request(base + path, method, body), timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raise _error(base, exc) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _unreachable(base, exc) from None
    obj = _json(base, raw) if raw.strip() else {}
    if not isinstance(obj, dict):
        raise ServerError(f"{base} answered {type(obj).__name__} where a JSON object belongs")
    return obj


def has_blob(base: str, digest: str, timeout: float = 30) -> bool:
    """HEAD /api/blobs/<digest>: whether the server holds the blob already."""
    request = urllib.request.Request(f"{base}/api/blobs/{digest}", None, _headers("application/octet-stream"),
                                     method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return True
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise _error(base, exc) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _unreachable(base, exc) from None


def push_blob(base: str, digest: str, path: Path, timeout: float = 600) -> None:
    """POST /api/blobs/<digest> with the file as the body, streamed from disk (never read whole)."""
    with path.open("rb") as f:  # a missing file is the caller's OSError, not the server's
        headers = {**_headers("application/octet-stream"), "Content-Length": str(os.fstat(f.fileno()).st_size)}
        request = urllib.request.Request(f"{base}/api/blobs/{digest}", f, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            raise _error(base, exc) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise _unreachable(base, exc) from None


def stream(base: str, path: str, body: dict) -> Iterator[dict]:
    """NDJSON objects of a streaming Ollama response; an `error` object raises, and so does a stream
    that ends without its `done` object (a server that died or a connection cut mid-answer must not
    look like a finished, short answer)."""
    try:
        with urllib.request.urlopen(_request(base + path, "POST", body)) as resp:
            for line in resp:
                if line.strip():
                    obj = _json(base, line)
                    if not isinstance(obj, dict):
                        raise ServerError(f"{base} answered something that is not an Ollama stream")
                    if "error" in obj:
                        raise ServerError(_cut(str(obj["error"])))
                    yield obj
                    if obj.get("done"):
                        return
    except urllib.error.HTTPError as exc:
        raise _error(base, exc) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _unreachable(base, exc) from None
    raise ServerError(f"the server at {base} closed the connection before its answer was complete")


def answers(base: str, timeout: float = 0.5) -> bool:
    """True if something speaking the Ollama API listens at `base`. One that wants an API key this
    client lacks is there all the same: a ServerError saying so, not False."""
    try:
        with urllib.request.urlopen(_request(base + "/api/version", "GET", None), timeout=timeout) as resp:
            return "version" in json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise _unauthorized(base) from None
        return False
    except (OSError, ValueError, urllib.error.URLError):
        return False
