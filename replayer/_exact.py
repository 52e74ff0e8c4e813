"""The exact-bytes shortcut of a replay: a model request whose bytes are exactly those of a
recorded request is that request, and its fingerprint is the recorded one.

A model line keeps the digest of its request's bytes as sent (``sent``, none when
redaction changed them): a request whose digest is that line's is that request, and the
line is found without restoring it. The rest of this describes lines without one (a
cassette written before lines had it, a request redaction changed).

Matching a request normally reads it: redaction, a JSON parse, then its fingerprint
(:func:`recorder.capture.exchange.classify_texts`). An agent replayed against its own
recording mostly sends the very bytes it sent then, and its SDK writes a request body as
compact JSON (``separators=(",", ":")``, ``ensure_ascii=False``): the recorded request,
written the same way, gives those bytes again. When they are equal, the request's
fingerprint is the recorded line's (same method, same endpoint path and provider, same
JSON text), so the line is looked up by that fingerprint in the index, which serves it
exactly as the full reading would have; anything else (one byte different, another key
order, a request that is no JSON) is read the usual way and judged as before.

A recorded request whose text holds the redaction mark (or merely the word ``redacted``)
is never used here: redaction may have changed what was sent, so the bytes an agent sends
are not the stored ones, and their fingerprint is the redacted form's, which only the full
reading works out. Nothing of a
request is kept beyond the call, and nothing is written.

The recorded requests are written lazily, a few unused lines ahead in recorded order (an
agent asks in that order, give or take its concurrent calls), and incrementally: a
conversation's requests share their history, item for item, so each item is written once.
"""

from __future__ import annotations

import json
import operator
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast
from urllib.parse import urlsplit

from recorder import providers
from recorder.capture.exchange import SentDigests
from recorder.cassette.lines import Head
from recorder.cassette.schema import Kind

# The JSON text the SDKs (and httpx) write a request body as.
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
# What every redaction leaves in a text: "[redacted]", or "%5Bredacted%5D" in a URL.
_MARK = b"redacted"


class _Texts:
    """The JSON text of values, remembered by the object (a cassette's requests share
    their history and settings with the request they extend, object for object). Two
    generations of at most :attr:`limit` each: what the recent requests share stays, the
    rest goes. The limit follows the longest list written (twice its items, at least
    :attr:`LIMIT`): enough for one conversation's history, and not a replay's every
    request, which a loaded cassette no longer holds restored."""

    LIMIT = 256
    LISTS = 8  # lists whose text is kept whole, the most recent

    def __init__(self) -> None:
        self._new: dict[int, tuple[Any, str]] = {}
        self._old: dict[int, tuple[Any, str]] = {}
        self.limit = self.LIMIT
        self._lists: deque[tuple[list[Any], str]] = deque(maxlen=self.LISTS)

    def of(self, value: Any) -> str:
        if not isinstance(value, (dict, list)):
            return _ENCODE(value)
        key = id(value)
        hit = self._new.get(key)
        if hit is None or hit[0] is not value:
            hit = self._old.get(key)
            if hit is None or hit[0] is not value:
                hit = (value, _ENCODE(value))
            if len(self._new) >= self.limit:
                self._old, self._new = self._new, {}
            self._new[key] = hit
        return hit[1]

    def body(self, body: dict[str, Any]) -> str:
        """``body`` as compact JSON, each list member written item by item."""
        parts = []
        for key, value in body.items():
            text = self.items(value) if isinstance(value, list) else self.of(value)
            parts.append(_ENCODE(key) + ":" + text)
        return "{" + ",".join(parts) + "}"

    def items(self, value: list[Any]) -> str:
        """The list ``value`` as compact JSON. A conversation's request holds the same
        item objects as the one it extends, in the same places: the text of the longest
        recent list that ``value`` starts with, object for object, is taken whole, and only
        the items after it are written."""
        self.limit = max(self.limit, 2 * len(value))
        start, text = 0, "["
        for known, known_text in tuple(self._lists):  # another thread may append
            n = len(known)
            if start < n <= len(value) and all(map(operator.is_, value, known)):
                start, text = n, known_text[:-1]
        of = self.of
        rest = ",".join([of(item) for item in value[start:]])
        text = text + ("," if start and rest else "") + rest + "]"
        self._lists.append((value, text))
        return text


class ExactBytes:
    """Finds the recorded model line a request's exact bytes name, among the next
    :attr:`AHEAD` unused ones in recorded order: ``heads`` says what each line is,
    ``lines`` restores one (only a candidate is read), ``used`` holds the seqs served so
    far, ``request_of`` gives a line's recorded request body."""

    AHEAD = 4
    SCAN = 64  # lines looked at for them, at most

    def __init__(self, heads: Sequence[Head], lines: Sequence[Mapping[str, Any]],
                 used: set[int], request_of: Callable[[int], Any],
                 redacted_url: Callable[[str], str]) -> None:
        self._heads, self._lines, self._used = heads, lines, used
        self._request_of, self._redacted_url = request_of, redacted_url
        self._next = 0  # the model lines before it are all used, or never served
        self._texts = _Texts()
        self._digest = SentDigests()  # a request's, hashed from where it repeats a recent one
        self._bytes: dict[int, bytes | None] = {}  # seq -> its request as sent (None: never)
        self._targets: dict[str, tuple[str, str | None] | None] = {}  # url -> (provider, path)
        self.hits = 0  # requests answered by their exact bytes

    def find(self, method: str, url: str, body: bytes) -> Head | None:
        """The head of the next unused recorded model request whose bytes are those of the
        request (``method``, ``url``, ``body``), None if there is none: a line that keeps
        the digest of its request as sent is compared by it, without restoring the line;
        any other by its request written again."""
        if method.upper() != "POST" or body[:1] != b"{":
            return None
        target = self._target(url)
        if target is None:
            return None
        digest = None
        for head in self._ahead():
            if head.sent is not None:
                if digest is None:
                    digest = self._digest(body)
                if head.sent != digest:
                    continue
                provider, recorded = self._where(head.seq)
            else:
                obs = self._lines[head.seq]
                provider, recorded = obs.get("provider"), obs.get("url")
                if self._sent(head.seq) != body:
                    continue
            if provider == target[0] and _path(recorded) == target[1]:
                self.hits += 1
                return head
        return None

    def _where(self, seq: int) -> tuple[str | None, Any]:
        """The provider and URL of model line ``seq``, restored."""
        target = getattr(self._lines, "target", None)
        if target is not None:
            return cast(tuple[str | None, Any], target(seq))
        obs = self._lines[seq]
        return obs.get("provider"), obs.get("url")

    def _ahead(self) -> list[Head]:
        """The next :attr:`AHEAD` model lines a call may take, in recorded order."""
        heads, used = self._heads, self._used
        out: list[Head] = []
        at = self._next
        end = min(len(heads), at + self.SCAN)
        while at < end and len(out) < self.AHEAD:
            head = heads[at]
            if head.kind == Kind.MODEL and not head.within and not head.observed \
                    and head.seq not in used:
                out.append(head)
            elif not out:  # nothing before it is left to serve
                self._bytes.pop(head.seq, None)
                self._next = at + 1
            at += 1
        return out

    def _target(self, url: str) -> tuple[str, str | None] | None:
        """The provider and endpoint path the fingerprint of a request to ``url`` names
        (the URL redacted as the full reading does); None: no model call."""
        if url not in self._targets:
            if len(self._targets) >= 64:
                self._targets.clear()
            seam = providers.for_url("POST", url)
            self._targets[url] = (None if seam is None
                                  else (seam.name, _path(self._redacted_url(url))))
        return self._targets[url]

    def _sent(self, seq: int) -> bytes | None:
        """The recorded request of line ``seq`` as its SDK sent it (None: one this
        shortcut never answers, as redaction may have changed it)."""
        if seq not in self._bytes:
            body = self._request_of(seq)
            sent = None
            if isinstance(body, dict):
                try:
                    sent = self._texts.body(body).encode("utf-8")
                except (ValueError, TypeError, RecursionError, UnicodeEncodeError):
                    sent = None
                if sent is not None and _MARK in sent:
                    sent = None
            self._bytes[seq] = sent
        return self._bytes[seq]


def _path(url: Any) -> str | None:
    """The part of a URL a model request's fingerprint reads."""
    return urlsplit(url).path.rstrip("/") if isinstance(url, str) else None
