"""A loaded cassette's lines: kept as the bytes read, restored when a line is asked for.

:func:`recorder.cassette.load` reads a file once: it checks every line's signature over
its bytes, parses each line once, and keeps of it only what a replay matches on, its
:class:`Head` (kind, fingerprint, name ...), with the URL and request headers of a model
line (strings and lists shared with the lines that repeat them). Everything else stays in
the file's bytes, which are kept whole: a line is parsed again and restored (its compact
fields: :mod:`recorder.cassette.compact`; its request: :mod:`recorder.cassette._delta`)
when something reads it, through :class:`Lines`, the cassette's ``observations``.

A line refers to earlier ones (the request it extends, the answer it resends, the response
headers it edits); :class:`Store` follows those references without recursion and keeps
the last few lines, requests, answers and headers it restored, so that reading the lines
in order (a replay, a report) restores each one once. Headers of a few lines in every
:data:`PIN_EVERY` model lines are kept for good, so that reading a line far from the last
one read follows at most that many references back.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast, overload

from recorder import (
    _fastjson,
    providers,  # a module reference: providers imports this package
)
from recorder.cassette import _delta, _fingerprints, _shape, compact
from recorder.cassette.schema import EndLine, Kind, Observation
from recorder.errors import CorruptCassette

PIN_EVERY = 64  # model lines between the headers kept for good (see the module)
_CACHED = 32  # requests, answers and headers kept after they were restored
_LINES_CACHED = 8  # whole lines kept after they were restored (a call reads its own again)
_KINDS = {kind.value: kind for kind in Kind}
_NONE = object()
_FAULTS = (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError)


class Head(NamedTuple):
    """What a replay matches a line on, kept for every line of a loaded cassette."""

    seq: int
    kind: str
    fp: str | None = None  # a model line's is worked out when first asked for
    name: str | None = None
    within: str | None = None  # the tool call it was made inside
    observed: bool = False  # seen at a boundary
    event: str | None = None  # a control line's
    intent: int | None = None  # an outcome's
    site: Any = None  # an effect's call site
    sent: str | None = None  # a model line's digest of its request's bytes as sent


def head_of(line: Mapping[str, Any], fp: str | None = None) -> Head:
    """The head of ``line`` (a model line's fingerprint: ``fp``, else its own)."""
    kind, get = line["kind"], line.get
    name, event = get("name"), get("event")
    # tuple.__new__: what Head(...) does, without its argument handling (load makes one
    # a line)
    return tuple.__new__(Head, (
        line["seq"], _KINDS.get(kind, kind), fp if fp is not None else get("fp"),
        sys.intern(name) if isinstance(name, str) else name, get("within"), "observed" in line,
        sys.intern(event) if isinstance(event, str) else event, get("intent"), get("site"),
        get("sent")))


class _Recent(dict[int, Any]):
    """The last :data:`_CACHED` values put in, and a few kept for good (``pinned``)."""

    def __init__(self, pinned: set[int] | None = None, size: int = _CACHED) -> None:
        super().__init__()
        self._pinned = pinned if pinned is not None else set()
        self._size = size
        self._kept: dict[int, Any] = {}

    def find(self, seq: int) -> Any:
        return self._kept[seq] if seq in self._kept else self.get(seq)

    def keep(self, seq: int, value: Any) -> Any:
        if seq in self._pinned:
            self._kept[seq] = value
            return value
        self[seq] = value
        while len(self) > self._size:
            # calls replayed from several threads restore lines at once: the oldest may
            # be dropped by another meanwhile, or the dict grow under the iterator
            try:
                del self[next(iter(self))]
            except (KeyError, RuntimeError, StopIteration):
                continue
        return value


class Store:
    """A cassette's bytes and what :func:`load` kept of each line; restores a line (its
    request, its answer, its headers) when asked. ``starts``/``ends``: where each line of
    the file (the header is line 0) starts and ends in ``data``."""

    def __init__(self, path: Path, data: bytes, starts: array[int], ends: array[int]) -> None:
        self.path, self.data, self.starts, self.ends = path, data, starts, ends
        self.heads: list[Head] = []
        self.urls: list[str | None] = []  # a model line's URL, restored
        self.request_headers: list[Any] = []  # and its request headers
        self.providers: list[str | None] = []  # and the name of its provider
        self.shapes: dict[int, _shape.Shape] = {}  # seq -> the reply shape it holds inline
        self.models = 0  # model lines read
        self._lines = _Recent(size=_LINES_CACHED)
        self._requests = _Recent()
        self._replies = _Recent()
        self._docs = _Recent(size=_LINES_CACHED)  # seq -> a restored line's answer, parsed
        self._pinned: set[int] = set()  # model lines whose headers are kept for good
        self._headers = _Recent(self._pinned)
        # the model fingerprints, worked out in file order (:mod:`._fingerprints`): lines
        # before `matched` have theirs in their heads
        self.matched = 0
        self._pass: _fingerprints.Pass | None = None
        self._passing = threading.RLock()

    def add(self, head: Head, url: str | None = None, request_headers: Any = None,
            provider: str | None = None) -> None:
        """The next line's head (a model line's with its URL, request headers and
        provider)."""
        if head.kind == Kind.MODEL:
            if self.models % PIN_EVERY < compact.HEADER_BASES:
                self._pinned.add(head.seq)
            self.models += 1
        self.heads.append(head)
        self.urls.append(url)
        self.request_headers.append(request_headers)
        self.providers.append(provider)

    def through(self, seq: int, stored: Any = None, *, more: bool = False) -> None:
        """Every model line up to line ``seq`` has its fingerprint in its head, and its
        request can be rebuilt: the lines not passed yet up to it are passed, in file
        order (:class:`._fingerprints.Pass`; ``stored``: line ``seq``'s request as
        stored, the line parsed already; ``more``: lines are being added, and the pass is
        kept for them, with what it remembers, past the last line). A line that cannot be
        rebuilt is a :class:`CorruptCassette`, for this call and every later one that
        needs it."""
        if not isinstance(seq, int):
            return  # (a reference of another type is refused where it is followed)
        last = min(seq, len(self.heads) - 1)
        if last < self.matched:
            return
        with self._passing:
            if self._pass is None:  # from where the last one stopped (lines were added)
                self._pass = _fingerprints.Pass(self, self.matched)
            try:
                with _fingerprints.no_cycle_collection():
                    self._pass.through(last, stored if last == seq else None)
            except _FAULTS as exc:
                raise self.broken(self._pass.at, exc) from None
            if self.matched == len(self.heads) and not more:
                self._pass = None  # all passed: what it kept is let go

    def rebuilt(self, seq: int, request: Any) -> None:
        """Model line ``seq``'s request, rebuilt in file order: kept as :meth:`request`
        keeps what it rebuilds."""
        self._requests.keep(seq, request)

    def parsed(self, seq: int) -> dict[str, Any]:
        """Line ``seq`` parsed again, without its ``sig``: load checked its bytes, which
        are not changed since, so a plain parse gives what the strict one gave."""
        return self._parse(seq, check=False)[0]

    def _parse(self, seq: int, check: bool = True) -> tuple[dict[str, Any], bool]:
        """:meth:`parsed`, and (``check``) whether a JSON body in it may be written back
        by orjson (:mod:`._fastjson`)."""
        start, end = self.starts[seq + 1], self.ends[seq + 1]
        line, fast = _fastjson.read(self.data[start:end])
        line.pop("sig", None)
        return line, check and fast and _fastjson.exact_for(self.data, start, end)

    def line(self, seq: int) -> Observation:
        """Line ``seq``, restored (the last few are kept: the same object again). A
        restored line is read-only: it shares its request's items with the requests
        rebuilt from it, and its response headers with the next line's."""
        return self._restored(seq, whole=True)

    def counted(self, seq: int) -> Observation:
        """Line ``seq`` as a run's totals count it (:func:`~recorder.cassette.schema.add_step`):
        restored as :meth:`line` restores it, but for a model line's request and what is
        read from it (its model, whether it streams, its fingerprint unless worked out
        already), which nothing counted depends on. A line restored whole already is that
        line."""
        return self._restored(seq, whole=False)

    def _restored(self, seq: int, *, whole: bool) -> Observation:
        """:meth:`line` (``whole``, and kept) or :meth:`counted`."""
        found = self._lines.get(seq)
        if found is not None:
            return cast(Observation, found)
        line, fast = self._parse(seq)
        if line.get("kind") == Kind.MODEL:
            response = line.get("response")
            doc = response.get("body_json", _NONE) if isinstance(response, dict) else _NONE
            try:
                request = self.request(seq, line.get("request")) if whole else None
                fp = self.heads[seq].fp if seq < self.matched else None
                compact.expand(line, _Earlier(self), request, fp=fp, fast=fast)
            except _FAULTS as exc:
                raise self.broken(seq, exc) from None
            # what the next line reads of this one, kept so it is not parsed again: its
            # response headers (the next one's base) and its answer's JSON (resent)
            if isinstance(response, dict) and isinstance(response.get("headers"), list):
                self._headers.keep(seq, response["headers"])
            if doc is not _NONE:
                self._docs.keep(seq, doc)
        return cast(Observation, self._lines.keep(seq, line) if whole else line)

    def served(self, seq: int) -> Observation:
        """Line ``seq`` as a replay serves it: a model line's response restored (its body
        and headers), without its request or what the reader derives from the two (usage,
        model ...), which serving does not read; any other line whole. A line restored
        whole already is that line."""
        found = self._lines.get(seq)
        if found is not None:
            return cast(Observation, found)
        line, fast = self._parse(seq)
        if line.get("kind") != Kind.MODEL:
            return cast(Observation, self._lines.keep(seq, line))
        out: dict[str, Any] = {"seq": line["seq"], "kind": line["kind"]}
        if "error" in line:
            out["error"] = line["error"]
        response = line.get("response")
        if not isinstance(response, dict):
            return cast(Observation, out)
        try:
            headers = self.response_headers(seq, line)
            response.pop("headers_base", None)
            response["headers"] = headers
            compact.restore_body(response, fast=fast)
            _servable(response, out.get("error"))
        except _FAULTS as exc:
            raise self.broken(seq, exc) from None
        out["response"] = response
        return cast(Observation, out)

    def broken(self, seq: int, exc: BaseException) -> CorruptCassette:
        return CorruptCassette(f"{self.path}: seq {seq}: it refers to an earlier line that is "
                               f"missing or different ({exc!r})", path=self.path, seq=seq)

    def require_model(self, seq: int) -> None:
        """A ``KeyError`` unless ``seq`` is a model line read so far."""
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < len(self.heads) \
                or self.heads[seq].kind != Kind.MODEL:
            raise KeyError(seq)

    def request(self, seq: int, stored: Any = None) -> Any:
        """The full request of model line ``seq`` (``stored``: its request as the line
        stores it, when the line is parsed already): the requests it extends, back to one
        that is known or stored whole, rebuilt forwards (no recursion)."""
        self.through(seq, stored if isinstance(stored, dict) else None)  # (shapes before it)
        known = self._requests.find(seq)
        if known is not None:
            return known
        chain: list[tuple[int, dict[str, Any]]] = []
        bodies: dict[int, Any] = {}
        at = seq
        while True:
            self.require_model(at)
            if at != seq or not isinstance(stored, dict):
                stored = self.parsed(at)["request"]
            chain.append((at, stored))
            base = stored.get("base") if "body" not in stored else None
            if base is None:
                break
            self.require_model(base)
            if base >= at:
                raise KeyError(base)
            hit = self._requests.find(base)
            if hit is not None:
                bodies[base] = hit
                break
            at = base
        body = None
        for at, stored in reversed(chain):
            body = bodies[at] = self._requests.keep(at, _delta.decode(
                stored, bodies, self.replies, None, self.shapes, at))
        return body

    def reply(self, seq: int) -> list[Any] | None:
        """The items the response of model line ``seq`` gives its conversation (None:
        none it can be read for)."""
        found = self._replies.get(seq, _NONE)  # one read: another thread may drop it
        if found is not _NONE:
            return cast(list[Any] | None, found)
        self.require_model(seq)
        doc, line = self._docs.get(seq, _NONE), None
        if doc is _NONE and seq not in self._lines:  # else restored: its answer is not JSON
            line = self.parsed(seq)
            response = line.get("response")
            if isinstance(response, dict) and "body_json" in response:
                doc = response["body_json"]
        if doc is not _NONE:
            items = providers.replied(doc)
        else:  # a stream, or a body kept as text: read from its response
            items = self._text_reply(seq, line)
        return cast(list[Any] | None, self._replies.keep(seq, items))

    def _text_reply(self, seq: int, line: dict[str, Any] | None) -> list[Any] | None:
        """:meth:`reply` of model line ``seq`` (``line``: parsed already), whose body is
        kept as text: read from the line's response and its headers restored, without the
        rest of the line (its request, its usage), which the reply does not depend on."""
        found = self._lines.get(seq)
        if found is not None:
            return compact.reply_items(found)
        line = self.parsed(seq) if line is None else line
        response = line.get("response")
        if not isinstance(response, dict):
            return None
        try:
            if "headers" in response:
                headers = self.response_headers(seq, line)
            elif line.get("like") is None and response.get("headers_base") is None:
                headers = None  # none stored, none to restore: as a whole line reads it
            else:
                raise KeyError("headers")
        except _FAULTS as exc:
            raise self.broken(seq, exc) from None
        return compact.reply_items({"kind": line.get("kind"), "provider": self.providers[seq],
                                    "response": response}, headers)

    @property
    def replies(self) -> Replies:
        return Replies(self)

    def response_headers(self, seq: int, parsed: dict[str, Any] | None = None) -> Any:
        """The response headers of model line ``seq`` (``parsed``: the line, parsed
        already), restored: the edits it stores applied to its base's, back to a line that
        is known or stores them whole."""
        chain: list[tuple[int, Any]] = []
        at, value = seq, self._headers.find(seq)
        while value is None:
            stored, base = self._stored_headers(at, parsed if at == seq else None)
            if base is None:
                value = self._headers.keep(at, stored)
                break
            chain.append((at, stored))
            at, value = base, self._headers.find(base)
        for at, stored in reversed(chain):
            value = self._headers.keep(at, compact.based(stored, value))
        return value

    def _stored_headers(self, seq: int, line: dict[str, Any] | None = None
                        ) -> tuple[Any, int | None]:
        """Line ``seq``'s response headers as stored (``line``: the line, parsed already),
        and the line they are based on."""
        self.require_model(seq)
        line = self.parsed(seq) if line is None else line
        response = line["response"]
        base = line["like"] if line.get("like") is not None else response.get("headers_base")
        if base is not None:
            self.require_model(base)
            if base >= seq:
                raise KeyError(base)
        return response["headers"], base

    def sig(self, index: int) -> str:
        """The signature at the end of line ``index`` as the writer puts it."""
        end = self.ends[index]
        return self.data[end - 45:end - 2].decode("ascii")


def _servable(response: dict[str, Any], error: Any) -> None:
    """A ``TypeError`` unless ``response`` has the types a replay serves (what restoring a
    whole line checks by reading them): a signed line deja never wrote is refused as
    corrupt, never served half-read. Each header is a pair of strings already: load
    checked every line's pairs and edits, and restoring only puts those together."""
    status, headers = response.get("status"), response.get("headers")
    if not (isinstance(status, int) and not isinstance(status, bool)
            and isinstance(response.get("body"), str)
            and isinstance(response.get("reason"), str)
            and isinstance(response.get("encoding"), str | None)
            and isinstance(error, dict | None) and isinstance(headers, list)):
        raise TypeError("a response field of a type deja never writes")


class _Earlier:
    """Earlier lines as :func:`compact.expand` reads them: a model line's URL, request
    headers and response headers, restored, without restoring the rest of it."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getitem__(self, seq: int) -> Mapping[str, Any]:
        return _Resolved(self._store, seq)


class _Resolved(Mapping[str, Any]):
    def __init__(self, store: Store, seq: int) -> None:
        store.require_model(seq)
        self._store, self._seq = store, seq

    def __getitem__(self, key: str) -> Any:
        if key == "url":
            return self._store.urls[self._seq]
        if key == "request_headers":
            return self._store.request_headers[self._seq]
        if key == "response":
            return {"headers": self._store.response_headers(self._seq)}
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("url", "request_headers", "response"))

    def __len__(self) -> int:
        return 3


class Lines(Sequence[Observation]):
    """A loaded cassette's observations, restored one at a time when read (see the
    module); :attr:`heads` are what a replay matches them on."""

    def __init__(self, store: Store) -> None:
        self._store = store

    @property
    def heads(self) -> Sequence[Head]:
        """Every line's head, model lines' fingerprints worked out (on the first call)."""
        self._store.through(len(self._store.heads) - 1)
        return self._store.heads

    def kinds(self) -> Iterator[tuple[int, str, str | None]]:
        """Every line's seq, kind and event (a control line's), without restoring any
        line or working out a fingerprint."""
        return ((h.seq, h.kind, h.event) for h in self._store.heads)

    def __len__(self) -> int:
        return len(self._store.heads)

    @overload
    def __getitem__(self, index: int) -> Observation: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Observation, ...]: ...

    def __getitem__(self, index: int | slice) -> Observation | tuple[Observation, ...]:
        n = len(self)
        if isinstance(index, slice):
            return tuple(self._store.line(seq) for seq in range(*index.indices(n)))
        seq = index + n if index < 0 else index
        if not 0 <= seq < n:
            raise IndexError(f"step {index} is out of range 0-{n - 1}")
        return self._store.line(seq)

    def __iter__(self) -> Iterator[Observation]:
        for seq in range(len(self)):
            yield self._store.line(seq)

    def counted(self) -> Iterator[Observation]:
        """Every line as a run's totals count it (:meth:`Store.counted`), in order: a model
        line without its request, which restoring would cost the most."""
        for seq in range(len(self)):
            yield self._store.counted(seq)

    def served(self, seq: int) -> Observation:
        """Line ``seq`` as a replay serves it (:meth:`Store.served`)."""
        return self._store.served(seq)

    def target(self, seq: int) -> tuple[str | None, str | None]:
        """The provider and URL of model line ``seq``, restored."""
        return self._store.providers[seq], self._store.urls[seq]

    def __eq__(self, other: object) -> bool:
        """The same lines as ``other`` (these lines or any sequence of lines), in order."""
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # compared by content, like a list

    def __repr__(self) -> str:
        return f"<{len(self)} lines of {self._store.path}>"


class Requests(Mapping[int, Any]):
    """A loaded cassette's model requests by seq, each rebuilt when read."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getitem__(self, seq: int) -> Any:
        self._store.require_model(seq)
        return self._store.request(seq)

    def __iter__(self) -> Iterator[int]:
        return (h.seq for h in self._store.heads if h.kind == Kind.MODEL)

    def __len__(self) -> int:
        return sum(1 for h in self._store.heads if h.kind == Kind.MODEL)


