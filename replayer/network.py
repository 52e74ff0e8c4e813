"""No network while a test replays a cassette (the pytest plugin's guard).

A replay answers every call it recorded from the cassette and opens no socket for it, so
a connection attempt during the test comes from something deja does not capture: a
database driver, a raw socket, an HTTP client deja does not record. The test would pass
on a laptop that can reach that host and fail (or hang) on CI, so the plugin blocks it.

:class:`SocketGuard` wraps ``socket.socket.connect`` and ``connect_ex`` for the length of
the test: every TCP connection (``socket.create_connection``, ``http.client``, urllib3,
httpx, asyncio and ssl all go through them) and every connected UDP socket, to an
IPv4 or IPv6 address outside the allowed hosts, raises :class:`NetworkBlocked`. Unix
domain sockets are not the network and pass. An allowed host is a name or an address; a
name counts with the addresses it resolves to when the guard starts (``localhost`` is
127.0.0.1 and ::1). Nothing is allowed unless listed, loopback included.

The guard also keeps every attempt it refused, so the plugin fails the test even when
the program caught the error and went on.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
from typing import Any

from recorder.errors import DejaError

__all__ = ["NetworkBlocked", "SocketGuard"]

_PATCHED = ("connect", "connect_ex")


class NetworkBlocked(DejaError, RuntimeError):
    """A test replaying a cassette tried to connect to a host it does not allow.

    A ``RuntimeError`` rather than an ``OSError``: a client that retries or wraps
    connection errors (``socket.create_connection`` tries the next address on an
    ``OSError``, ``urllib`` turns one into ``URLError``) lets this one through as it is.
    """

    def __init__(self, host: str, port: int | None, cassette: str) -> None:
        self.host, self.port = host, port
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        super().__init__(
            f"a connection to {where if port is not None else host} was blocked: the test "
            f"replays {cassette}, and a replay makes no network calls (deja serves every "
            "call it recorded), so this one comes from something deja does not capture (a "
            "database driver, a raw socket, an HTTP client deja does not record). If the "
            f"test needs that host, allow it: @pytest.mark.deja(..., allowed_hosts="
            f"[{host!r}]) or allowed_hosts in the deja_config fixture")


def _bare(host: str) -> str:
    """An address or name as compared: lower case, no brackets, no IPv6 zone."""
    return host.strip("[]").partition("%")[0].lower()


def allowed_addresses(hosts: Iterable[str]) -> frozenset[str]:
    """``hosts`` and the addresses each resolves to (a name that does not resolve counts
    by its name alone)."""
    found: set[str] = set()
    for host in hosts:
        found.add(_bare(host))
        try:
            infos = socket.getaddrinfo(host, None)
        except (OSError, UnicodeError):
            continue
        found.update(_bare(str(info[4][0])) for info in infos)
    return frozenset(found)


class SocketGuard:
    """Refuses connections to hosts outside ``allowed`` while started (see the module
    docstring); :attr:`blocked` holds each refusal."""

    def __init__(self, allowed: Iterable[str], cassette: str) -> None:
        self.allowed = allowed_addresses(allowed)
        self.cassette = cassette
        self.blocked: list[NetworkBlocked] = []
        self._real: dict[str, Callable[..., Any]] = {}

    def start(self) -> SocketGuard:
        for name in _PATCHED:
            real = getattr(socket.socket, name)
            self._real[name] = real
            setattr(socket.socket, name, self._wrap(real))
        return self

    def stop(self) -> list[NetworkBlocked]:
        """Put the real methods back; the refusals, in order."""
        for name, real in self._real.items():
            setattr(socket.socket, name, real)
        self._real.clear()
        return list(self.blocked)

    def _wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        guard = self

        def guarded(sock: socket.socket, address: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # pytest shows the caller's frames, not these
            guard.check(sock, address)
            return real(sock, address, *args, **kwargs)

        guarded.__name__ = real.__name__
        guarded.__doc__ = real.__doc__
        return guarded

    def check(self, sock: socket.socket, address: Any) -> None:
        """Raise :class:`NetworkBlocked` for a connection to a host not allowed."""
        __tracebackhide__ = True
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        if isinstance(address, tuple) and address:
            host, port = str(address[0]), address[1] if len(address) > 1 else None
        else:
            host, port = str(address), None
        if _bare(host) in self.allowed:
            return
        error = NetworkBlocked(host, port if isinstance(port, int) else None, self.cassette)
        self.blocked.append(error)
        raise error
