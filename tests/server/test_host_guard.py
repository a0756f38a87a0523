"""The DNS rebinding guard (Ollama's CVE-2024-28224): a server listening on loopback answers only
requests addressed to a loopback name or address, or to a name --allowed-hosts lists; one listening
on 0.0.0.0 or an interface checks nothing, as Ollama's does."""
from __future__ import annotations

import json
import socket

import pytest
from starlette.testclient import TestClient

from server_helpers import LiveServer
from tokenmill.config import Config
from tokenmill.server import ModelHost, create_app
from tokenmill.server.access import HostGuardMiddleware, host_name, is_loopback_host, listens_on_loopback

LOOPBACK_HOSTS = ["localhost", "localhost:11434", "LOCALHOST", "app.localhost:3000", "127.0.0.1", "127.0.0.1:8080",
                  "127.5.6.7", "[::1]", "[::1]:11434", "localhost.", "[::ffff:127.0.0.1]:80"]
FOREIGN_HOSTS = ["evil.example", "evil.example:11434", "127.0.0.1.evil.example", "localhost.evil.example",
                 "attacker-rebound.example.com:80", "192.168.1.10", "10.0.0.1:11434", "0.0.0.0", "[::]:11434",
                 "testserver", "1.2.3.4"]


def app_on(host: str = "127.0.0.1", **settings):
    return create_app(ModelHost(), Config(host=host, **settings), shutdown_host=False)


def get(app, host_header: str, path: str = "/api/version"):
    with TestClient(app, base_url="http://localhost") as c:
        return c.get(path, headers={"Host": host_header})


def test_host_names_and_loopback():
    assert host_name("LocalHost:11434") == "localhost" and host_name("[::1]:80") == "::1"
    assert host_name("::1") == "::1" and host_name("example.com.") == "example.com"
    assert all(is_loopback_host(host_name(h)) for h in LOOPBACK_HOSTS)
    assert not any(is_loopback_host(host_name(h)) for h in FOREIGN_HOSTS)


def test_which_binds_are_loopback():
    for bind in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert listens_on_loopback(bind), bind
    for bind in ("0.0.0.0", "::", "192.168.1.5", "10.1.2.3", ""):
        assert not listens_on_loopback(bind), bind


@pytest.fixture(scope="module")
def loopback_app():
    return app_on("127.0.0.1")


@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
def test_a_loopback_server_answers_loopback_hosts(loopback_app, host):
    assert get(loopback_app, host).status_code == 200


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
def test_a_loopback_server_refuses_other_hosts_with_403_json(loopback_app, host):
    r = get(loopback_app, host)
    assert r.status_code == 403 and "not allowed" in r.json()["error"] and "--allowed-hosts" in r.json()["error"]
    # Every route, /health and the OpenAI ones included (OpenAI's error envelope there).
    r = get(loopback_app, host, "/v1/models")
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert get(loopback_app, host, "/health").status_code == 403


def test_a_preflight_from_a_rebound_page_is_refused_too(loopback_app):
    with TestClient(loopback_app, base_url="http://localhost") as c:
        r = c.options("/api/chat", headers={"Host": "evil.example", "Origin": "http://evil.example",
                                            "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_allowed_hosts_adds_names_and_star_allows_any():
    app = app_on("127.0.0.1", allowed_hosts="myhost.lan, *.corp.example,proxy.internal:8443")
    for host in ("myhost.lan", "MyHost.lan:11434", "a.corp.example", "b.c.corp.example:80", "proxy.internal"):
        assert get(app, host).status_code == 200, host
    for host in ("evil.example", "corp.example.evil.example", "myhost.lan.evil.example"):
        assert get(app, host).status_code == 403, host
    anything = app_on("localhost", allowed_hosts="*")
    assert get(anything, "evil.example").status_code == 200


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "192.168.1.5"])
def test_a_server_listening_beyond_loopback_checks_no_host(bind):
    app = app_on(bind)
    for host in ("evil.example", "testserver", "192.168.1.5:11434", "localhost"):
        assert get(app, host).status_code == 200, host


def test_the_guard_and_allowed_hosts_come_from_the_settings_serve_reads():
    from tokenmill.config import load_config
    from tokenmill.cli import build_parser

    args = build_parser().parse_args(["serve", "--allowed-hosts", "myhost.lan"])
    settings = load_config(args, env={})
    assert settings.allowed_hosts == "myhost.lan" and settings.host == "127.0.0.1"
    app = create_app(ModelHost(), settings, shutdown_host=False)
    assert get(app, "myhost.lan").status_code == 200 and get(app, "evil.example").status_code == 403


def raw_request(port: int, request: bytes) -> tuple[bytes, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


def test_on_the_wire_http10_without_host_passes_and_a_foreign_host_gets_403():
    """HTTP/1.0 may leave Host out; browsers always send one, so a request without one cannot come
    from a rebound page and is answered."""
    server = LiveServer(app_on("127.0.0.1")).start()
    try:
        head, body = raw_request(server.port, b"GET /api/version HTTP/1.0\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and "version" in json.loads(body)
        head, body = raw_request(server.port, b"GET /api/version HTTP/1.1\r\nHost: evil.example:11434\r\n"
                                              b"Connection: close\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 403") and json.loads(body)["error"]
        head, _ = raw_request(server.port, f"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                                           "Connection: close\r\n\r\n".encode())
        assert head.startswith(b"HTTP/1.1 200")
    finally:
        server.stop()


def test_the_middleware_alone():
    guard = HostGuardMiddleware(app=None, allowed=["*.example.org"])
    assert guard.allows(None) and guard.allows(b"") and guard.allows(b"localhost:1")
    assert guard.allows(b"x.example.org") and not guard.allows(b"example.org.evil")
