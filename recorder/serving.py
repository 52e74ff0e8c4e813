"""What deja's HTTP servers (``deja proxy``, ``deja serve``) share: whether a host is this
machine's loopback, the listening socket, a request body read within bounds, and a guard
against clients that connect and never finish a request's headers.

Each server answers in its own shape (the proxy as the provider would, ``deja serve`` with
its named JSON errors), so what is shared here raises and the server says it:
:func:`read_body` raises :class:`BodyTooLarge`, :class:`BodyStalled` or
:class:`ClientLeft` (all :class:`BodyRefused`), and :func:`bind` an ``OSError``.

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
``timeout_keep_alive`` closes it. The body of a request is bounded by :func:`read_body`:
in size always, and in time when the server gives a ``timeout`` (the longest pause between
two of its pieces: a large upload on a slow link is legitimate, a body that stops coming
is not).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

__all__ = ["HEADER_TIMEOUT", "MAX_WAITING", "BodyRefused", "BodyStalled", "BodyTooLarge",
           "ClientLeft", "bind", "guarded_httptools", "is_loopback", "read_body",
           "run_until_stopped", "write_ready"]

HEADER_TIMEOUT = 10.0  # seconds a client gets to send a request's headers
MAX_WAITING = 512  # connections waiting for their headers at once

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]  # an ASGI receive channel


def is_loopback(host: str) -> bool:
    """Is ``host`` (a name or an address, without a port) this machine's loopback?"""
    name = host.strip().lower().strip("[]").rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: any free port), for the server to listen
    on; ``OSError`` when it cannot be (a port taken, an address not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named outright: asyncio sets TCP_NODELAY only on sockets created so, and
    # without it every response waits ~40 ms for the client's delayed ACK (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class BodyRefused(Exception):
    """A request body the server does not take whole; each server answers it its own way."""


class BodyTooLarge(BodyRefused):
    """Over the server's limit: as declared (``content-length``) or as it arrived."""


class BodyStalled(BodyRefused):
    """Nothing of the body came for longer than the server's ``timeout``."""


class ClientLeft(BodyRefused):
    """The client went away before its body was complete."""


async def read_body(receive: Receive, headers: Mapping[str, str], *, limit: int,
                    timeout: float | None = None) -> bytes:
    """A request's body, read whole from the ASGI ``receive`` channel: at most ``limit``
    bytes (a larger ``content-length`` among the lower-cased ``headers`` is refused before
    anything is read), each piece within ``timeout`` seconds of the one before (None: no
    bound in time)."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body declares {declared} bytes, over {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        try:  # a body that stops coming would hold its connection for ever
            message = await (receive() if timeout is None
                             else asyncio.wait_for(receive(), timeout))
        except TimeoutError:
            raise BodyStalled(f"nothing of the request body came for {timeout:g} s") from None
        if message["type"] == "http.disconnect":
            raise ClientLeft("the client went away while sending its request body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the request body is over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


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


def write_ready(path: Path, data: Mapping[str, Any]) -> None:
    """Say a server listens: ``data`` as JSON at ``path``, written whole (a reader polling
    for the file never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(data)))
    os.replace(tmp, path)


def run_until_stopped(server: Any, sock: socket.socket, *,
                      listening: Callable[[int], None],
                      after: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve ``sock`` with ``server`` (a ``uvicorn.Server``) on uvloop until SIGTERM or
    SIGINT. ``listening(port)`` is called once it accepts connections; ``after`` runs when
    it stops, even after a forced exit that skipped the lifespan. uvicorn re-raises the
    signal it stopped on once it has shut down: a stop asked for is a clean return here."""
    import uvloop

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.01)
        listening(sock.getsockname()[1])

    async def main() -> None:
        waiter = asyncio.create_task(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            waiter.cancel()
            if after is not None:
                await after()

    previous = {sig: signal.signal(sig, lambda *_: None)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvloop.run(main())  # the loop uvicorn's "uvloop" setting names
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
