"""One HTTP exchange as deja sees it, whichever client library made it.

The capture patchers turn httpx, httpx2, requests, aiohttp and urllib3 traffic into
:class:`HttpRequest` / :class:`HttpResponse`; sessions classify, fingerprint, redact and
store them. A request to a model endpoint becomes a ``model`` observation, anything else
``http``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from ._canonical import decode_body, digest, encode_body

REDACTED = "[redacted]"
SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "cookie", "set-cookie", "api-key",
     "x-goog-api-key"})
# Headers that change between two runs of the same code and say nothing about the call.
VOLATILE_HEADER_PREFIXES = ("x-stainless-",)
VOLATILE_HEADERS = frozenset({"user-agent", "content-length", "host", "accept-encoding",
                              "connection", "idempotency-key"})

# (path suffix, provider) of the endpoints whose exchanges are model turns.
MODEL_ENDPOINTS = (
    ("/v1/messages", "anthropic"),
    ("/v1/chat/completions", "openai"),
    ("/v1/responses", "openai"),
)
# Statuses after which the SDKs retry; on replay their wait is cut to nothing.
RETRYABLE_STATUSES = frozenset({408, 409, 429}) | frozenset(range(500, 600))


@dataclass
class HttpRequest:
    method: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes
    original_body: bytes | None = None  # set when a guard rewrote the body (clamping)

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


def model_provider(method: str, url: str) -> str | None:
    """The provider of a model endpoint, or None when ``url`` is not a model call."""
    if method.upper() != "POST":
        return None
    path = urlsplit(url).path.rstrip("/")
    for suffix, provider in MODEL_ENDPOINTS:
        if path.endswith(suffix):
            return provider
    return None


@dataclass(frozen=True)
class Redaction:
    """What never reaches disk: secret headers, extra headers and JSON body paths."""

    headers: frozenset[str] = SECRET_HEADERS
    body_paths: tuple[str, ...] = ()  # JSON pointers, e.g. "/metadata/user_id"

    @classmethod
    def of(cls, headers: tuple[str, ...] | list[str] = (),
           body_paths: tuple[str, ...] | list[str] = ()) -> Redaction:
        return cls(SECRET_HEADERS | {h.lower() for h in headers}, tuple(body_paths))

    def to_header(self) -> dict[str, Any]:
        return {"headers": sorted(self.headers - SECRET_HEADERS),
                "body_paths": list(self.body_paths)}

    def header_pairs(self, headers: list[tuple[str, str]]) -> list[list[str]]:
        return [[k, REDACTED if k.lower() in self.headers else v] for k, v in headers]

    def body(self, body: Any) -> Any:
        if not self.body_paths or not isinstance(body, (dict, list)):
            return body
        body = json.loads(json.dumps(body))
        for pointer in self.body_paths:
            _redact_pointer(body, pointer)
        return body


def _redact_pointer(doc: Any, pointer: str) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.strip("/").split("/")]
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return
    last = parts[-1]
    if isinstance(node, dict) and last in node:
        node[last] = REDACTED
    elif isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = REDACTED


def semantic_headers(headers: list[tuple[str, str]], redaction: Redaction) -> list[list[str]]:
    """Request headers worth keeping: secrets redacted, volatile ones dropped."""
    kept = [(k, v) for k, v in headers if k.lower() not in VOLATILE_HEADERS
            and not k.lower().startswith(VOLATILE_HEADER_PREFIXES)]
    return redaction.header_pairs(kept)


def http_target(url: str) -> str:
    """Scheme, host, path and sorted query of ``url``: what identifies an HTTP call."""
    p = urlsplit(url)
    query = urlencode(sorted(parse_qsl(p.query, keep_blank_values=True)))
    return f"{p.scheme}://{p.netloc}{p.path}" + (f"?{query}" if query else "")


def fingerprint(kind: str, method: str, url: str, body: Any) -> str:
    """What a replayed call is matched by: the semantic request, never volatile headers.

    A model call is identified by its endpoint path and JSON body (model, system, messages,
    tools, parameters), not the host, so a replay may point the agent at another base URL.
    """
    if kind == "model":
        return digest(["model", method.upper(), urlsplit(url).path.rstrip("/"), body])
    return digest(["http", method.upper(), http_target(url), body])


def stored_body(data: bytes) -> tuple[Any, dict[str, Any]]:
    """A request body for the log: parsed JSON when it is JSON, else exact text/base64."""
    if data:
        try:
            return json.loads(data), {}
        except ValueError:
            pass
    text, encoding = encode_body(data)
    return text, ({"body_encoding": encoding} if encoding else {"body_encoding": "text"})


def body_for_fingerprint(data: bytes, redaction: Redaction) -> Any:
    body, extra = stored_body(data)
    if extra:
        return {"text": body, **extra}
    return redaction.body(body)


def classify(method: str, url: str, data: bytes,
             redaction: Redaction) -> tuple[str, str | None, Any]:
    """(kind, provider, body) of a request, as recording stores it and replay matches it:
    a model call needs a JSON body; the body is redacted (or wrapped, when not JSON)."""
    provider = model_provider(method, url)
    body = body_for_fingerprint(data, redaction)
    wrapped = isinstance(body, dict) and "body_encoding" in body
    return ("model" if provider and not wrapped else "http"), provider, body


def response_record(resp: HttpResponse, redaction: Redaction) -> dict[str, Any]:
    text, encoding = encode_body(resp.body)
    out: dict[str, Any] = {"status": resp.status, "reason": resp.reason,
                           "headers": redaction.header_pairs(resp.headers), "body": text}
    if encoding:
        out["encoding"] = encoding
    return out


def response_from_record(rec: dict[str, Any]) -> HttpResponse:
    return HttpResponse(status=rec["status"], reason=rec.get("reason", ""),
                        headers=[(k, v) for k, v in rec["headers"]],
                        body=decode_body(rec["body"], rec.get("encoding")))


def pretty(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, default=repr)

