"""One HTTP exchange as deja sees it, whichever client library made it.

The capture patchers turn httpx, httpx2, requests, aiohttp and urllib3 traffic into
:class:`HttpRequest` / :class:`HttpResponse`; sessions classify, fingerprint, redact and
store them. A request to a model endpoint becomes a ``model`` observation, anything else
``http``. What is redacted, and how, lives in :mod:`recorder.capture.redact`; recording and replay
both classify a request through :func:`classify`, so they fingerprint the same redacted
form.
"""

from __future__ import annotations

import base64
import bisect
import collections
import functools
import hashlib
import json
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

from recorder import providers
from recorder._fastjson import BODY_DEPTH, LINE_DEPTH, nests_deeper, openers
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
from recorder.providers import volatile_header

__all__ = ["RETRYABLE_STATUSES", "History", "HttpRequest", "HttpResponse", "RequestReader",
           "SentDigests", "classify", "classify_texts", "json_body", "pretty",
           "request_fingerprint", "response_from_record", "response_record",
           "semantic_headers", "sent_digest", "upstream"]

# Statuses after which the SDKs retry; on replay their wait is cut to nothing.
RETRYABLE_STATUSES = frozenset({408, 409, 429}) | frozenset(range(500, 600))


@dataclass
class HttpRequest:
    method: str
    url: str
    headers: Sequence[tuple[str, str]]
    body: bytes
    original_body: bytes | None = None  # set when a guard rewrote the body (clamping)
    # (kind, provider, body) once classified, so that recording does it once per exchange
    classified: tuple[str, str | None, Any] | None = field(default=None, repr=False)
    # the digest of the body as sent (:func:`sent_digest`), for a model request that
    # redaction left as it was; set with ``classified``
    sent: str | None = field(default=None, repr=False)

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


def header_bytes(headers: Sequence[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """Response headers (as a recording keeps them: text) as the bytes to serve. A recording
    keeps what it read: the proxy reads every header as Latin-1, httpx as UTF-8 when all
    of them are UTF-8, else as Latin-1. Latin-1 bytes when every character is one (the
    bytes received, for a header read as Latin-1; read back by httpx as the same text
    either way), else UTF-8 (what httpx read them as; a lone surrogate, which no recording
    reads, as its three bytes, so that it is served, never an error)."""
    try:
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    except UnicodeEncodeError:
        return [(k.encode("utf-8", "surrogatepass"), v.encode("utf-8", "surrogatepass"))
                for k, v in headers]


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


def _finite(text: str) -> float:
    """A JSON number with a fraction or an exponent, refused when no float holds it (1e999
    would be read as an infinity, which JSON has no place for either)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is not JSON")
    return value


_DEEP = (f"is nested too deeply for a cassette line (more than {BODY_DEPTH} levels; a "
         f"cassette's reader takes lines {LINE_DEPTH} deep)")


def json_body(data: bytes) -> tuple[Any, str | None]:
    """(parsed body, None), or (``_NOT_JSON``, what is wrong) when ``data`` is no JSON a
    cassette can hold as JSON: not UTF-8 JSON at all (None), or JSON with NaN or
    Infinity, nesting too deep to be written back, or a lone surrogate escape (a reason).
    """
    if not data:
        return _NOT_JSON, None
    try:
        body = json.loads(data.decode("utf-8"), parse_constant=_no_constant,
                          parse_float=_finite)
    except RecursionError:
        return _NOT_JSON, "is nested too deeply to be written back"
    except ValueError as exc:  # UnicodeDecodeError included
        if str(exc).endswith("is not JSON"):
            return _NOT_JSON, "holds NaN or Infinity, which JSON has no place for"
        return _NOT_JSON, None
    if openers(data) > BODY_DEPTH and nests_deeper(body, BODY_DEPTH):
        return _NOT_JSON, _DEEP
    if _SURROGATE_ESCAPE.search(data) is not None:  # is each one half of a pair?
        try:
            canonical(body)
        except UnserializableValue:
            return _NOT_JSON, "holds a lone surrogate escape (half of a UTF-16 pair)"
    return body, None


# The json module's own value scanner (in C): one value from a position, and where it ends.
_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder(
    parse_constant=_no_constant, parse_float=_finite).scan_once  # type: ignore[attr-defined]
_WS = re.compile(r"[ \t\n\r]*")


def _skip(text: str, i: int) -> int:
    """The position after any whitespace at ``i``."""
    m = _WS.match(text, i)
    return m.end() if m is not None else i


class _Bad(Exception):
    """Not a plain JSON object: the caller parses it the usual way, and says why."""


# A provider's rule for the field of a parsed request body that holds its conversation as
# a list (:meth:`recorder.providers.Format.history_field`); None: the body has none.
History = Callable[[Any], str | None]


@dataclass
class _List:
    """A list read item by item: the items, the exact text of each, and where each ends in
    the body's text."""

    items: list[Any] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)


@dataclass
class _Read:
    """A request body read member by member: the object, the exact text of each member's
    value but its history's, and its history (the list member ``history``, read item by
    item)."""

    text: str
    obj: dict[str, Any]
    fields: dict[str, str]
    history: str | None = None  # the member that holds the conversation, once known
    head: tuple[dict[str, Any], dict[str, str]] | None = None  # the members before it
    items: _List = field(default_factory=_List)
    # While a body is read from its start, which of its members is the history is not
    # known yet: each list member is read item by item, with the members before it.
    lists: dict[str, tuple[_List, tuple[dict[str, Any], dict[str, str]]]] | None = None
    twice: set[str] = field(default_factory=set)  # members the body holds more than once
    resumed: int = 0  # the history's first items, taken from a body read (and checked) before

    @functools.cached_property
    def prefix(self) -> str:
        """The text up to the end of the history's last item: what a later request of the
        same conversation starts with."""
        return self.text[:self.items.ends[-1]] if self.items.ends else "\0"


def _read_object(text: str, resume: _Read | None = None, upto: int = 0) -> _Read:
    """Read a JSON object with the json module's own scanner, one member (and one item of
    a list) at a time. With ``resume``, a body read before whose text agrees with ``text``
    for the first ``upto`` characters, the items of its history that end within them are
    taken as they were."""
    known = resume.items if resume is not None else None
    k = bisect.bisect_right(known.ends, upto) if known is not None else 0
    if resume is not None and known is not None and resume.head is not None and k:
        head_obj, head_fields = resume.head
        items = _List(known.items[:k], known.texts[:k], known.ends[:k])
        read = _Read(text, dict(head_obj), dict(head_fields), resume.history, resume.head,
                     items)
        read.obj[cast(str, resume.history)] = items.items
        read.resumed = k
        i = _items(text, items, known.ends[k - 1], more=True)
    else:
        read = _Read(text, {}, {}, lists={})
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
    if key in read.obj:
        if key == read.history:
            raise _Bad  # the history twice: read the usual way, without its parts
        read.twice.add(key)
    start = i
    if read.lists is not None and text.startswith("[", i):
        listed = _List()
        read.lists[key] = (listed, (dict(read.obj), dict(read.fields)))
        read.obj[key] = listed.items
        i = _items(text, listed, i + 1, more=False)
    else:
        read.obj[key], i = _SCAN(text, i)
    read.fields[key] = text[start:i]
    return i


def _items(text: str, into: _List, i: int, *, more: bool) -> int:
    """The items of an array from ``i`` (after its ``[``, or, with ``more``, after an
    item) to its ``]``, each with its text; returns where the array ends."""
    i = _skip(text, i)
    if text.startswith("]", i):
        return i + 1
    if more:
        if not text.startswith(",", i):
            raise _Bad
        i = _skip(text, i + 1)
    while True:
        start = i
        value, i = _SCAN(text, i)
        into.items.append(value)
        into.texts.append(text[start:i])
        into.ends.append(i)
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


def _settle(read: _Read, history: History) -> None:
    """Name ``read``'s history as the provider's rule does (None: it has none, or one
    this read cannot tell apart), once the whole body is read."""
    lists, read.lists = read.lists, None
    found = history(read.obj)
    if lists is not None:  # read from the start: the history is one of its lists
        if found is None or found not in lists or found in read.twice:
            return
        read.history, (read.items, read.head) = found, lists[found]
        del read.fields[found]
    elif found != read.history:  # taken over from a body the rule read otherwise
        read.history = None


def _too_deep(read: _Read, best: _Read | None) -> bool:
    """Whether a body read member by member nests deeper than :data:`BODY_DEPTH` (a member's
    value one level down, a history's item two); a member or item taken over from ``best``,
    checked when it was read, is not looked at again."""
    known = best.fields if best is not None else {}
    for key, text in read.fields.items():
        if known.get(key) != text and openers(text) >= BODY_DEPTH \
                and nests_deeper(read.obj[key], BODY_DEPTH - 1):
            return True
    items = read.items
    for i in range(read.resumed, len(items.texts)):
        if openers(items.texts[i]) >= BODY_DEPTH - 1 \
                and nests_deeper(items.items[i], BODY_DEPTH - 2):
            return True
    return False


_SURROGATE_TEXT = re.compile(_SURROGATE_ESCAPE.pattern.decode("ascii"))


def _surrogate_escape(data: bytes, text: str, known: int) -> bool:
    """Does ``data`` (as ``text``) hold a surrogate escape, which only a full parse checks?
    Its first ``known`` characters are a body read before, which held none: only the rest
    is searched (from a little before, though a history's item never ends within one)."""
    if not known:
        return _SURROGATE_ESCAPE.search(data) is not None
    return _SURROGATE_TEXT.search(text, max(known - 5, 0)) is not None


class RequestReader:
    """Reads the JSON bodies of model requests, each from where it stops repeating a recent
    one: a conversation resends its whole history every turn, and only the items it adds
    are parsed (and, by :class:`recorder.canonical.Parts`, hashed). Which member holds the
    history is the provider's to say (``history``, a :data:`History` rule). An earlier
    body's items are taken only when the new text starts with that body's text up to the
    end of its history's last item, character for character, so the result is exactly
    what a full parse gives; anything else (an edited history) is parsed whole.
    Thread-safe."""

    MEMORY = 4  # recent bodies to compare a new one with (conversations may interleave)

    def __init__(self) -> None:
        self._recent: collections.deque[_Read] = collections.deque(maxlen=self.MEMORY)
        self._lock = threading.Lock()

    def read(self, data: bytes, history: History | None = None
             ) -> tuple[Any, str | None, Texts | None]:
        """:func:`json_body` of ``data``, with the texts of its parts (None for a body
        that is not a plain JSON object, holds a surrogate escape or has no history).
        ``history`` is the provider's rule for the member that holds the conversation;
        without it, the rule of the first registered provider that finds one
        (:func:`recorder.providers.history_field`)."""
        try:
            text = data.decode("utf-8") if data[:1] == b"{" else None
        except UnicodeDecodeError:
            text = None
        if text is None:
            body, problem = json_body(data)
            return body, problem, None
        with self._lock:
            recent = list(self._recent)
        best = next((r for r in reversed(recent) if text.startswith(r.prefix)), None)
        upto = len(best.prefix) if best is not None else 0
        try:
            if _surrogate_escape(data, text, upto):
                raise _Bad
            read = _read_object(text, best, upto)
        except (_Bad, StopIteration, ValueError, RecursionError):
            body, problem = json_body(data)
            return body, problem, None
        _settle(read, history or providers.history_field)
        if _too_deep(read, best):
            return _NOT_JSON, _DEEP, None
        if read.history is None:
            return read.obj, None, None
        with self._lock:
            self._recent.append(read)
        return read.obj, None, (read.fields, read.items.texts)


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
                   ) -> tuple[str, str | None, Any, Texts | None, bool]:
    """:func:`classify`, the exact text of a model request's parts as the body holds
    them (None when there are none, or when configured redaction changed the parsed body
    since), for an incremental fingerprint, and whether redaction left the body as sent;
    ``reader`` parses a model request from where it stops repeating a recent one."""
    seam = providers.for_url(method, url)
    provider = seam.name if seam is not None else None
    clean = redaction.data(data, remember=True)
    if seam is not None:
        body, problem, texts = (reader or RequestReader()).read(clean, seam.history_field)
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
        return (Kind.HTTP.value, provider, {"text": text, "body_encoding": encoding or "text"},
                None, clean == data)
    redacted = redaction.body(body)
    if redacted is not body:
        texts = None
    return ((Kind.MODEL.value if provider else Kind.HTTP.value), provider, redacted, texts,
            redacted is body and clean == data)


def sent_digest(data: bytes) -> str:
    """The digest a model line keeps of its request's bytes as the agent sent them: a
    replay knows a request sent again byte for byte by it (the first 128 bits of SHA-256,
    which processors compute in hardware, in unpadded base64url)."""
    return _encoded(hashlib.sha256(data))


def _encoded(hashed: Any) -> str:
    return base64.urlsafe_b64encode(hashed.digest()[:16]).rstrip(b"=").decode("ascii")


class SentDigests:
    """:func:`sent_digest` of the requests of one session, each hashed from where it stops
    repeating a recent one.

    A conversation resends its whole history every turn, so its requests grow, and hashing
    each whole would cost every call more than the one before. SHA-256 reads its input in
    order, so the state it has after the first bytes of a request is the state it has
    after the same bytes of any other: the state after each :attr:`BLOCK` bytes of the
    last few requests is kept, and a request is hashed on from the last block it shares
    with one of them (found by comparing the bytes in place, many times cheaper than
    hashing them). The digest is exactly :func:`sent_digest`'s. Thread-safe."""

    BLOCK = 4096
    MEMORY = 4  # recent requests compared with a new one (conversations may interleave)

    def __init__(self) -> None:
        self._recent: collections.deque[tuple[bytes, list[Any]]] = collections.deque(
            maxlen=self.MEMORY)
        self._lock = threading.Lock()

    def __call__(self, data: bytes) -> str:
        size = self.BLOCK
        blocks = len(data) // size
        if blocks < 2:
            return sent_digest(data)
        with self._lock:
            recent = list(self._recent)
        shared, states = 0, []
        for body, kept in reversed(recent):  # the latest first: it shares the most, mostly
            most = min(len(kept), blocks)
            if most > shared:
                n = _shared_blocks(data, memoryview(body), most, size)
                if n > shared:
                    shared, states = n, kept
        states = states[:shared]  # the state after each block, the first `shared` as kept
        hashed = states[-1].copy() if states else hashlib.sha256()
        view = memoryview(data)
        for n in range(shared, blocks):
            hashed.update(view[n * size:(n + 1) * size])
            states.append(hashed.copy())
        hashed.update(view[blocks * size:])
        with self._lock:
            self._recent.append((data, states))
        return _encoded(hashed)


def _shared_blocks(data: bytes, body: memoryview, most: int, size: int) -> int:
    """How many first blocks of ``size`` bytes ``data`` and ``body`` have in common, at
    most ``most``: compared in place (``startswith`` a view copies nothing). A request
    repeats the one before it up to the end of that one's history, which ends in its last
    whole block or the one before: those are tried first, then the count is halved."""
    for n in (most, most - 1):
        if n <= 0 or data.startswith(body[:n * size]):
            return max(n, 0)
    lo, hi = 0, most - 2  # data and body share lo blocks; not more than hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if data.startswith(body[:mid * size]):
            lo = mid
        else:
            hi = mid - 1
    return lo


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

