"""Slow and numerous clients: uvicorn's HTTP/1.1 protocol with two bounds.

- ``server.read_timeout_s``: a request's headers must arrive within it (from the connection's start, or
  from the end of the previous response on a kept-alive connection); a client that trickles them is
  answered 408 and disconnected.  The body has the same bound once the headers are in (``read_json``).
- ``server.max_connections``: a connection beyond it gets a JSON 503 (``code: too_many_connections``) as
  soon as its request arrives, and is closed; the others are not slowed.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from corerun.server import protocol as P

logger = logging.getLogger("corerun.server")


def guarded_protocol(max_connections: int, read_timeout_s: float) -> type[H11Protocol]:
    """An ``H11Protocol`` class with these bounds (for ``uvicorn.Config(http=...)``)."""

    too_many = P.APIError(503, f"the server has {max_connections} open connections (server.max_connections); "
                          "retry later", code="too_many_connections")

    async def refuse(scope: dict, receive: Any, send: Any) -> None:
        await P.send_error(send, too_many, [(b"connection", b"close"), (b"retry-after", b"1")])

    class Guarded(H11Protocol):
        _header_timer: Any = None
        _timed_cycle: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                logger.warning("refused a connection: %d open, server.max_connections=%d", len(self.connections) - 1,
                               max_connections)
                self.app = refuse
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._timed_cycle = self.cycle
            self._header_timer = self.loop.call_later(read_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not self._timed_cycle:  # a new request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers have the same bound

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
                self.transport.close()  # nothing sent at all: an idle keep-alive, closed quietly
                return
            logger.warning("closed a connection from %s: its request headers took longer than server.read_timeout_s=%s",
                           self.client, read_timeout_s)
            err = P.APIError(408, f"the request headers did not arrive within server.read_timeout_s={read_timeout_s}",
                             code="request_timeout")
            data = json.dumps(err.body()).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            self.transport.close()

    return Guarded

