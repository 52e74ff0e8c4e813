"""Only this machine's browser, on the viewer's own address, talks to the viewer.

The viewer listens on 127.0.0.1, but a web page the user has open elsewhere can still
reach it: a page of ``rebind.attacker.example`` whose name is made to resolve to
127.0.0.1 (DNS rebinding) is, to the browser, the same origin as the viewer, and could
open the viewer's websocket and press Fork, Cancel or Answer. What gives such a page
away is the name it uses, in the ``Host`` header, and the page it came from, in
``Origin``. :class:`HostGuard`, an ASGI middleware in front of the whole Streamlit
server (every HTTP route and the websocket), refuses:

- a request whose ``Host`` is not a loopback name (``localhost``, ``127.0.0.1``,
  ``[::1]``) or one the user allowed (``deja view --allow-host NAME``): HTTP 421, and
  the websocket handshake refused;
- a request with an ``Origin`` other than the viewer's own (``http://`` or, behind a
  TLS proxy, ``https://``, then its Host):
  HTTP 403, the websocket refused. Browsers send ``Origin`` on every websocket, every
  POST and every cross-origin fetch, so a page elsewhere cannot talk to the viewer;
- a cross-site request for a resource (``Sec-Fetch-Site: cross-site`` for anything but a
  page navigation: an ``<img>`` or ``<script>`` of another site pointing here): HTTP 403.
  A link from elsewhere to a run's page still opens it.

Every answer also says ``Content-Security-Policy: img-src 'self' data: blob:;
frame-ancestors 'none'``: the page loads images only from the viewer itself (so even a
run's text that slipped through as markup could not make the browser fetch a remote
address), and no other site can frame it to steer a click.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK = ("localhost", "127.0.0.1", "::1")
HOSTS_ENV = "DEJA_VIEW_ALLOWED_HOSTS"  # more names, comma-separated (deja view --allow-host)
POLICY = "img-src 'self' data: blob:; frame-ancestors 'none'"


def allowed_hosts(extra: Iterable[str] = ()) -> frozenset[str]:
    """The loopback names, ``extra`` and the names in ``$DEJA_VIEW_ALLOWED_HOSTS``."""
    named = [*extra, *os.environ.get(HOSTS_ENV, "").split(",")]
    return frozenset([*LOOPBACK, *(n.strip().lower().rstrip(".") for n in named if n.strip())])


def host_name(host: str | None) -> str | None:
    """The name in a ``Host`` header (``name``, ``name:port``, ``[v6]:port``), lowercase;
    None when there is none or it is not a plain host and port."""
    if not host:
        return None
    try:
        parts = urlsplit(f"//{host}")
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        return None
    if parts.hostname is None or parts.username is not None or parts.password is not None \
            or parts.path or parts.query or parts.fragment or "@" in host:
        return None
    return parts.hostname.lower().rstrip(".")


def refusal(headers: dict[str, str], hosts: frozenset[str]) -> tuple[int, str] | None:
    """Why a request with ``headers`` (lowercase names) is refused: its HTTP status and
    a sentence; None when it may pass."""
    host = headers.get("host")
    if host_name(host) not in hosts:
        return 421, (f"deja view answers only on this machine's own names "
                     f"({', '.join(sorted(hosts))}), not on Host {host!r}; to use another "
                     "name, start it with --allow-host NAME")
    origin = headers.get("origin")
    if origin is not None and origin.lower() not in (f"http://{host}".lower(),
                                                     f"https://{host}".lower()):
        return 403, (f"deja view answers only its own pages, not a page of origin {origin!r}")
    if headers.get("sec-fetch-site") == "cross-site" \
            and headers.get("sec-fetch-mode") not in (None, "navigate"):
        return 403, "deja view does not serve its content to other sites' pages"
    return None


class HostGuard:
    """ASGI middleware: :func:`refusal` for every HTTP request and websocket handshake."""

    def __init__(self, app: ASGIApp, hosts: Iterable[str] = ()) -> None:
        self.app = app
        self.hosts = allowed_hosts(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers") or []}
        refused = refusal(headers, self.hosts)
        if refused is not None:
            status, reason = refused
            if kind == "websocket":  # closed before it is accepted: the handshake gets 403
                await send({"type": "websocket.close", "code": 1008, "reason": reason[:120]})
                return
            body = (reason + "\n").encode()
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                (b"content-security-policy", POLICY.encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        if kind == "websocket":
            await self.app(scope, receive, send)
            return

        async def send_with_policy(message: Message) -> None:
            if message.get("type") == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"content-security-policy", POLICY.encode())]
            await send(message)

        await self.app(scope, receive, send_with_policy)
