"""Store each model request as the previous request of its conversation plus what it adds.

A Messages API request repeats the whole conversation so far. Stored whole, a cassette
grows with the square of the number of turns. Stored as a delta it grows linearly::

    {"body": {...}}                                     the first request of a conversation
    {"base": 7, "keep": 12, "messages": [...],           request of seq 7, its first 12
     "set": {"max_tokens": 2048}, "unset": ["tools"]}     messages, then these; fields changed
    {"base": 7, "keep": 12, "reply": 7, "messages": [...]}
                                                         the same, with seq 7's reply first

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

WINDOW = 16  # recent requests considered as the base of a new one


class DeltaEncoder:
    """Remembers recent requests and encodes a new one against the best of them.

    Messages are compared as parsed JSON, in C (``list == list``), never re-serialised:
    that keeps recording cost flat as a conversation grows. Python equality takes ``1``,
    ``1.0`` and ``True`` as equal; a history that changed only so would be stored with
    the earlier type, and its replay would report a divergence (never serve a wrong
    response), which is the safe side. A ``reply`` is checked exactly (its JSON text).
    """

    def __init__(self) -> None:
        self._recent: deque[tuple[int, dict[str, Any]]] = deque(maxlen=WINDOW)
        self._replies: dict[int, Any] = {}

    def prime(self, seq: int, body: Any) -> None:
        """Remember a request written earlier (a resumed or forked cassette)."""
        if isinstance(body, dict) and isinstance(body.get("messages"), list):
            self._recent.append((seq, body))

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
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return {"body": body}
        messages = body["messages"]
        best: tuple[int, int, dict[str, Any]] | None = None
        for base_seq, base_body in reversed(self._recent):  # newest first
            base_messages = base_body["messages"]
            keep = _common_prefix(base_messages, messages)
            if keep and (best is None or keep > best[1]):
                best = (base_seq, keep, base_body)
                if keep == len(base_messages):  # the conversation grew from it: take it
                    break
        if best is None:
            return {"body": body}
        base_seq, keep, base_body = best
        changed = {k: v for k, v in body.items()
                   if k != "messages" and (k not in base_body or base_body[k] != v)}
        delta: dict[str, Any] = {"base": base_seq, "keep": keep}
        added = messages[keep:]
        reply = self._replies.get(base_seq)
        if added and reply is not None and _same(added[0], reply):
            delta["reply"] = base_seq
            added = added[1:]
        delta["messages"] = added
        if changed:
            delta["set"] = changed
        unset = sorted(k for k in base_body if k != "messages" and k not in body)
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


def decode(stored: dict[str, Any], bodies: dict[int, Any],
           replies: dict[int, Any] | None = None) -> Any:
    """Rebuild a request from its stored form; ``bodies`` maps seq to decoded requests,
    ``replies`` seq to the message its response gives the conversation."""
    if "body" in stored:
        return stored["body"]
    base = bodies[stored["base"]]
    body = {k: v for k, v in base.items() if k != "messages" and k not in stored.get("unset", ())}
    body.update(copy.deepcopy(stored.get("set", {})))
    added = stored["messages"]
    if "reply" in stored:
        added = [(replies if replies is not None else {})[stored["reply"]], *added]
    body["messages"] = base["messages"][: stored["keep"]] + added
    return body
