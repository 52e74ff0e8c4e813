"""A made-up model API as one deja provider module, installed as a plugin.

The toy API is nothing like the built-in ones, so that whatever deja does with it goes
through the provider seam (:mod:`recorder.providers`) and nowhere else:

- ``POST /toy/v1/generate`` with ``{"model", "rules", "turns", "stream", "nonce"}``:
  ``turns`` is the whole conversation so far, resent and grown by every request;
  ``nonce`` is fresh in every request and means nothing (a replay must not match on it);
- a turn is ``{"kind": "ask", "text"}`` (the user), ``{"kind": "say", "text"}`` (the
  model), ``{"kind": "call", "id", "tool", "args"}`` (the model asks for a tool) or
  ``{"kind": "result", "id", "output"}`` (what the tool returned);
- the answer is one JSON object ``{"id", "model", "turns", "finish", "tokens",
  "served_at"}``, or, when asked to stream, newline-delimited JSON events
  (``application/x-ndjson``): ``begin``, ``text`` pieces, ``call``, ``finish``, and
  ``fail`` for an error mid-stream; an error is ``{"code", "detail"}`` with its status;
- token counts are ``in``, ``out`` and ``cached``; ``finish`` is ``"call"`` when the
  model waits for tool results, else ``"done"``.

Registered through the ``deja.providers`` entry point group::

    [deja.providers]
    toy = toy_deja:provider
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from recorder.providers import (
    VOLATILE_HEADERS,
    Carriage,
    Conversation,
    Format,
    Headers,
    Provider,
    Summary,
    token_counts,
)

ENDPOINT = "/toy/v1/generate"
NDJSON = "application/x-ndjson"
USER_KINDS = frozenset({"ask", "result"})  # every other kind of turn is the model's


class ToyFormat(Format):
    """What the toy API's messages mean (see the module docstring)."""

    volatile_message_keys = ("id", "served_at")

    def semantic_request(self, body: Any) -> Any:
        """The request without its ``nonce``, which is noise."""
        if isinstance(body, dict):
            return {k: v for k, v in body.items() if k != "nonce"}
        return body

    def history_field(self, body: Any) -> str | None:
        """``turns``: the conversation every request resends and grows."""
        return "turns" if isinstance(body, dict) and isinstance(body.get("turns"), list) \
            else None

    def assemble(self, text: str) -> dict[str, Any]:
        """The message a stream's events deliver: text pieces joined into one ``say``
        turn, each ``call`` a turn of its own, in the order they came."""
        message: dict[str, Any] = {"turns": []}
        turns: list[dict[str, Any]] = message["turns"]
        for event in _events(text):
            kind = event.get("event")
            if kind == "begin":
                message.update(id=event.get("id"), model=event.get("model"),
                               tokens=dict(event.get("tokens") or {}))
            elif kind == "text":
                if not turns or turns[-1]["kind"] != "say":
                    turns.append({"kind": "say", "text": ""})
                turns[-1]["text"] += str(event.get("piece", ""))
            elif kind == "call":
                turns.append({"kind": "call", "id": event.get("id"),
                              "tool": event.get("tool"), "args": event.get("args")})
            elif kind == "finish":
                message["finish"] = event.get("finish")
                message["tokens"] = {**message.get("tokens", {}),
                                     **(event.get("tokens") or {})}
            elif kind == "fail":
                message["error"] = {"code": event.get("code"), "detail": event.get("detail")}
        return message

    def synthesize(self, message: dict[str, Any]) -> str:
        """The events of a stream that delivers ``message``: its text in one piece."""
        tokens = dict(message.get("tokens") or {})
        events: list[dict[str, Any]] = [
            {"event": "begin", "id": message.get("id"), "model": message.get("model"),
             "tokens": {k: v for k, v in tokens.items() if k != "out"}}]
        for turn in message.get("turns") or []:
            if turn.get("kind") == "say":
                events.append({"event": "text", "piece": turn.get("text", "")})
            elif turn.get("kind") == "call":
                events.append({"event": "call", "id": turn.get("id"), "tool": turn.get("tool"),
                               "args": turn.get("args")})
        events.append({"event": "finish", "finish": message.get("finish"),
                       "tokens": {"out": tokens.get("out", 0)}})
        return "".join(json.dumps(event) + "\n" for event in events)

    def usage(self, message: Any) -> dict[str, int]:
        tokens = message.get("tokens") if isinstance(message, dict) else None
        tokens = tokens if isinstance(tokens, dict) else {}
        return token_counts({"input_tokens": tokens.get("in"),
                             "output_tokens": tokens.get("out"),
                             "cache_read_input_tokens": tokens.get("cached")})

    def stop_reason(self, message: Any) -> Any:
        return message.get("finish") if isinstance(message, dict) else None

    def turn_unfinished(self, stop_reason: Any) -> bool:
        """A reply that finished with ``call`` waits for the agent's tool results."""
        return bool(stop_reason == "call")

    def summarize_json(self, status: int, doc: Any) -> Summary:
        if not isinstance(doc, dict):
            return {}
        if status >= 400:
            return {"error": _error(doc)}
        summary: Summary = {"message_id": doc.get("id"), "model": doc.get("model"),
                            "stop_reason": self.stop_reason(doc), "usage": self.usage(doc)}
        if isinstance(doc.get("error"), dict):  # a stream that failed after it began
            summary["error"] = _error(doc["error"])
        return summary

    def summarize_stream(self, text: str) -> Summary:
        """What a stream said, event by event: a stream cut short (a line torn, a
        ``fail`` event) still says what came before."""
        return self.summarize_json(200, self.assemble(text))

    def conversation(self, request: Any, message: Any = None) -> Conversation:
        """The turns in deja's shape: ``ask`` and ``result`` are the user's (a text block,
        a ``tool_result`` block), ``say`` and ``call`` the assistant's (a text block, a
        ``tool_use`` block), each turn a message. ``rules`` is the system prompt."""
        body = request if isinstance(request, dict) else {}
        turns = body.get("turns")
        reply = None
        if isinstance(message, dict) and isinstance(message.get("turns"), list):
            reply = {"role": "assistant", "content": [_block(t) for t in message["turns"]
                                                      if isinstance(t, dict)]}
        return {"system": body.get("rules"),
                "messages": [_message(t) for t in turns if isinstance(t, dict)]
                if isinstance(turns, list) else [],
                "reply": reply,
                "settings": {k: v for k, v in body.items() if k not in ("rules", "turns")}}

    def tool_result_slots(self, body: Any) -> list[tuple[dict[str, Any], str]]:
        """Each ``result`` turn's ``output``, in the conversation's order."""
        turns = body.get("turns") if isinstance(body, dict) else None
        return [(turn, "output") for turn in turns or []
                if isinstance(turn, dict) and turn.get("kind") == "result"]


def _events(text: str) -> Iterator[dict[str, Any]]:
    """The events of a stream's text; a line that is no JSON object (torn) is skipped."""
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def _error(doc: dict[str, Any]) -> dict[str, Any]:
    """An error body (``{"code", "detail"}``) in deja's terms."""
    return {"type": doc.get("code"), "message": doc.get("detail")}


def _block(turn: dict[str, Any]) -> dict[str, Any]:
    """One turn as a block of deja's shape."""
    kind = turn.get("kind")
    if kind == "call":
        return {"type": "tool_use", "id": turn.get("id"), "name": turn.get("tool"),
                "input": turn.get("args")}
    if kind == "result":
        return {"type": "tool_result", "tool_use_id": turn.get("id"),
                "content": turn.get("output")}
    if kind in ("ask", "say"):
        return {"type": "text", "text": turn.get("text")}
    return dict(turn)  # a kind this module does not know, kept as it is


def _message(turn: dict[str, Any]) -> dict[str, Any]:
    """One turn as one message of deja's shape (a message per item of the history, as
    a stored request's ``keep`` counts them)."""
    role = "user" if turn.get("kind") in USER_KINDS else "assistant"
    return {"role": role, "content": [_block(turn)]}


class ToyCarriage(Carriage):
    """The toy API over HTTP: one endpoint, its key in ``TOY_API_KEY``, a per-request
    ``x-toy-trace`` header that means nothing, and streams as NDJSON."""

    def __init__(self) -> None:
        super().__init__((ENDPOINT,), key_env=("TOY_API_KEY",),
                         volatile_headers=VOLATILE_HEADERS | {"x-toy-trace"})

    def is_stream(self, headers: Headers) -> bool:
        return any(str(k).lower() == "content-type" and str(v).startswith(NDJSON)
                   for k, v in headers)


def provider() -> Provider:
    """The toy provider: the ``deja.providers`` entry point."""
    return Provider("toy", ToyFormat(), ToyCarriage())
