"""Canonical JSON: the one byte form that fingerprints are computed over (and ``deja/1``
signatures; ``deja/2`` signs each line's exact bytes, see :mod:`recorder.cassette.signing`).

A value with no canonical form (NaN, a lone surrogate, a cycle, nesting deeper than the
encoder goes, a type JSON does not have) is refused here with
:class:`~recorder.errors.UnserializableValue`, so that whatever path it took to a cassette
line, it never surfaces as a bare ``ValueError`` or ``RecursionError``.
"""

from __future__ import annotations

import base64
import hashlib
import json
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


def content_decoded(body: bytes, headers: Iterable[Sequence[str]]) -> bytes:
    """A response body as its ``content-encoding`` header says to read it: gzip or deflate
    decompressed (what the SDK reads, and what usage and stop reason are read from; the
    body is stored as received); any other body, or one that does not decompress, as it
    is."""
    coding = next((v for k, v in headers if k.lower() == "content-encoding"), "")
    coding = coding.strip().lower()
    if not body or coding not in ("gzip", "x-gzip", "deflate"):
        return body
    try:
        if coding != "deflate":
            return zlib.decompress(body, 16 + zlib.MAX_WBITS)
        try:
            return zlib.decompress(body)
        except zlib.error:  # raw deflate, as some servers send it
            return zlib.decompress(body, -zlib.MAX_WBITS)
    except zlib.error:
        return body


def http_target(url: str) -> str:
    """Scheme, host, path and sorted query of ``url``: what identifies an HTTP call."""
    p = urlsplit(url)
    query = urlencode(sorted(parse_qsl(p.query, keep_blank_values=True)))
    return f"{p.scheme}://{p.netloc}{p.path}" + (f"?{query}" if query else "")


def fingerprint(kind: str, method: str, url: str, body: Any) -> str:
    """What a replayed call is matched by: the semantic request, never volatile headers.

    A model call is identified by its endpoint path and JSON body (model, system, messages,
    tools, parameters), not the host, so a replay may point the agent at another base URL
    (see :func:`model_fingerprint`, which a provider uses for its calls).
    """
    if kind == "model":
        return model_fingerprint(method, url, body)
    return digest(["http", method.upper(), http_target(url), body])


class Parts:
    """The digests of model requests' parts, kept so that a request that repeats the parts
    of one before it (a conversation resends all of its history) hashes only what it adds.

    A part is remembered by its object (a cassette's requests share their history with the
    request they extend, object for object) or by its exact JSON text as received (equal
    text is an equal value, types included; equality of parsed values would take ``1``,
    ``1.0`` and ``True`` for one another). Bounded: it starts over past :attr:`LIMIT`
    parts.
    """

    LIMIT = 16384

    def __init__(self) -> None:
        self._by_object: dict[int, tuple[Any, str]] = {}
        self._by_text: dict[str, str] = {}
        self._lists: dict[int, tuple[list[Any], list[str]]] = {}

    def messages(self, messages: list[Any]) -> list[str]:
        """The digests of a request's messages: those of the list it extends (see
        :meth:`extend`), and of each message it adds."""
        hit = self._lists.get(id(messages))
        if hit is not None and hit[0] is messages:
            return hit[1]
        out = [self.of(m) for m in messages]
        self._remember(messages, out)
        return out

    def extend(self, messages: list[Any], base: list[Any], keep: int) -> None:
        """``messages`` starts with the first ``keep`` messages of ``base`` (the same
        objects, as a cassette's requests share their history): hash only the rest."""
        known = self.messages(base)[:keep]
        self._remember(messages, known + [self.of(m) for m in messages[len(known):]])

    def _remember(self, messages: list[Any], digests: list[str]) -> None:
        if len(self._lists) >= self.LIMIT:
            self._lists.clear()
        self._lists[id(messages)] = (messages, digests)

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


# The raw JSON text of a request's top-level fields, and of each of its messages.
Texts = tuple[dict[str, str], list[str]]


def model_fingerprint(method: str, url: str, body: Any, parts: Parts | None = None,
                      texts: Texts | None = None) -> str:
    """A model call's fingerprint: its endpoint path and its semantic request.

    A request with a ``messages`` list is hashed as the digests of its parts (each
    top-level field, each message), so that ``parts`` can remember the history a
    conversation repeats; ``texts`` are the parts as received (see :class:`Parts`). Two
    requests have the same fingerprint exactly when every part has the same canonical
    JSON. Anything else is hashed whole.
    """
    path = urlsplit(url).path.rstrip("/")
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return digest(["model", method.upper(), path, body])
    of = parts.of if parts is not None else _part
    fields, bodies = texts if texts is not None else ({}, None)
    head = {k: of(v, fields.get(k)) for k, v in body.items() if k != "messages"}
    if bodies is not None and len(bodies) == len(messages):
        listed = [of(m, t) for m, t in zip(messages, bodies, strict=True)]
    elif parts is not None:
        listed = parts.messages(messages)
    else:
        listed = [of(m, None) for m in messages]
    # The messages' digests are fixed-width hex, so joining them is unambiguous (and much
    # cheaper than encoding the list); the canonical JSON before them ends where it ends.
    joined = canonical(["model/parts", method.upper(), path, head]) + b"|" + \
        ",".join(listed).encode("ascii")
    return hashlib.sha256(joined).hexdigest()[:32]


def _part(value: Any, text: str | None = None) -> str:
    return digest(value)
