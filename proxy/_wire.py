"""What the proxy says on the wire besides what it forwards: error responses in the
provider's own shape, and which headers pass a hop.

An error the proxy answers itself is an Anthropic error object
(``{"type": "error", "error": {"type": ..., "message": ...}}``), so that every SDK raises
its usual error class with deja's message in it. Whether an SDK retries it is decided by
the status and the ``x-should-retry`` header, which the official Python and TypeScript SDKs
both read first: ``false`` is never retried, whatever the status; without it they retry
408, 409, 429 and 5xx. A stopped run and a divergence are answered with a 4xx and
``x-should-retry: false``: retrying cannot help, and a retry storm is what a guard exists
to prevent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["HOP_BY_HOP", "ProxyError", "error_body", "forwardable", "served_headers"]

# Headers that describe one hop, not the message (RFC 9110 7.6.1), and the ones the
# upstream client sets itself from the URL and the body it sends.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "transfer-encoding",
                        "upgrade", "host", "content-length"})

DEJA_PREFIX = "x-deja-"  # deja's own request headers: read by the proxy, never forwarded


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


def forwardable(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """A client's request headers as they go upstream: without hop-by-hop headers and
    without deja's own ``x-deja-*`` headers (its token among them)."""
    return [(k, v) for k, v in headers
            if k.lower() not in HOP_BY_HOP and not k.lower().startswith(DEJA_PREFIX)]


def served_headers(headers: Iterable[tuple[str, str]], body_length: int | None
                   ) -> list[tuple[bytes, bytes]]:
    """Response headers as the proxy sends them on: hop-by-hop ones dropped, and
    ``content-length`` set to ``body_length`` when the whole body is known (else the
    server frames the body itself, chunked)."""
    out = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers
           if k.lower() not in HOP_BY_HOP]
    if body_length is not None:
        out.append((b"content-length", str(body_length).encode("ascii")))
    return out
