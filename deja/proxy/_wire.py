"""What the proxy says on the wire besides what it forwards: error responses in the
provider's own shape, which headers pass a hop, where a path goes upstream, and whom it
answers (loopback by :func:`recorder.serving.is_loopback`, which ``deja serve`` shares).

An error the proxy answers itself is an Anthropic error object
(``{"type": "error", "error": {"type": ..., "message": ...}}``), so that every SDK raises
its usual error class with deja's message in it. Whether an SDK retries it is decided by
the status and the ``x-should-retry`` header, which the official Python and TypeScript SDKs
both read first: ``false`` is never retried, whatever the status; without it they retry
408, 409, 429 and 5xx. A stopped run and a divergence are answered with a 4xx and
``x-should-retry: false``: retrying cannot help, and a retry storm is what a guard exists
to prevent.

Where a path goes (:func:`upstream_path`): where the client sent it, except the Messages
API asked for without its version. An SDK whose base URL ends in ``/v1`` (the Vercel AI
SDK's ``@ai-sdk/anthropic``: ``https://api.anthropic.com/v1``, and it posts to
``BASE/messages``) and is given the proxy's bare URL posts to ``/messages``; that is
``/v1/messages`` upstream, recorded, replayed and forked as the official SDKs' call is.
An upstream whose URL ends in ``/v1`` gets either path with its own ``/v1`` only.

Whom it answers (:class:`Callers`): an SDK, ``curl`` or any program on the machine sends
a loopback ``Host`` and no ``Origin``. A web page the developer opens must not use the
proxy: neither by DNS rebinding (its own name made to resolve to 127.0.0.1: the request
then names that name in ``Host``, refused with 421) nor by a cross-origin request (its
``Origin`` is not loopback, or, for a request that carries none, ``Sec-Fetch-Site`` says
``cross-site``: refused with 403). Nothing the proxy answers itself carries a CORS header.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from recorder.capture.exchange import header_bytes
from recorder.serving import is_loopback

__all__ = ["HOP_BY_HOP", "Callers", "ProxyError", "error_body", "forwardable", "hop_by_hop",
           "served_headers", "upstream_path"]

# Headers that describe one hop, not the message (RFC 9110 7.6.1), and the ones the
# upstream client sets itself from the URL and the body it sends.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "transfer-encoding",
                        "upgrade", "host", "content-length"})

DEJA_PREFIX = "x-deja-"  # deja's own request headers: read by the proxy, never forwarded

API_VERSION = "/v1"  # the version the Messages API's paths start with
UNVERSIONED = "/messages"  # the Messages API (and what is under it) asked for without it


@dataclass
class ProxyError(Exception):
    """An error the proxy answers with itself (never forwarded, never a traceback)."""

    status: int
    type: str  # the provider's error type, e.g. invalid_request_error
    message: str
    retry: bool = False  # let the SDK retry (an unreachable upstream), else x-should-retry: false
    headers: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        return self.message


def error_body(kind: str, message: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}},
                      ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def hop_by_hop(headers: Sequence[tuple[str, str]]) -> frozenset[str]:
    """The names of ``headers`` that belong to one hop: the standard ones, and every name
    a ``Connection`` header lists (RFC 9110 7.6.1), lower-cased."""
    named = [v for k, v in headers if k.lower() == "connection"]
    if not named:
        return HOP_BY_HOP
    return HOP_BY_HOP | {n.strip().lower() for v in named for n in v.split(",") if n.strip()}


def forwardable(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """A client's request headers as they go upstream: without hop-by-hop headers (those
    its ``Connection`` header names included) and without deja's own ``x-deja-*`` headers
    (its token among them)."""
    drop = hop_by_hop(headers)
    return [(k, v) for k, v in headers
            if k.lower() not in drop and not k.lower().startswith(DEJA_PREFIX)]


def served_headers(headers: Sequence[tuple[str, str]], body_length: int | None
                   ) -> list[tuple[bytes, bytes]]:
    """Response headers as the proxy sends them on: hop-by-hop ones dropped (those the
    upstream's ``Connection`` header names included), and ``content-length`` set to
    ``body_length`` when the whole body is known (else the server frames the body itself,
    chunked)."""
    drop = hop_by_hop(headers)
    out = header_bytes([(k.lower(), v) for k, v in headers if k.lower() not in drop])
    if body_length is not None:
        out.append((b"content-length", str(body_length).encode("ascii")))
    return out


def upstream_path(upstream: str, path: str) -> str:
    """The path a request for ``path`` goes to on ``upstream`` (and is recorded with): the
    client's, except the Messages API's (``/messages``, ``/messages/count_tokens``), which
    has ``/v1`` before it exactly once, asked for with it or without: under ``upstream``'s
    own ``/v1`` when its URL ends in one, else as ``/v1/messages``."""
    versioned = path.startswith(API_VERSION + UNVERSIONED)
    bare = path[len(API_VERSION):] if versioned else path
    if bare != UNVERSIONED and not bare.startswith(UNVERSIONED + "/"):
        return path
    if urlsplit(upstream).path.rstrip("/").endswith(API_VERSION):
        return bare
    return API_VERSION + bare


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def host_name(value: str) -> str | None:
    """The name of a ``Host`` value (``127.0.0.1:8787``, ``[::1]:8787``, ``localhost``),
    lower-cased, without its port; None when it is not a host and optional port."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or _ip(name) is None:
            return None
    else:
        name, _, port = value.partition(":")
        rest = f":{port}" if port else ""
        if not name or any(not (c.isalnum() or c in "._-") for c in name) or not name.isascii():
            return None
    if rest and (not rest.startswith(":") or not rest[1:].isdigit()):
        return None
    return name.rstrip(".")


@dataclass(frozen=True)
class Callers:
    """The names the proxy answers to: loopback, the address it listens on, and
    ``--allowed-host`` names; listening on every address (``0.0.0.0``, ``::``), any IP
    address of the machine too (an address cannot be rebound)."""

    names: frozenset[str] = frozenset()
    any_address: bool = False
    # (Host, Origin, Sec-Fetch-Site) values let through before: every request of a client
    # sends the same ones, so they are checked once (a bounded memo, never a refusal)
    _passed: dict[tuple[str | None, str | None, str | None], None] = field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False)

    PASSED_KEPT = 64  # the memo's size

    @classmethod
    def of(cls, listen: str, allowed: Iterable[str] = ()) -> Callers:
        names = {n.strip().lower().strip("[]").rstrip(".") for n in allowed if n.strip()}
        wildcard = listen.strip("[]") in ("0.0.0.0", "::", "")
        if not wildcard:
            names.add(listen.lower().strip("[]"))
        return cls(frozenset(names), wildcard)

    def _ours(self, name: str) -> bool:
        return is_loopback(name) or name in self.names or (
            self.any_address and _ip(name) is not None)

    def shown(self) -> str:
        extra = sorted(self.names - {"localhost", "127.0.0.1", "::1"})
        return ", ".join(["localhost", "127.0.0.1", "[::1]", *extra,
                          *(["any IP address of this machine"] if self.any_address else [])])

    def refusal(self, headers: Mapping[str, str]) -> ProxyError | None:
        """Why a request with these (lower-cased) headers is refused; None: it is not."""
        seen = (headers.get("host"), headers.get("origin"), headers.get("sec-fetch-site"))
        if seen in self._passed:
            return None
        refused = self._refusal(headers)
        if refused is None and len(self._passed) < self.PASSED_KEPT:
            self._passed[seen] = None
        return refused

    def _refusal(self, headers: Mapping[str, str]) -> ProxyError | None:
        given = headers.get("host")
        name = host_name(given) if given is not None else None
        if given is not None and (name is None or not self._ours(name)):
            return ProxyError(421, "invalid_request_error",
                              f"deja proxy: the request names the host {given!r}; the proxy "
                              f"answers to {self.shown()} only (a web page whose name was "
                              "made to point here is refused). Use one of those, or start "
                              "it with --allowed-host NAME")
        origin = headers.get("origin")
        if origin is not None:
            try:
                parts = urlsplit(origin.strip())
                page = (parts.hostname or "").rstrip(".")
                foreign = not page or not (is_loopback(page) or page in self.names)
            except ValueError:
                foreign = True
            if foreign:
                return ProxyError(403, "permission_error",
                                  f"deja proxy: a request from the web page {origin!r} is "
                                  "refused: web pages cannot use the proxy (only programs "
                                  "on this machine, or pages served from loopback or an "
                                  "--allowed-host name)")
        elif headers.get("sec-fetch-site", "").strip().lower() == "cross-site":
            return ProxyError(403, "permission_error",
                              "deja proxy: a request a web page of another site made is "
                              "refused (Sec-Fetch-Site: cross-site): web pages cannot use "
                              "the proxy")
        return None
