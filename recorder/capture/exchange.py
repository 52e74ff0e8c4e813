"""One HTTP exchange as deja sees it, whichever client library made it.

The capture patchers turn httpx, httpx2, requests, aiohttp and urllib3 traffic into
:class:`HttpRequest` / :class:`HttpResponse`; sessions classify, fingerprint, redact and
store them. A request to a model endpoint becomes a ``model`` observation, anything else
``http``. What is redacted, and how, lives in :mod:`recorder.capture.redact`; recording and replay
both classify a request through :func:`classify`, so they fingerprint the same redacted
form.
"""

from __future__ import annotations

import bisect
import collections
import functools
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from recorder import providers
from recorder.canonical import (
    Parts,
    Texts,
    canonical,
    decode_body,
    encode_body,
    fingerprint,
)
from recorder.capture.redact import Redaction
from recorder.cassette.schema import Kind
from recorder.errors import UnserializableValue
from recorder.providers import (
    model_provider,
    volatile_header,
)

__all__ = ["RETRYABLE_STATUSES", "HttpRequest", "HttpResponse", "RequestReader", "classify",
           "classify_texts", "json_body", "pretty", "request_fingerprint",
           "response_from_record", "response_record", "semantic_headers", "upstream"]

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
                        body: Any, parts: Parts | None = None,
                        texts: Texts | None = None) -> str:
    """What a request is matched by on replay, as :func:`classify` gave (kind, provider,
    body): a model call by its provider's semantic request, any other by its target.
    ``parts`` and ``texts`` make a model request's fingerprint incremental (see
    :func:`recorder.canonical.model_fingerprint`)."""
    if kind == Kind.MODEL and provider is not None:
        return providers.get(provider).fingerprint(method, url, body, parts, texts)
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


# The json module's own value scanner (in C): one value from a position, and where it ends.
_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder(
    parse_constant=_no_constant).scan_once  # type: ignore[attr-defined]
_WS = re.compile(r"[ \t\n\r]*")


def _skip(text: str, i: int) -> int:
    """The position after any whitespace at ``i``."""
    m = _WS.match(text, i)
    return m.end() if m is not None else i


class _Bad(Exception):
    """Not a plain JSON object: the caller parses it the usual way, and says why."""


@dataclass
class _Read:
    """A request body read member by member: the object, the exact text of each member's
    value, and where each element of its ``messages`` array ends in the text."""

    text: str
    obj: dict[str, Any]
    fields: dict[str, str]
    head: tuple[dict[str, Any], dict[str, str]] | None = None  # the members before messages
    items: list[Any] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    @functools.cached_property
    def prefix(self) -> str:
        """The text up to the end of the last message: what a later request of the same
        conversation starts with."""
        return self.text[:self.ends[-1]] if self.ends else "\0"


def _read_object(text: str, resume: _Read | None = None, upto: int = 0) -> _Read:
    """Read a JSON object with the json module's own scanner, one member (and one message)
    at a time. With ``resume``, a body read before whose text agrees with ``text`` for the
    first ``upto`` characters, the messages that end within them are taken as they were."""
    k = bisect.bisect_right(resume.ends, upto) if resume is not None else 0
    if resume is not None and resume.head is not None and k:
        head_obj, head_fields = resume.head
        read = _Read(text, dict(head_obj), dict(head_fields), resume.head,
                     resume.items[:k], resume.texts[:k], resume.ends[:k])
        i = _messages(text, read, resume.ends[k - 1], more=True)
    else:
        read = _Read(text, {}, {})
        i = _skip(text, 0)
        if not text.startswith("{", i):
            raise _Bad
        i = _skip(text, i + 1)
        if text.startswith("}", i):
            return _end(text, read, i + 1)
        i = _member(text, read, i)
    while True:
        i = _skip(text, i)
        if text.startswith(",", i):
            i = _member(text, read, _skip(text, i + 1))
            continue
        if not text.startswith("}", i):
            raise _Bad
        return _end(text, read, i + 1)


def _member(text: str, read: _Read, i: int) -> int:
    if not text.startswith('"', i):
        raise _Bad
    key, i = _SCAN(text, i)
    i = _skip(text, i)
    if not text.startswith(":", i):
        raise _Bad
    i = _skip(text, i + 1)
    if key == "messages":
        if read.head is not None or not text.startswith("[", i):
            raise _Bad  # twice, or not a list: read the usual way, without its parts
        read.fields.pop(key, None)
        read.head = (dict(read.obj), dict(read.fields))
        return _messages(text, read, i + 1, more=False)
    start = i
    read.obj[key], i = _SCAN(text, i)
    read.fields[key] = text[start:i]
    return i


