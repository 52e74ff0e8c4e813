"""Store each model request as the previous request of its conversation plus what it adds.

A model request repeats the whole conversation so far (the Messages API's and Chat
Completions' ``messages``, the Responses API's ``input`` items, Gemini's ``contents``).
Stored whole, a cassette grows with the square of the number of turns. Stored as a delta
it grows linearly::

    {"body": {...}}                                     the first request of a conversation
    {"base": 7, "keep": 12, "messages": [...],           request of seq 7, its first 12
     "set": {"max_tokens": 2048}, "unset": ["tools"]}     messages, then these; fields changed
    {"base": 7, "keep": 12, "reply": 7, "messages": [...]}
                                                         the same, with seq 7's reply first
    {"base": 7, "keep": 12, "input": [...]}              a list of another name, the same way

Which field of a request holds its conversation is the provider's to say
(:func:`recorder.providers.history_field`); a delta stores what the request adds under that
field's own name, so a reader needs no provider to rebuild it (:func:`history_of`). A
request without such a list (a Responses ``input`` that is a string) is stored whole, and
so is one that shares no first item with a recent request.

The items a conversation adds after a response are, most of the time, that response's own
(the assistant turn, as the agent sends it back): ``reply`` names the line whose response
they are (:func:`recorder.providers.replied` says which items a response gives), instead of
storing them a second time. An SDK sends them back in its own key order, sometimes with
``null`` fields added or left out: ``shape`` then says how (:mod:`._shape`), inline the first
time and as the seq of the line that holds it after that::

    {"base": 7, "keep": 12, "reply": 7, "shape": [[["type", "text"], ["text", "type"]]],
     "messages": [...]}
    {"base": 9, "keep": 14, "reply": 9, "shape": 9, "messages": [...]}

Either is used only when it gives back exactly the JSON text of the items sent, so a reader
rebuilds the same request. ``shape`` comes before the list, so that a reader that does not
know it fails on it rather than read it as the list.

Decoding needs the requests of earlier lines, so a reader expands requests in file order.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from recorder import providers  # a module reference: providers imports this package
from recorder.canonical import Parts
from recorder.cassette import _shape

WINDOW = 16  # recent requests considered as the base of a new one
# The keys of a stored delta other than the list it adds to (named after its field).
_REFERENCES = frozenset({"base", "keep", "reply", "shape", "set", "unset"})


class DeltaEncoder:
    """Remembers recent requests and encodes a new one against the best of them.

    Items are compared as parsed JSON, in C (``list == list``), never re-serialised:
    that keeps recording cost flat as a conversation grows. Python equality takes ``1``,
    ``1.0`` and ``True`` as equal; a history that changed only so would be stored with
    the earlier type, and its replay would report a divergence (never serve a wrong
    response), which is the safe side. A ``reply`` is checked exactly (its JSON text).

    With ``shapes`` (the cassette's header says it reads them) a reply sent back in
    another key order is a reply too; without, only one sent exactly as it came.
    """

    def __init__(self, *, shapes: bool = True) -> None:
        self._recent: deque[tuple[int, str, dict[str, Any]]] = deque(maxlen=WINDOW)
        self._replies: dict[int, Any] = {}
        self._shapes = shapes
        self._shape: tuple[int, _shape.Shape] | None = None  # the last one written inline
        self._pending: tuple[int, _shape.Shape] | None = None  # one in the line being written

    def prime(self, seq: int, body: Any) -> None:
        """Remember a request written earlier (a resumed or forked cassette)."""
        field = providers.history_field(body)
        if field is not None:
            self._recent.append((seq, field, body))

    def replied(self, seq: int, items: list[Any] | Callable[[], list[Any] | None] | None
                ) -> None:
        """Remember the items the response of line ``seq`` gives the conversation (or how
        to find them, asked only when a request may resend them)."""
        if items is not None:
            self._replies[seq] = items
            while len(self._replies) > WINDOW:
                del self._replies[next(iter(self._replies))]

    def written(self, seq: int, body: Any, reply: Any = None) -> None:
        """Line ``seq`` (request ``body``, its response's ``reply``) is on disk: later
        requests may refer to it. Only then: a line that failed to be written never is."""
        self.prime(seq, body)
        self.replied(seq, reply)
        if self._pending is not None and self._pending[0] == seq:
            self._shape = self._pending
        self._pending = None

    def _reply(self, seq: int) -> list[Any] | None:
        found = self._replies.get(seq)
        if callable(found):
            found = self._replies[seq] = found()
        return found

    def encode(self, seq: int, body: Any) -> dict[str, Any]:
        """The stored form of request ``body`` of line ``seq`` (see :meth:`written`)."""
        field = providers.history_field(body)
        if field is None:
            return {"body": body}
        items = body[field]
        best: tuple[int, int, dict[str, Any]] | None = None
        for base_seq, base_field, base_body in reversed(self._recent):  # newest first
            if base_field != field:
                continue
            base_items = base_body[field]
            keep = _common_prefix(base_items, items)
            if keep and (best is None or keep > best[1]):
                best = (base_seq, keep, base_body)
                if keep == len(base_items):  # the conversation grew from it: take it
                    break
        if best is None:
            return {"body": body}
        base_seq, keep, base_body = best
        changed = {k: v for k, v in body.items()
                   if k != field and (k not in base_body or base_body[k] != v)}
        delta: dict[str, Any] = {"base": base_seq, "keep": keep}
        added = items[keep:]
        reply = self._reply(base_seq)
        if reply and len(added) >= len(reply):
            form = self._form(seq, reply, added[:len(reply)])
            if form is not None:
                delta["reply"] = base_seq
                delta.update(form)
                added = added[len(reply):]
        delta[field] = added
        if changed:
            delta["set"] = changed
        unset = sorted(k for k in base_body if k != field and k not in body)
        if unset:
            delta["unset"] = unset
        return delta


    def _form(self, seq: int, reply: list[Any], sent: list[Any]) -> dict[str, Any] | None:
        """How line ``seq``'s request sends ``reply`` back: ``{}`` exactly as it came,
        ``{"shape": ...}`` in a shape (the run's last one, or one learned now), None when
        it is not that reply (its items are stored)."""
        try:
            sent_text = _shape.text(sent)
            if reply == sent and _shape.text(reply) == sent_text:
                return {}
        except (ValueError, TypeError, RecursionError):  # no JSON form: stored as it is
            return None
        if not self._shapes:
            return None
        last = self._shape
        if last is not None and _shape.fits(reply, last[1], sent_text):
            return {"shape": last[0]}
        learned = _shape.learn(reply, sent)
        if learned is None:
            return None
        shape = _shape.merged(last[1] if last is not None else None, learned)
        if not _shape.fits(reply, shape, sent_text):
            return None
        self._pending = (seq, shape)
        return {"shape": _shape.stored(shape)}


def _common_prefix(a: list[Any], b: list[Any]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a conversation grows), compared in C
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def history_of(stored: dict[str, Any]) -> str:
    """The request field a stored delta adds to: the key it stores its items under (every
    delta deja writes has one; a ``KeyError`` for a line that has none)."""
    field = next((k for k in stored if k not in _REFERENCES), None)
    if field is None:
        raise KeyError("the list the request adds to")
    return field


def decode(stored: dict[str, Any], bodies: dict[int, Any],
           replies: Mapping[int, Any] | None = None, parts: Parts | None = None,
           shapes: dict[int, _shape.Shape] | None = None, seq: int | None = None) -> Any:
    """Rebuild line ``seq``'s request from its stored form; ``bodies`` maps seq to decoded
    requests, ``replies`` seq to the items its response gives the conversation,
    ``shapes`` seq to the shape a line holds inline (this one's is added). ``parts``
    learns that a rebuilt list shares its history with its base's (the fingerprint hashes
    only what it adds, whichever field its provider names)."""
    if "body" in stored:
        return stored["body"]
    field = history_of(stored)
    base = bodies[stored["base"]]
    # the base's fields in its order, the list in its place: the request's own order
    body = {k: v for k, v in base.items() if k not in stored.get("unset", ())}
    if "set" in stored:  # a copy: the line's own values stay as stored
        body.update(copy.deepcopy(stored["set"]))
    added = stored[field]
    if "reply" in stored:
        added = [*_resent(stored, replies if replies is not None else {}, shapes, seq), *added]
    body[field] = base[field][: stored["keep"]] + added
    if parts is not None:
        parts.extend(body[field], base[field], stored["keep"])
    return body


def _resent(stored: dict[str, Any], replies: Mapping[int, Any],
            shapes: dict[int, _shape.Shape] | None, seq: int | None) -> list[Any]:
    """The items of the reply a stored delta names, in the shape it names."""
    items = replies[stored["reply"]]
    if "shape" not in stored:
        return list(items)
    shapes = shapes if shapes is not None else {}
    shape = _shape.of(stored["shape"], shapes)
    if not isinstance(stored["shape"], int) and seq is not None:
        shapes[seq] = shape
    return list(_shape.apply(items, shape))
