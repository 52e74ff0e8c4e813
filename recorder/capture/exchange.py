"""One HTTP exchange as deja sees it, whichever client library made it.

The capture patchers turn httpx, httpx2, requests, aiohttp and urllib3 traffic into
:class:`HttpRequest` / :class:`HttpResponse`; sessions classify, fingerprint, redact and
store them. A request to a model endpoint becomes a ``model`` observation, anything else
``http``. What is redacted, and how, lives in :mod:`recorder.capture.redact`; recording and replay
both classify a request through :func:`classify`, so they fingerprint the same redacted
form.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from recorder import providers
from recorder.canonical import (
    canonical,
    decode_body,
    encode_body,
    fingerprint,
)
from recorder.capture.redact import Redaction
from recorder.errors import UnserializableValue
from recorder.providers import (
    model_provider,
    volatile_header,
)

__all__ = ["RETRYABLE_STATUSES", "HttpRequest", "HttpResponse", "classify", "json_body",
           "pretty", "request_fingerprint", "response_from_record", "response_record",
           "semantic_headers", "upstream"]

# Statuses after which the SDKs retry; on replay their wait is cut to nothing.
RETRYABLE_STATUSES = frozenset({408, 409, 429}) | frozenset(range(500, 600))


@dataclass
class HttpRequest:
    method: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes
    original_body: bytes | None = None  # set when a guard rewrote the body (clamping)
    # (kind, provider, body) once classified, so that recording does it once per exchange
    classified: tuple[str, str | None, Any] | None = field(default=None, repr=False)

    @property
    def parts(self):
        return urlsplit(self.url)

    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None


@dataclass
class HttpResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def upstream(url: str) -> str:
    """The host (and port) ``url`` goes to, without userinfo: what the breaker counts by."""
    return urlsplit(url).netloc.rpartition("@")[2]


def semantic_headers(headers: list[tuple[str, str]], redaction: Redaction,
                     provider: str | None = None) -> list[list[str]]:
    """Request headers worth keeping: secrets redacted, volatile ones (by the rules of the
    model call's ``provider``, else those of every request) dropped."""
    kept = [(k, v) for k, v in headers if not volatile_header(k, provider)]
    return redaction.header_pairs(kept)


def request_fingerprint(kind: str, provider: str | None, method: str, url: str,
                        body: Any) -> str:
    """What a request is matched by on replay, as :func:`classify` gave (kind, provider,
    body): a model call by its provider's semantic request, any other by its target."""
    if kind == "model" and provider is not None:
        return providers.get(provider).fingerprint(method, url, body)
    return fingerprint(kind, method, url, body)


_NOT_JSON = object()
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_body(data: bytes) -> tuple[Any, str | None]:
    """(parsed body, None), or (``_NOT_JSON``, what is wrong) when ``data`` is no JSON a
    cassette can hold as JSON: not UTF-8 JSON at all (None), or JSON with NaN or
    Infinity, nesting too deep to be written back, or a lone surrogate escape (a reason).
    """
    if not data:
        return _NOT_JSON, None
    try:
        body = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        return _NOT_JSON, "is nested too deeply to be written back"
    except ValueError as exc:  # UnicodeDecodeError included
        if str(exc).endswith("is not JSON"):
            return _NOT_JSON, "holds NaN or Infinity, which JSON has no place for"
        return _NOT_JSON, None
    if _SURROGATE_ESCAPE.search(data) is not None:  # is each one half of a pair?
        try:
            canonical(body)
        except UnserializableValue:
            return _NOT_JSON, "holds a lone surrogate escape (half of a UTF-16 pair)"
    return body, None


def classify(method: str, url: str, data: bytes,
             redaction: Redaction) -> tuple[str, str | None, Any]:
    """(kind, provider, body) of a request, as recording stores it and replay matches it:
    the body redacted, parsed when it is JSON (a model call needs a JSON body), else
    wrapped as its exact text.

    A model request whose JSON body a cassette cannot hold as JSON is refused with
    :class:`UnserializableValue`; other HTTP bodies are stored as their exact text.
    """
    provider = model_provider(method, url)
    clean = redaction.data(data, remember=True)
    body, problem = json_body(clean)
    if body is _NOT_JSON:
        if provider and problem is not None:
            raise UnserializableValue(
                f"model request {method.upper()} {redaction.url(url)}: its JSON body "
                f"{problem}; deja stores a model request as JSON and cannot record this one "
                "faithfully. Nothing of it was written; fix the value the agent sends")
        text, encoding = encode_body(clean)
        return "http", provider, {"text": text, "body_encoding": encoding or "text"}
    return ("model" if provider else "http"), provider, redaction.body(body)


def response_record(resp: HttpResponse, redaction: Redaction) -> dict[str, Any]:
    """A response as stored: secrets redacted from headers and body (``content-length``
    follows a body that redaction made shorter, so a replay serves a consistent length)."""
    body, headers = redaction.response_body(resp.body, resp.headers)
    text, encoding = encode_body(body)
    out: dict[str, Any] = {"status": resp.status, "reason": resp.reason,
                           "headers": redaction.header_pairs(headers), "body": text}
    if encoding:
        out["encoding"] = encoding
    return out


def response_from_record(rec: dict[str, Any]) -> HttpResponse:
    return HttpResponse(status=rec["status"], reason=rec.get("reason", ""),
                        headers=[(k, v) for k, v in rec["headers"]],
                        body=decode_body(rec["body"], rec.get("encoding")))


def pretty(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, default=repr)