class Replies(Requests):
    """Seq -> the items the response of that model line gives its conversation (a line
    with none is a ``KeyError``), read when asked for."""

    def __getitem__(self, seq: int) -> Any:
        items = self._store.reply(seq)
        if items is None:
            raise KeyError(seq)
        return items


class Sigs(Sequence[str]):
    """Each line's signature (the header's first), read off the bytes kept; ``odd``:
    those of lines that do not end in the writer's signature field (or ``deja/1``'s)."""

    def __init__(self, store: Store, count: int, odd: dict[int, str]) -> None:
        self._store, self._count, self._odd = store, count, odd

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._count)))
        i = index + self._count if index < 0 else index
        if not 0 <= i < self._count:
            raise IndexError(index)
        found = self._odd.get(i)
        return found if found is not None else self._store.sig(i)


@dataclass
class Reading:
    """What :func:`load` makes of the observation lines as it reads them: the store of
    their heads, the end line, and the sig the next line chains from."""

    store: Store
    prev: str
    odd: dict[int, str]  # line -> its sig, where it is not the writer's last field
    count: int = 1  # lines taken, the header's included
    end: EndLine | None = None
    end_offset: int | None = None

    @classmethod
    def start(cls, store: Store, header_sig: object) -> Reading:
        sig = header_sig if isinstance(header_sig, str) else ""
        return cls(store, sig, {0: sig})

    def signed(self, index: int, sig: object, *, tail: bool) -> None:
        """Line ``index`` holds ``sig``, as the writer's last field (``tail``) or not."""
        self.prev = sig if isinstance(sig, str) else ""
        if not tail:
            self.odd[index] = self.prev

    def note(self, line: dict[str, Any], offset: int) -> None:
        """What a replay matches a step on (its :class:`Head`, a model line's without its
        fingerprint, which is worked out when first asked for), or the end line, kept with
        the byte it starts at. The line itself is let go: it is restored from the bytes
        when read."""
        if line["kind"] == Kind.END:
            self.end, self.end_offset = cast(EndLine, line), offset
            return
        if line["kind"] != Kind.MODEL:
            self.store.add(head_of(line))
            return
        try:
            self._model(line)
        except _FAULTS as exc:
            raise self.store.broken(line["seq"], exc) from None

    def _model(self, line: dict[str, Any]) -> None:
        """A model line's head, URL and request headers (which later lines refer to): its
        fingerprint is worked out when first asked for (:mod:`._fingerprints`)."""
        store = self.store
        like = line.get("like")
        url, headers = (like, like) if like is not None else \
            (line.get("url"), line.get("request_headers"))
        if isinstance(url, int):
            store.require_model(url)
            url = store.urls[url]
        if isinstance(headers, int):
            store.require_model(headers)
            headers = store.request_headers[headers]
        url = url or ""
        request = line.get("request")
        for named in ("base", "reply"):  # the lines a rebuild takes from, known now
            if isinstance(request, dict) and named in request:
                store.require_model(request[named])
        store.add(head_of(line), url, headers, compact.provider_of(line, url).name)
