"""HTTP connections that a client cannot hold with endless request headers: too slow (slowloris)
or too large. uvicorn times out idle keep-alive connections between requests, but not a new
connection still sending its first request's headers; this protocol closes one that has not sent
complete headers within `header_timeout` seconds. And request headers larger than MAX_HEADER_BYTES
get a 431 with a JSON body however they arrive: in one piece or many, on a fresh connection or a
kept-alive one. h11 is given the same limit for the head it buffers (uvicorn's default is 16 KiB, and
its refusal a plain-text 400), so a head under the limit is served whichever way it was split."""
from __future__ import annotations

import asyncio
import json
import logging
import re

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("tokenmill.server")

MAX_HEADER_BYTES = 64 * 1024
_HEAD_END = re.compile(rb"\n\r?\n")  # the blank line that ends a request's head, as h11 finds it


def _header_error() -> bytes:
    body = json.dumps({"error": f"request headers exceed {MAX_HEADER_BYTES} bytes"}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)) + body


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout: float = 10.0
    _head_bytes = 0   # of the request head being received, in the pieces before this one
    _head_tail = b""  # its last bytes: the blank line that ends it may be split between two pieces

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = self.loop.call_later(self.header_timeout, self._expire)

    def data_received(self, data: bytes) -> None:
        # Between requests (IDLE), or with the current request read (DONE: a pipelined one), these
        # bytes are the next request's head. Only the new bytes are searched: a head dribbled a byte
        # at a time costs no more than one sent whole.
        if self.conn.their_state in (h11.IDLE, h11.DONE):
            seen = self._head_tail + data
            end = _HEAD_END.search(seen)
            size = self._head_bytes + (len(data) if end is None else end.start() - len(self._head_tail))
            if size > MAX_HEADER_BYTES:
                self._refuse_headers()
                return
            self._head_bytes, self._head_tail = (size, seen[-2:]) if end is None else (0, b"")
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        # h11 refused a head over its limit that data_received did not count whole (one that came
        # in the same piece as the end of the request before it): the same 431 as any other.
        if len(self.conn.trailing_data[0]) > MAX_HEADER_BYTES:
            self._refuse_headers()
            return
        super().send_400_response(msg)

    def _refuse_headers(self) -> None:
        self.transport.write(_header_error())
        self.transport.close()

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
