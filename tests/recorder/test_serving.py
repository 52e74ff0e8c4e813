"""What deja's two HTTP servers share (``recorder.serving``), on its own: the loopback check,
the listening socket, and a request body read within bounds from an ASGI channel. Each
server's answers (status codes, messages) are tested with the server: tests/proxy and
tests/runs/test_api*.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import pytest

from recorder.serving import (
    BodyRefused,
    BodyStalled,
    BodyTooLarge,
    ClientLeft,
    bind,
    is_loopback,
    read_body,
)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST", "localhost.", "app.localhost",
                                  "127.0.0.1", "127.9.9.9", "::1", "[::1]",
                                  "::ffff:127.0.0.1", " 127.0.0.1 "])
def test_loopback_names_and_addresses(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.1.1", "::2",
                                  "localhost.attacker.example", "127.0.0.1.nip.io", "",
                                  "evil-localhost", "[::2]"])
def test_other_hosts_are_not_loopback(host: str) -> None:
    assert not is_loopback(host)


def test_bind_gives_a_bound_socket_and_a_taken_port_is_an_oserror() -> None:
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.family == socket.AF_INET and sock.getsockname()[1] > 0
        sock.listen()
        with pytest.raises(OSError):
            bind("127.0.0.1", sock.getsockname()[1]).close()
    finally:
        sock.close()
    with pytest.raises(OSError):  # an address that is not this machine's
        bind("192.0.2.1", 0).close()


def channel(*messages: MutableMapping[str, Any], then_wait: bool = False
            ) -> Callable[[], Awaitable[MutableMapping[str, Any]]]:
    """An ASGI receive channel that gives ``messages`` and then waits for ever (a client
    that stopped sending) or, by default, says the client went away."""
    queue = list(messages)

    async def receive() -> MutableMapping[str, Any]:
        if queue:
            return queue.pop(0)
        if then_wait:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return receive


def body(data: bytes, more: bool = False) -> MutableMapping[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


def read(receive: Callable[[], Awaitable[MutableMapping[str, Any]]], headers: dict[str, str],
         **bounds: Any) -> bytes:
    return asyncio.run(read_body(receive, headers, **bounds))


def test_a_body_in_pieces_is_read_whole() -> None:
    pieces = channel(body(b'{"a":', True), body(b"", True), body(b" 1}"))
    assert read(pieces, {}, limit=8) == b'{"a": 1}'
    assert read(channel(body(b"")), {}, limit=0) == b""


def test_a_body_over_the_limit_is_refused_declared_or_as_it_comes() -> None:
    never_read = channel(then_wait=True)  # refused before anything is read
    with pytest.raises(BodyTooLarge):
        read(never_read, {"content-length": "9"}, limit=8, timeout=5)
    with pytest.raises(BodyTooLarge):  # a client that declares less than it sends
        read(channel(body(b"12345", True), body(b"6789")), {"content-length": "3"}, limit=8)


def test_a_stalled_body_and_a_client_that_left_are_named() -> None:
    with pytest.raises(BodyStalled, match=r"0\.05 s"):
        read(channel(body(b"part", True), then_wait=True), {}, limit=100, timeout=0.05)
    with pytest.raises(ClientLeft):
        read(channel(body(b"part", True)), {}, limit=100)
    assert issubclass(BodyStalled, BodyRefused) and issubclass(ClientLeft, BodyRefused)