def _messages(text: str, read: _Read, i: int, *, more: bool) -> int:
    """The elements of the messages array from ``i`` (after its ``[``, or, with ``more``,
    after an element) to its ``]``; returns where it ends."""
    read.obj["messages"] = read.items
    if not more:
        i = _skip(text, i)
        if text.startswith("]", i):
            return i + 1
    else:
        i = _skip(text, i)
        if text.startswith("]", i):
            return i + 1
        if not text.startswith(",", i):
            raise _Bad
        i = _skip(text, i + 1)
    while True:
        start = i
        value, i = _SCAN(text, i)
        read.items.append(value)
        read.texts.append(text[start:i])
        read.ends.append(i)
        i = _skip(text, i)
        if text.startswith(",", i):
            i = _skip(text, i + 1)
            continue
        if not text.startswith("]", i):
            raise _Bad
        return i + 1


def _end(text: str, read: _Read, i: int) -> _Read:
    if _skip(text, i) != len(text):
        raise _Bad
    return read


class RequestReader:
    """Reads the JSON bodies of model requests, each from where it stops repeating a recent
    one: a conversation resends its whole history every turn, and only the messages it
    adds are parsed (and, by :class:`recorder.canonical.Parts`, hashed). An earlier body's
    messages are taken only when the new text starts with that body's text up to the end
    of its last message, character for character, so the result is exactly what a full
    parse gives; anything else (an edited history) is parsed whole. Thread-safe."""

    MEMORY = 4  # recent bodies to compare a new one with (conversations may interleave)

    def __init__(self) -> None:
        self._recent: collections.deque[_Read] = collections.deque(maxlen=self.MEMORY)
        self._lock = threading.Lock()

    def read(self, data: bytes) -> tuple[Any, str | None, Texts | None]:
        """:func:`json_body` of ``data``, with the texts of its parts (None for a body
        that is not a plain JSON object, or holds a surrogate escape)."""
        try:
            text = data.decode("utf-8") if data[:1] == b"{" else None
        except UnicodeDecodeError:
            text = None
        if text is None or (b"\\u" in data and _SURROGATE_ESCAPE.search(data) is not None):
            body, problem = json_body(data)
            return body, problem, None
        with self._lock:
            recent = list(self._recent)
        best = next((r for r in reversed(recent) if text.startswith(r.prefix)), None)
        try:
            read = _read_object(text, best, len(best.prefix) if best is not None else 0)
        except (_Bad, StopIteration, ValueError, RecursionError):
            body, problem = json_body(data)
            return body, problem, None
        with self._lock:
            self._recent.append(read)
        return read.obj, None, (read.fields, read.texts if read.head is not None else [])


def classify(method: str, url: str, data: bytes,
             redaction: Redaction) -> tuple[str, str | None, Any]:
    """(kind, provider, body) of a request, as recording stores it and replay matches it:
    the body redacted, parsed when it is JSON (a model call needs a JSON body), else
    wrapped as its exact text.

    A model request whose JSON body a cassette cannot hold as JSON is refused with
    :class:`UnserializableValue`; other HTTP bodies are stored as their exact text.
    """
    return classify_texts(method, url, data, redaction)[:3]


def classify_texts(method: str, url: str, data: bytes, redaction: Redaction,
                   reader: RequestReader | None = None
                   ) -> tuple[str, str | None, Any, Texts | None]:
    """:func:`classify`, and the exact text of a model request's parts as the body holds
    them (None when there are none, or when configured redaction changed the parsed body
    since), for an incremental fingerprint; ``reader`` parses a model request from where
    it stops repeating a recent one."""
    provider = model_provider(method, url)
    clean = redaction.data(data, remember=True)
    if provider:
        body, problem, texts = (reader or RequestReader()).read(clean)
    else:
        body, problem = json_body(clean)
        texts = None
    if body is _NOT_JSON:
        if provider and problem is not None:
            raise UnserializableValue(
                f"model request {method.upper()} {redaction.url(url)}: its JSON body "
                f"{problem}; deja stores a model request as JSON and cannot record this one "
                "faithfully. Nothing of it was written; fix the value the agent sends")
        text, encoding = encode_body(clean)
        return Kind.HTTP.value, provider, {"text": text, "body_encoding": encoding or "text"}, None
    redacted = redaction.body(body)
    if redacted is not body:
        texts = None
    return (Kind.MODEL.value if provider else Kind.HTTP.value), provider, redacted, texts


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

