"""What deja's HTTP servers (``deja proxy``, ``deja serve``) share: a guard against clients
that connect and never finish a request's headers.

uvicorn (0.55, httptools) starts no timer on a new connection: a client that sends a few
bytes of headers and then one more every few seconds (slowloris) holds its socket for as
long as it likes, and 500 such clients hold 500 sockets. :func:`guarded_httptools` is
uvicorn's httptools protocol with two bounds:

- a request's headers must be complete within ``header_timeout`` seconds of the
  connection (or, on a kept-alive connection, of the next request's first byte); a
  connection that is slower is closed;
- at most ``max_waiting`` connections wait for their headers at once: one more closes the
  one that has waited longest, so a burst of idle sockets cannot keep a real client out.

An idle kept-alive connection (no byte since its last response) is uvicorn's own business:
``timeout_keep_alive`` closes it. The body of a request is not timed here (a large upload
on a slow link is legitimate); each server bounds its size.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["HEADER_TIMEOUT", "MAX_WAITING", "guarded_httptools"]

HEADER_TIMEOUT = 10.0  # seconds a client gets to send a request's headers
MAX_WAITING = 512  # connections waiting for their headers at once


def guarded_httptools(header_timeout: float = HEADER_TIMEOUT,
                      max_waiting: int = MAX_WAITING) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a header timeout and a cap on the connections that
    wait for their headers (``uvicorn.Config(http=...)``). Each call makes a class with its
    own count: one per server."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    if header_timeout <= 0 or max_waiting < 1:
        raise ValueError("header_timeout must be above 0 and max_waiting at least 1")
    waiting: dict[Any, None] = {}  # insertion-ordered: the oldest first

    class GuardedHttpTools(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            # the first bytes after a response: the next request's headers are timed too
            if self._header_timer is None and (self.cycle is None
                                               or self.cycle.response_complete):
                self._await_headers()
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._headers_done()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_done()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            if self.transport.is_closing():
                return
            waiting[self] = None
            self._header_timer = self.loop.call_later(header_timeout, self._too_slow)
            while len(waiting) > max_waiting:
                oldest = next(iter(waiting))
                oldest._too_slow()

        def _headers_done(self) -> None:
            waiting.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._headers_done()
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedHttpTools
