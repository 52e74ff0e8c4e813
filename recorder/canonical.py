"""Canonical JSON: the one byte form that fingerprints are computed over (and ``deja/1``
signatures; ``deja/2`` signs each line's exact bytes, see :mod:`recorder.cassette.signing`).

A value with no canonical form (NaN, a lone surrogate, a cycle, nesting deeper than the
encoder goes, a type JSON does not have) is refused here with
:class:`~recorder.errors.UnserializableValue`, so that whatever path it took to a cassette
line, it never surfaces as a bare ``ValueError`` or ``RecursionError``.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from recorder.errors import UnserializableValue


class NoCanonicalForm(UnserializableValue, ValueError):
    """A value with no canonical JSON form; also a ``ValueError``, which is what code that
    checks untrusted lines expects from a JSON encoder."""

# One encoder for every call: ``json.dumps`` with these options would build a new one each
# time, which is a large share of the cost for the small objects hashed per message.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                            allow_nan=False)


def canonical(obj: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8 (non-ASCII kept as is)."""
    try:
        return _ENCODER.encode(obj).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end] if isinstance(exc.object, str) else ""
        raise NoCanonicalForm(f"a string holds {bad!r}, a lone surrogate, which UTF-8 "
                                  "cannot encode; a cassette cannot store it") from None
    except RecursionError:
        raise NoCanonicalForm("a value is nested too deeply (or refers to itself) to be "
                                  "written to a cassette") from None
    except (ValueError, TypeError) as exc:
        raise NoCanonicalForm(f"a value cannot be written to a cassette: {exc}") from None


def digest(obj: Any) -> str:
    """A short stable hash of ``obj``'s canonical form."""
    return hashlib.sha256(canonical(obj)).hexdigest()[:32]


def encode_body(data: bytes) -> tuple[str, str | None]:
    """Store bytes exactly: as text when they are UTF-8, else as base64."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"


def decode_body(text: str, encoding: str | None) -> bytes:
    if encoding == "base64":
        return base64.b64decode(text)
    return text.encode("utf-8")


CODINGS = ("gzip", "x-gzip", "deflate", "br", "zstd")  # the content codings deja reads
MAX_DECODED = 64 * 1024 * 1024  # bytes a compressed body is read to, at most
ZSTD_WINDOW = 8 * 1024 * 1024  # the largest zstd window an HTTP body may ask for (RFC 9659)


class CodingError(ValueError):
    """A body that does not decompress as its ``content-encoding`` says, or that inflates
    past the bytes it may be read to (:class:`Inflated`)."""


class Inflated(CodingError):
    """A compressed body that inflates past :data:`MAX_DECODED` bytes (a decompression
    bomb, or a body too large to read): it is not read."""


def content_coding(headers: Iterable[Sequence[str]]) -> str:
    """A response's ``content-encoding``, lower case ("" when it has none)."""
    coding = next((v for k, v in headers if k.lower() == "content-encoding"), "")
    return coding.strip().lower()


def decompress(body: bytes, coding: str, limit: int = MAX_DECODED) -> bytes:
    """``body`` decompressed as ``coding`` (one of :data:`CODINGS`; deflate also raw, as
    some servers send it; zstd every frame), never past ``limit`` bytes:
    :class:`Inflated` when it would go further, :class:`CodingError` when it does not
    decompress. A body is untrusted input (a cassette's too): what it inflates to is
    produced no further than the limit."""
    if coding == "br":
        out = _unbrotli(body, limit)
    elif coding == "zstd":
        out = _unzstd(body, limit)
    else:
        out = _inflate(body, coding, limit)
    if len(out) > limit:
        raise Inflated(f"the {coding} body inflates past {limit} bytes; it is not read")
    return out


def _inflate(body: bytes, coding: str, limit: int) -> bytes:
    wbits = [zlib.MAX_WBITS, -zlib.MAX_WBITS] if coding == "deflate" \
        else [16 + zlib.MAX_WBITS]
    error = "it ends before its data does"
    for bits in wbits:  # deflate: zlib data, else raw deflate
        decoder = zlib.decompressobj(bits)
        try:
            out = decoder.decompress(body, limit + 1)
        except zlib.error as exc:
            error = str(exc)
            continue
        if decoder.eof or len(out) > limit:
            return out
    raise CodingError(f"not {coding} data: {error}")


def _unbrotli(body: bytes, limit: int) -> bytes:
    import brotli

    try:
        decoder = brotli.Decompressor()
        out = bytes(decoder.process(body, output_buffer_limit=limit + 1))
        if len(out) <= limit and not decoder.can_accept_more_data():
            out += b"\0"  # output still pending: past the limit
        return out
    except brotli.error as exc:
        raise CodingError(f"not br data: {exc}") from None


def _unzstd(body: bytes, limit: int) -> bytes:
    import io

    import zstandard

    try:
        reader = zstandard.ZstdDecompressor(max_window_size=ZSTD_WINDOW).stream_reader(
            io.BytesIO(body), read_across_frames=True)
        return bytes(reader.read(limit + 1))
    except zstandard.ZstdError as exc:
        raise CodingError(f"not zstd data: {exc}") from None


def compress(body: bytes, coding: str) -> bytes:
    """``body`` compressed as ``coding`` (one of :data:`CODINGS`), the same every time."""
    if coding == "br":
        import brotli

        return bytes(brotli.compress(body))
    if coding == "zstd":
        import zstandard

        return zstandard.ZstdCompressor().compress(body)
    if coding == "deflate":
        return zlib.compress(body)
    import gzip

    return gzip.compress(body, mtime=0)


def content_decoded(body: bytes, headers: Iterable[Sequence[str]]) -> bytes:
    """A response body as its ``content-encoding`` header says to read it: gzip, deflate,
    br or zstd decompressed (what the SDK reads, and what usage and stop reason are read
    from; the body is stored as received); any other body, or one that does not
    decompress, as it is."""
    coding = content_coding(headers)
    if not body or coding not in CODINGS:
        return body
    try:
        return decompress(body, coding)
    except CodingError:
        return body


def content_encoded(body: bytes, headers: Iterable[Sequence[str]], *,
                    decoded: bool = False) -> bytes:
    """A body a client may have handed over decoded, as the wire had it: compressed again
    as its ``content-encoding`` header says (one of :data:`CODINGS`) when it is known to be
    ``decoded`` (a client that decodes handed it over: a decoded body may itself be
    gzip, a ``.gz`` file sent compressed) or does not decompress as that header says;
    any other body as it is. The bytes are not the server's, but they decompress to what
    it sent."""
    coding = content_coding(headers)
    if not body or coding not in CODINGS:
        return body
    if decoded:
        return compress(body, coding)
    try:
        decompress(body, coding)
    except CodingError:
        return compress(body, coding)
    return body


def http_target(url: str) -> str:
    """Scheme, host, path and sorted query of ``url``: what identifies an HTTP call."""
    p = urlsplit(url)
    query = urlencode(sorted(parse_qsl(p.query, keep_blank_values=True)))
    return f"{p.scheme}://{p.netloc}{p.path}" + (f"?{query}" if query else "")


def fingerprint(kind: str, method: str, url: str, body: Any) -> str:
    """What a replayed call is matched by: the semantic request, never volatile headers.

    A model call is identified by its endpoint path and JSON body (its settings and its
    conversation), not the host, so a replay may point the agent at another base URL (see
    :func:`model_fingerprint`, which a provider uses for its calls, naming the field that
    holds the conversation).
    """
    if kind == "model":
        return model_fingerprint(method, url, body)
    return digest(["http", method.upper(), http_target(url), _boundary_fixed(body)])


# A multipart body's first line: its boundary (RFC 2046: up to 70 of these characters)
_BOUNDARY = re.compile(rb"--([0-9A-Za-z'()+_,./:=?-]{1,70})\r\n")
_FIXED_BOUNDARY = b"deja-boundary"


def _boundary_fixed(body: Any) -> Any:
    """An HTTP body as it is matched: a multipart one with its boundary, which a client
    draws at random for every request (requests, httpx, aiohttp all do), put to one fixed
    string, so that an upload replays; any other as it is."""
    if not isinstance(body, dict) or not isinstance(body.get("text"), str) \
            or not body["text"].startswith("--" if body.get("body_encoding") != "base64"
                                           else "LS"):  # "--", in base64
        return body
    try:
        raw = decode_body(body["text"], body.get("body_encoding"))
    except ValueError:
        return body
    found = _BOUNDARY.match(raw)
    if found is None or not raw.rstrip(b"\r\n").endswith(b"--" + found.group(1) + b"--"):
        return body
    fixed = raw.replace(b"--" + found.group(1), b"--" + _FIXED_BOUNDARY)
    return {"multipart": hashlib.sha256(fixed).hexdigest()}


class Parts:
    """The digests of model requests' parts, kept so that a request that repeats the parts
    of one before it (a conversation resends all of its history) hashes only what it adds.

    A part is remembered by its object (a cassette's requests share their history with the
    request they extend, object for object) or by its exact JSON text as received (equal
    text is an equal value, types included; equality of parsed values would take ``1``,
    ``1.0`` and ``True`` for one another). A conversation's list is hashed as a chain, a
    digest after each item that covers every item up to it, so that a list that extends a
    known one costs only the items it adds. Bounded: it starts over past :attr:`LIMIT`
    parts.
    """

    LIMIT = 16384
    RECENT = 8  # lists of texts compared with a new one (conversations may interleave)

    def __init__(self) -> None:
        self._by_object: dict[int, tuple[Any, str]] = {}
        self._by_text: dict[str, str] = {}
        self._lists: dict[int, tuple[list[Any], list[str]]] = {}  # a list's chain, by its id
        self._texts: collections.deque[tuple[list[str], list[str]]] = collections.deque(
            maxlen=self.RECENT)  # the chains of recent lists of texts

    def history(self, items: list[Any], texts: list[str] | None = None) -> str:
        """The digest of a conversation's list ``items`` (``texts``: the exact JSON text of
        each item as received, or None): the last link of its chain."""
        chain = self._by_texts(items, texts) if texts is not None else self._chain(items)
        return chain[-1] if chain else ""

    def extend(self, items: list[Any], base: list[Any], keep: int) -> None:
        """``items`` starts with the first ``keep`` items of ``base`` (the same objects,
        as a cassette's requests share their history): hash only the rest."""
        known = self._chain(base)[:keep]
        self._remember(items, self._continued(known, items[len(known):]))

    def _chain(self, items: list[Any]) -> list[str]:
        """The chain of ``items``, remembered by the list's identity."""
        hit = self._lists.get(id(items))
        if hit is not None and hit[0] is items:
            return hit[1]
        chain = self._continued([], items)
        self._remember(items, chain)
        return chain

    def _by_texts(self, items: list[Any], texts: list[str]) -> list[str]:
        """The chain of ``items`` read from ``texts``, continued from the recent list of
        texts that ``texts`` shares most first items with (compared in C, and cheaply: the
        texts a reader takes over from an earlier body are the same string objects)."""
        known: list[str] = []
        for seen, chain in reversed(self._texts):
            if seen is texts:
                return chain
            n = _shared(seen, texts)
            if n > len(known):
                known = chain[:n]
            if n == len(seen):  # the conversation grew from it
                break
        n = len(known)
        chain = known if n == len(texts) else self._continued(known, items[n:], texts[n:])
        self._texts.append((texts, chain))
        return chain

    def _continued(self, known: list[str], items: list[Any],
                   texts: list[str] | None = None) -> list[str]:
        """A new chain: ``known`` continued over ``items`` (read from ``texts``)."""
        chain = list(known)
        last = chain[-1] if chain else ""
        for i, item in enumerate(items):
            last = _link(last, self.of(item, texts[i] if texts is not None else None))
            chain.append(last)
        return chain

    def _remember(self, items: list[Any], chain: list[str]) -> None:
        if len(self._lists) >= self.LIMIT:
            self._lists.clear()
        self._lists[id(items)] = (items, chain)

    def of(self, value: Any, text: str | None = None) -> str:
        if text is not None:
            known = self._by_text.get(text)
            if known is None:
                if len(self._by_text) >= self.LIMIT:
                    self._by_text.clear()
                known = self._by_text[text] = digest(value)
            return known
        hit = self._by_object.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
        if len(self._by_object) >= self.LIMIT:
            self._by_object.clear()
        out = digest(value)
        self._by_object[id(value)] = (value, out)
        return out


def _shared(a: list[str], b: list[str]) -> int:
    """How many first items ``a`` and ``b`` have in common: all of the shorter, as a
    growing conversation has, in one comparison; else found by halving."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo], and they differ before hi
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _link(previous: str, item: str) -> str:
    """The link of a chain after an item of digest ``item``: both digests are fixed-width
    hex, so joining them is unambiguous."""
    return hashlib.sha256(f"{previous},{item}".encode("ascii")).hexdigest()[:32]


# The raw JSON text of a request's top-level fields but its history, and of each item of
# its history (see :class:`recorder.capture.exchange.RequestReader`).
Texts = tuple[dict[str, str], list[str]]


def model_fingerprint(method: str, url: str, body: Any, parts: Parts | None = None,
                      texts: Texts | None = None, history: str | None = None) -> str:
    """A model call's fingerprint: its endpoint path and its semantic request.

    ``history`` names the field of ``body`` that holds its conversation as a list (the
    provider's to say: :meth:`recorder.providers.Format.history_field`). A request with
    one is hashed as the digests of its parts (each other top-level field, and the list
    as a chain over its items), so that ``parts`` can remember the history a conversation
    repeats; ``texts`` are the parts as received (see :class:`Parts`). Two such requests
    have the same fingerprint exactly when they have the same history field and every
    part has the same canonical JSON. Anything else is hashed whole.
    """
    path = urlsplit(url).path.rstrip("/")
    items = body.get(history) if history is not None and isinstance(body, dict) else None
    if not isinstance(items, list):
        return digest(["model", method.upper(), path, body])
    parts = parts if parts is not None else Parts()
    fields, listed = texts if texts is not None else ({}, None)
    head = {k: parts.of(v, fields.get(k)) for k, v in body.items() if k != history}
    last = parts.history(items, listed if listed is not None and len(listed) == len(items)
                         else None)
    # The chain's last link is fixed-width hex; the canonical JSON before it ends where it
    # ends.
    joined = canonical(["model/history", method.upper(), path, history, head]) + b"|" + \
        last.encode("ascii")
    return hashlib.sha256(joined).hexdigest()[:32]
