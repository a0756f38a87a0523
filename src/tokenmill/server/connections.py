"""HTTP connections that a client cannot hold with endless request headers: too slow (slowloris)
or too large. uvicorn times out idle keep-alive connections between requests, but not a new
connection still sending its first request's headers; this protocol closes one that has not sent
complete headers within `header_timeout` seconds. And h11 bounds only headers that arrive in pieces;
headers larger than MAX_HEADER_BYTES get a 431 with a JSON body however they arrive."""
from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("tokenmill.server")

MAX_HEADER_BYTES = 64 * 1024


def _header_error() -> bytes:
    body = json.dumps({"error": f"request headers exceed {MAX_HEADER_BYTES} bytes"}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)) + body


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout: float = 10.0
    _header_bytes = 0  # of the request headers being received

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = self.loop.call_later(self.header_timeout, self._expire)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # between requests: these bytes start a request's headers
            end = data.find(b"\r\n\r\n")  # where the headers end, if they end in this piece
            size = self._header_bytes + (len(data) if end < 0 else end)
            self._header_bytes = size if end < 0 else 0
            if size > MAX_HEADER_BYTES:
                self.transport.write(_header_error())
                self.transport.close()
                return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        # The first request's headers are in (scope is set when h11 parses them): uvicorn's own
        # keep-alive timeout covers the connection from now on.
        if self.scope is not None and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _expire(self) -> None:
        self._header_timer = None
        if self.scope is None and not self.transport.is_closing():
            log.info("closing a connection from %s: no complete request headers within %gs",
                     self.client, self.header_timeout)
            self.transport.close()


def protocol_with_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn.Config(http=...), which takes a class, not an instance."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": seconds})
