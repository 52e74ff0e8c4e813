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

Then the token, as Jupyter does it: another user of the machine can reach 127.0.0.1 too.
``deja view`` prints its address with this install's token (:mod:`deja.runs.auth`, the token
of ``deja serve``, or ``--token``/``DEJA_TOKEN``) as ``?token=``. A request whose
``token`` matches (compared in constant time) is answered with a cookie, ``deja_view``,
holding not the token but an HMAC of it (``HttpOnly; SameSite=Strict; Path=/``), and a
redirect to the same address without the token, so it stays out of the history, the
page's query parameters and any ``Referer``. Every other request needs that cookie: the
page, Streamlit's scripts and styles, its media and upload routes and the websocket
(which carries every run's content and every Fork, Cancel and Answer); without it, HTTP
401 with a line saying to open the address ``deja view`` printed, and the websocket
handshake answered 401. Only Streamlit's health check (``/_stcore/health``, which says
``ok`` and nothing else) needs no cookie. A wrong ``?token=`` is refused the same way.

Every answer also says ``Content-Security-Policy: img-src 'self' data: blob:;
frame-ancestors 'none'``: the page loads images only from the viewer itself (so even a
run's text that slipped through as markup could not make the browser fetch a remote
address), and no other site can frame it to steer a click.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK = ("localhost", "127.0.0.1", "::1")
HOSTS_ENV = "DEJA_VIEW_ALLOWED_HOSTS"  # more names, comma-separated (deja view --allow-host)
POLICY = "img-src 'self' data: blob:; frame-ancestors 'none'"
COOKIE = "deja_view"
TOKEN_ENV = "DEJA_VIEW_TOKEN"  # the token, from deja view to the server it starts
OPEN_PATHS = frozenset({"/_stcore/health"})  # says "ok", nothing else: no cookie needed
UNAUTHORIZED = ("deja view needs its token: open the address deja view printed when it "
                "started (http://127.0.0.1:PORT/?token=...); it gives this browser a "
                "cookie that lets it in.")


def cookie_value(token: str) -> str:
    """What the cookie holds: an HMAC of the token, never the token itself (a cookie
    goes to every port of the host, and the token also lets one submit to deja serve)."""
    return hmac.new(token.encode(), b"deja view cookie", hashlib.sha256).hexdigest()


def cookies(header: str | None) -> dict[str, str]:
    """The name=value pairs of a ``Cookie`` header (the first of a name wins)."""
    found: dict[str, str] = {}
    for part in (header or "").split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name not in found:
            found[name] = value.strip().strip('"')
    return found


def signed_in(headers: dict[str, str], token: str) -> bool:
    """Whether the request carries the viewer's cookie for ``token``."""
    given = cookies(headers.get("cookie")).get(COOKIE, "")
    return hmac.compare_digest(given.encode(), cookie_value(token).encode())


def token_in(query: str) -> str | None:
    """The ``token`` of a query string, or None when it has none."""
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "token":
            return value
    return None


def without_token(path: str, query: str) -> str:
    """``path`` with ``query`` minus its ``token``: where the sign-in redirects."""
    rest = [(n, v) for n, v in parse_qsl(query, keep_blank_values=True) if n != "token"]
    return quote(path or "/", safe="/") + (f"?{urlencode(rest)}" if rest else "")


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


async def _plain(send: Send, status: int, text: str, protocol: str = "http",
                 headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A short plain-text answer; on a websocket, its handshake's answer."""
    body = (text + "\n").encode()
    prefix = "websocket.http" if protocol == "websocket" else "http"
    await send({"type": f"{prefix}.response.start", "status": status, "headers": [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        (b"content-security-policy", POLICY.encode()), *headers]})
    await send({"type": f"{prefix}.response.body", "body": body})


class HostGuard:
    """ASGI middleware: :func:`refusal` for every HTTP request and websocket handshake,
    then, when there is a ``token``, the cookie (or the sign-in with ``?token=``)."""

    def __init__(self, app: ASGIApp, hosts: Iterable[str] = (), token: str | None = None) -> None:
        self.app = app
        self.hosts = allowed_hosts(hosts)
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        protocol = scope.get("type")
        if protocol not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers") or []}
        refused = refusal(headers, self.hosts)
        if refused is not None:
            status, reason = refused
            if protocol == "websocket":  # closed before it is accepted: the handshake gets 403
                await send({"type": "websocket.close", "code": 1008, "reason": reason[:120]})
                return
            await _plain(send, status, reason)
            return
        if self.token is not None:
            query = (scope.get("query_string") or b"").decode("latin-1")
            given = token_in(query)
            if protocol == "http" and given is not None and scope.get("method") in ("GET", "HEAD") \
                    and hmac.compare_digest(given.encode(), self.token.encode()):
                cookie = f"{COOKIE}={cookie_value(self.token)}; HttpOnly; SameSite=Strict; Path=/"
                await _plain(send, 303, "signed in", headers=[
                    (b"location", without_token(scope.get("path", "/"), query).encode()),
                    (b"set-cookie", cookie.encode()), (b"referrer-policy", b"no-referrer")])
                return
            if (given is not None or not signed_in(headers, self.token)) \
                    and (scope.get("path") not in OPEN_PATHS or protocol != "http"):
                if protocol == "websocket" and "websocket.http.response" not in \
                        (scope.get("extensions") or {}):
                    await send({"type": "websocket.close", "code": 1008,
                                "reason": "deja view needs its token"})
                    return
                await _plain(send, 401, UNAUTHORIZED, protocol)
                return
        if protocol == "websocket":
            await self.app(scope, receive, send)
            return

        async def send_with_policy(message: Message) -> None:
            if message.get("type") == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"content-security-policy", POLICY.encode())]
            await send(message)

        await self.app(scope, receive, send_with_policy)
