"""Access control at the door: the API key on every route but /health, CORS origins, and the body
size limit. No model is needed: all of this happens before a handler runs."""
from __future__ import annotations

import httpx
import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from tokenmill.config import Config
from tokenmill.server import ModelHost, create_app

KEY = "s3cret-key"
# The app serves on loopback (Config().host): in-process clients send a loopback Host, not "testserver".
LOCAL = "http://localhost"


def app_with(**settings):
    return create_app(ModelHost(), Config(**settings), shutdown_host=False)


def every_route(app) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        assert isinstance(route, Route)
        out += [(m, route.path) for m in sorted(route.methods) if m != "HEAD"]
    return out


@pytest.fixture(scope="module")
def keyed():
    with TestClient(base_url=LOCAL, app=app_with(api_key=KEY)) as c:
        yield c


def test_every_route_but_health_needs_the_key(keyed):
    routes = every_route(keyed.app)
    assert len(routes) > 20
    for method, path in routes:
        if path == "/health":
            continue
        r = keyed.request(method, path, json={})
        assert r.status_code == 401, (method, path, r.status_code)
        assert r.headers["www-authenticate"] == "Bearer"
        body = r.json()
        message = body["error"]["message"] if path.startswith("/v1/") else body["error"]
        if path.startswith("/v1/messages"):  # Anthropic's error shape
            assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert "API key" in message, (path, body)
        wrong = keyed.request(method, path, json={}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401, (method, path)
        assert keyed.request(method, path, json={}, headers={"x-api-key": "nope"}).status_code == 401
        # A wrong Bearer token is not rescued by a right x-api-key: the Bearer token is the one read.
        both = {"Authorization": "Bearer nope", "x-api-key": KEY}
        assert keyed.request(method, path, json={}, headers=both).status_code == 401, (method, path)


def test_the_right_key_passes_and_health_needs_none(keyed):
    assert keyed.get("/health").status_code == 503  # no model loaded: answered, not refused
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"Authorization": f"bearer {KEY}"}, {"x-api-key": KEY}):
        r = keyed.get("/api/version", headers=headers)
        assert r.status_code == 200, r.text
    r = keyed.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_model"  # got past the door


def test_no_key_configured_means_open():
    with TestClient(base_url=LOCAL, app=app_with()) as c:
        assert c.get("/api/version").status_code == 200


def preflight(client, origin: str):
    return client.options("/api/chat", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                "Access-Control-Request-Headers": "content-type"})


