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

The message a conversation adds after a response is, most of the time, that response's
own message (the assistant turn, as the agent sends it back): ``reply`` names the line
whose response it is, instead of storing it a second time. It is used only when the
message has exactly the JSON text of what the format reads from that response
(:func:`recorder.cassette.compact.reply_of`), so a reader rebuilds the same request.

Decoding needs the requests of earlier lines, so a reader expands requests in file order.
"""

from __future__ import annotations

import copy
import json
from collections import deque
from typing import Any

from recorder import providers  # a module reference: providers imports this package
from recorder.canonical import Parts

WINDOW = 16  # recent requests considered as the base of a new one
# The keys of a stored delta other than the list it adds to (named after its field).
_REFERENCES = frozenset({"base", "keep", "reply", "set", "unset"})


class DeltaEncoder:
    """Remembers recent requests and encodes a new one against the best of them.

    Items are compared as parsed JSON, in C (``list == list``), never re-serialised:
    that keeps recording cost flat as a conversation grows. Python equality takes ``1``,
    ``1.0`` and ``True`` as equal; a history that changed only so would be stored with
    the earlier type, and its replay would report a divergence (never serve a wrong
    response), which is the safe side. A ``reply`` is checked exactly (its JSON text).
    """

    def __init__(self) -> None:
        self._recent: deque[tuple[int, str, dict[str, Any]]] = deque(maxlen=WINDOW)
        self._replies: dict[int, Any] = {}

    def prime(self, seq: int, body: Any) -> None:
        """Remember a request written earlier (a resumed or forked cassette)."""
        field = providers.history_field(body)
        if field is not None:
            self._recent.append((seq, field, body))

    def replied(self, seq: int, message: Any) -> None:
        """Remember the message the response of line ``seq`` gives the conversation."""
        if message is not None:
            self._replies[seq] = message
            while len(self._replies) > WINDOW:
                del self._replies[next(iter(self._replies))]

    def written(self, seq: int, body: Any, reply: Any = None) -> None:
        """Line ``seq`` (request ``body``, its response's ``reply``) is on disk: later
        requests may refer to it. Only then: a line that failed to be written never is."""
        self.prime(seq, body)
        self.replied(seq, reply)

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
        reply = self._replies.get(base_seq)
        if added and reply is not None and _same(added[0], reply):
            delta["reply"] = base_seq
            added = added[1:]
        delta[field] = added
        if changed:
            delta["set"] = changed
        unset = sorted(k for k in base_body if k != field and k not in body)
        if unset:
            delta["unset"] = unset
        return delta


def _same(a: Any, b: Any) -> bool:
    """The same JSON text (types and key order included), so that the request a reader
    rebuilds is the one that was sent; False for anything without a JSON form."""
    try:
        return a == b and _text(a) == _text(b)
    except (ValueError, TypeError, RecursionError):
        return False


def _text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


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
           replies: dict[int, Any] | None = None, parts: Parts | None = None) -> Any:
    """Rebuild a request from its stored form; ``bodies`` maps seq to decoded requests,
    ``replies`` seq to the message its response gives the conversation. ``parts`` learns
    that a rebuilt list shares its history with its base's (the fingerprint
    hashes only what it adds, whichever field its provider names)."""
    if "body" in stored:
        return stored["body"]
    field = history_of(stored)
    base = bodies[stored["base"]]
    body = {k: v for k, v in base.items() if k != field and k not in stored.get("unset", ())}
    body.update(copy.deepcopy(stored.get("set", {})))
    added = stored[field]
    if "reply" in stored:
        added = [(replies if replies is not None else {})[stored["reply"]], *added]
    body[field] = base[field][: stored["keep"]] + added
    if parts is not None:
        parts.extend(body[field], base[field], stored["keep"])
    return body