def test_cors_allows_local_origins_only_by_default():
    with TestClient(base_url=LOCAL, app=app_with(api_key=KEY)) as c:
        for origin in ("http://localhost", "http://localhost:3000", "https://127.0.0.1:8443", "app://obsidian.md"):
            r = preflight(c, origin)  # a preflight carries no key and must not need one
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, origin
        r = preflight(c, "https://evil.example")
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = c.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        r = c.get("/health", headers={"Origin": "http://localhost:5173"})
        assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
        # A refusal still carries the CORS headers, so the page can read why.
        r = c.get("/api/tags", headers={"Origin": "http://localhost:5173"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://localhost:5173"


def test_cors_extra_origins_with_wildcards():
    with TestClient(base_url=LOCAL, app=app_with(origins="https://app.example.com, https://*.corp.example")) as c:
        for origin in ("https://app.example.com", "https://chat.corp.example", "http://localhost:1"):
            assert preflight(c, origin).status_code == 200, origin
        assert preflight(c, "https://app.example.com.evil.io").status_code == 400
    with TestClient(base_url=LOCAL, app=app_with(origins="*")) as c:
        assert preflight(c, "https://anywhere.example").status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/api/generate", "/completion"])
def test_body_over_the_limit_is_413_json(path):
    with TestClient(base_url=LOCAL, app=app_with(max_body_bytes=64)) as c:
        body = b'{"prompt": "' + b"x" * 100 + b'"}'
        r = c.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "limit" in r.text and r.json()["error"]

        def chunks():  # no Content-Length: the limit holds as the body arrives
            yield body[:50]
            yield body[50:]

        r = c.post(path, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "limit" in r.text, r.text
        assert c.post(path, json={"model": "m", "prompt": "x"}).status_code == 404  # small bodies pass (no model "m")


def test_slow_or_huge_headers_cannot_hold_a_connection():
    import http.client
    import socket
    import time

    from server_helpers import LiveServer
    from tokenmill.server.connections import protocol_with_timeout

    server = LiveServer(app_with(), http=protocol_with_timeout(0.5)).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as slow:
            slow.sendall(b"GET /api/version HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
            start = time.monotonic()
            assert slow.recv(1024) == b""  # closed by the server
            assert 0.3 < time.monotonic() - start < 3
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as big:
            big.sendall(b"GET /api/version HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
            reply = big.recv(4096)
            assert reply.startswith(b"HTTP/1.1 431") and b"request headers exceed" in reply
        # A prompt client on a kept-alive connection is not cut off by the header timer.
        ok = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        try:
            for _ in range(2):
                ok.request("GET", "/api/version")
                response = ok.getresponse()
                assert response.status == 200 and response.read()
                time.sleep(0.6)
        finally:
            ok.close()
    finally:
        server.stop()


def _reply(sock) -> bytes:
    """What the server sent on `sock` until it closed it (or 5 s passed)."""
    import socket

    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return out


def test_headers_over_the_limit_are_431_json_however_they_arrive():
    import json
    import socket
    import time

    from server_helpers import LiveServer
    from tokenmill.server.connections import MAX_HEADER_BYTES, protocol_with_timeout

    def send_in_pieces(sock, head: bytes) -> None:
        for at in range(0, len(head), 20_000):  # each piece reaches the server on its own
            sock.sendall(head[at:at + 20_000])
            time.sleep(0.02)

    def get(size: int) -> bytes:
        return b"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size + b"\r\n\r\n"

    server = LiveServer(app_with(), http=protocol_with_timeout(5)).start()
    try:
        for size in (70_000, 200_000):
            # A fresh connection, then a kept-alive one after a first request.
            for first in (b"", get(10)):
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                    if first:
                        sock.sendall(first)
                        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
                    try:
                        send_in_pieces(sock, get(size))
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the server answered and closed before the rest was sent
                    head, _, body = _reply(sock).partition(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 431") and b"application/json" in head, (size, first, head)
                    assert json.loads(body) == {"error": f"request headers exceed {MAX_HEADER_BYTES} bytes"}
        # Under the limit, in pieces larger than h11's own default limit (16 KiB): served.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            send_in_pieces(sock, get(MAX_HEADER_BYTES - 1000))
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            # The blank line that ends a head split between two pieces: still one head, counted once.
            for _ in range(3):
                head = get(MAX_HEADER_BYTES // 2)
                sock.sendall(head[:-1])
                time.sleep(0.02)
                sock.sendall(head[-1:])
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()


def test_a_body_dribbled_too_slowly_gets_408_json_and_the_connection_closes():
    import json
    import socket
    import time

    from server_helpers import LiveServer

    server = LiveServer(app_with(body_timeout=0.5)).start()
    try:
        for path in ("/api/generate", "/v1/chat/completions"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as slow:
                slow.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             "Content-Length: 1000\r\n\r\n".encode())
                start = time.monotonic()
                reply = b""
                for piece in (b'{"model": "m", ', b'"prompt": "a', b"aaa"):  # a few bytes now and then
                    slow.sendall(piece)
                    time.sleep(0.15)
                while chunk := slow.recv(65536):  # the server answers, then closes the connection
                    reply += chunk
                assert 0.4 < time.monotonic() - start < 3
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), head
            error = json.loads(body)["error"]
            message = error["message"] if path.startswith("/v1/") else error
            assert "did not arrive within 0.5 s" in message
        # A body sent at once is not affected (404: there is no model "m").
        with httpx.Client(base_url=server.url, timeout=5) as c:
            assert c.post("/api/generate", json={"model": "m", "prompt": "x"}).status_code == 404
    finally:
        server.stop()
