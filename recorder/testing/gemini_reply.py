"""What the stub server (:mod:`recorder.testing.server`) sends to a Gemini request.

The stub answers ``POST .../models/{model}:generateContent`` and
``:streamGenerateContent`` (under any version prefix: ``/v1beta/models/...``, as the
``google-genai`` SDK asks) from the same scripts as the Messages API
(:mod:`recorder.testing.script`), chosen by the same rules (:mod:`recorder.testing.match`
reads a Gemini ``contents`` list too). A turn's parts become Gemini's wire format:

- ``text`` is a text part of the candidate's ``content`` (role ``model``), ``thinking`` a
  thought part (``"thought": true``) before it, and each ``tool_use`` a ``functionCall``
  part (``name``, ``args`` its ``input``; ``id`` only when the script gives one: Gemini
  sends none of its own).
- ``stop_reason`` is read in either vocabulary: ``end_turn``, ``tool_use`` and
  ``stop_sequence`` are ``STOP`` (Gemini ends a function call with ``STOP`` too),
  ``max_tokens`` is ``MAX_TOKENS``, ``refusal`` is ``SAFETY``; a Gemini ``finishReason``
  is sent as it is.
- ``usage`` is given in deja's names; ``cache_read_input_tokens`` become the
  ``cachedContentTokenCount``, counted inside ``promptTokenCount`` as Gemini counts them.
- A recorded Gemini ``message`` (a ``GenerateContentResponse``, with ``candidates``) is
  sent as it is to a JSON request and as a one-chunk stream to a streaming one; an
  Anthropic ``message`` or ``sse`` stream as its text and tool calls (with their ids); an
  ``sse`` body that is already a Gemini stream (``data:`` lines of responses) verbatim.
- Errors (``error``, ``sse_error``) keep their status and retry headers; the body is
  Google's ``{"error": {"code", "message", "status"}}``, and a stream cut by ``sse_error``
  ends with a chunk of that error.

A stream is ``data: {chunk}`` lines separated by ``\\r\\n\\r\\n``, as the API sends them:
the text a few words a chunk, each function call whole in a chunk of its own, the last
chunk with the ``finishReason``; every chunk carries ``usageMetadata``, counting the prompt
only until the last one counts everything. Standard library and the stub's own modules
only: an implementation of the format independent of the recorder's.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from recorder.testing.events import compact_json, read_events
from recorder.testing.match import GEMINI_GENERATE, GEMINI_STREAM, last_user_text, position
from recorder.testing.openai_reply import _parts_of
from recorder.testing.reply import _split_words, random_id, scripted_error

__all__ = ["STATUS", "GeminiReply", "Outcome", "answer", "endpoint", "error_body", "model_of",
           "validate"]

_FINISH = {"end_turn": "STOP", "tool_use": "STOP", "stop_sequence": "STOP",
           "pause_turn": "STOP", "max_tokens": "MAX_TOKENS", "refusal": "SAFETY"}
# Google's status name of an HTTP error status.
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
          404: "NOT_FOUND", 409: "ABORTED", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED",
          500: "INTERNAL", 501: "NOT_IMPLEMENTED", 503: "UNAVAILABLE",
          504: "DEADLINE_EXCEEDED"}
_MESSAGES = {429: "Resource has been exhausted (e.g. check quota).",
             503: "The model is overloaded. Please try again later."}


def endpoint(route: str) -> str | None:
    """Which Gemini endpoint a request path is (None: not one)."""
    if "/models/" not in route:
        return None
    return next((e for e in (GEMINI_GENERATE, GEMINI_STREAM) if route.endswith(e)), None)


def model_of(route: str) -> str:
    """The model a Gemini path names (``.../models/gemini-2.5-flash:generateContent``)."""
    return route.rpartition("/models/")[2].rpartition(":")[0]


def validate(body: dict) -> str | None:
    """An error message like Gemini's for a malformed request (None: it is well formed)."""
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        return "* GenerateContentRequest.contents: contents is not specified"
    return None


def error_body(status: int, message: str | None = None, kind: str | None = None) -> dict:
    """Google's error body for ``status`` (``kind``: its status name)."""
    name = kind or STATUS.get(status) or ("INTERNAL" if status >= 500 else "INVALID_ARGUMENT")
    text = message or _MESSAGES.get(status) or (
        "An internal error has occurred." if status >= 500 else "Request contains an invalid "
        "argument.")
    return {"error": {"code": status, "message": text, "status": name}}


def _is_gemini(message: Any) -> bool:
    return isinstance(message, dict) and isinstance(message.get("candidates"), list)


def _chunk(response: dict) -> bytes:
    return f"data: {compact_json(response)}\r\n\r\n".encode()


class GeminiReply:
    """A successful answer to a Gemini request, as one JSON response or its stream."""

    def __init__(self, route: str, turn: dict, body: dict, script_model: str | None) -> None:
        self.body = body
        self.raw_stream: str | None = None
        self.recorded: dict | None = None  # a recorded Gemini response, sent as it is
        if "sse" in turn:
            if "event: message_start" not in turn["sse"]:
                self.raw_stream = turn["sse"]  # a Gemini stream as recorded
                turn = {}
            else:
                turn = _parts_of(read_events(turn["sse"]))
        elif "message" in turn:
            if _is_gemini(turn["message"]):
                self.recorded, turn = turn["message"], {}
            else:
                turn = _parts_of(turn["message"])
        echo = last_user_text(body)
        self.thinking = turn["thinking"].replace("{echo}", echo) if "thinking" in turn else None
        self.text = turn["text"].replace("{echo}", echo) if "text" in turn else None
        tools = turn.get("tool_use") or []
        self.tools = [tools] if isinstance(tools, dict) else list(tools)
        self.model = model_of(route) or script_model or "gemini-stub"
        given = turn.get("stop_reason")
        self.finish = _FINISH.get(given, given) if given else "STOP"
        usage = turn.get("usage") or {}
        out_text = (self.thinking or "") + (self.text or "") + "".join(
            str(t.get("name")) + compact_json(t.get("input") or {}) for t in self.tools)
        self.cached = usage.get("cache_read_input_tokens", 0)
        self.prompt = usage.get("input_tokens", self._rough_input()) + self.cached
        self.output = usage.get("output_tokens", max(1, len(out_text) // 4))
        self.id = random_id("", 22)

    def _rough_input(self) -> int:
        text = compact_json([self.body.get(k) for k in ("contents", "systemInstruction",
                                                       "tools")])
        return max(1, len(text) // 4)

    def _usage(self, final: bool = True) -> dict:
        usage: dict[str, Any] = {"promptTokenCount": self.prompt}
        if final:
            usage["candidatesTokenCount"] = self.output
        usage["totalTokenCount"] = self.prompt + (self.output if final else 0)
        if self.cached:
            usage["cachedContentTokenCount"] = self.cached
        return usage

    def _calls(self) -> list[dict]:
        calls = []
        for tool in self.tools:
            call = {"name": tool.get("name"), "args": tool.get("input") or {}}
            if tool.get("id"):
                call["id"] = tool["id"]
            calls.append({"functionCall": call})
        return calls

    def _response(self, parts: list[dict], final: bool = True) -> dict:
        candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}}
        if final:
            candidate["finishReason"] = self.finish
        candidate["index"] = 0
        return {"candidates": [candidate], "usageMetadata": self._usage(final),
                "modelVersion": self.model, "responseId": self.id}

    def message(self) -> dict:
        """The JSON body of a non-streaming answer."""
        if self.recorded is not None:
            return self.recorded
        parts: list[dict] = []
        if self.thinking is not None:
            parts.append({"text": self.thinking, "thought": True})
        if self.text is not None:
            parts.append({"text": self.text})
        return self._response([*parts, *self._calls()])

    def event_bytes(self) -> list[bytes]:
        """The chunks of a streaming answer, each encoded."""
        if self.raw_stream is not None:
            return [p.encode() for p in re.split(r"(?<=\n\n)", self.raw_stream) if p]
        if self.recorded is not None:
            return [_chunk(self.recorded)]
        pieces: list[list[dict]] = []
        if self.thinking:
            pieces += [[{"text": w, "thought": True}] for w in _split_words(self.thinking)]
        pieces += [[{"text": w}] for w in _split_words(self.text or "")]
        pieces += [[call] for call in self._calls()]
        if not pieces:
            pieces = [[{"text": ""}]]
        return [_chunk(self._response(parts, n == len(pieces) - 1))
                for n, parts in enumerate(pieces)]

    @staticmethod
    def stream_error(events: list[bytes], err: dict) -> list[bytes]:
        """``events`` cut after ``after_events`` by the error an ``sse_error`` turn sends."""
        cut = events[:min(err.get("after_events", 0), len(events))]
        status = err.get("status", 500)
        return [*cut, _chunk(error_body(status, err.get("message"), err.get("type")))]


# ------------------------------------------------------------------ what the server sends


class _Stub(Protocol):
    """What :func:`answer` asks of the server (:class:`recorder.testing.server.StubServer`)."""

    def receive(self, path: str, headers: dict[str, str], body: dict | None) -> None: ...

    def turn_for(self, body: dict, attempt_number: int = 0,
                 endpoint: str | None = None) -> tuple[dict | None, str | None]: ...


@dataclass(frozen=True)
class Outcome:
    """What the server sends a Gemini request: the ``events`` of a stream, else a JSON
    ``body`` with ``status`` and ``headers``; ``turn`` is the script's turn that answers
    (its ``drop`` and ``event_delay_ms``), ``{}`` when none does."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    events: list[bytes] | None = None
    turn: dict = field(default_factory=dict)


def _error(status: int, message: str | None = None, kind: str | None = None,
           **headers: str) -> Outcome:
    return Outcome(status, error_body(status, message, kind), headers)


def answer(stub: _Stub, path: str, route: str, raw: bytes,
           headers: Mapping[str, str]) -> Outcome:
    """The answer to a Gemini request (``route``, its path without the query, is one of
    :func:`endpoint`'s), chosen from the script as a Messages request's is. The SDK sends
    no attempt number: a request is always attempt 0."""
    api = endpoint(route)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        stub.receive(path, dict(headers), None)
        return _error(400, f"Invalid JSON payload received. {exc}")
    body = body if isinstance(body, dict) else None
    stub.receive(path, dict(headers), body)
    problem = "Invalid JSON payload: not an object" if body is None else validate(body)
    if body is None or problem:
        return _error(400, problem)
    turn, script_model = stub.turn_for(body, 0, api)
    if turn is None:
        return _error(500, "stub script exhausted: no rule, turn or default of the script "
                      f"answers this request (position {position(body)} of its conversation)",
                      x_should_retry="false")
    if turn.get("delay_ms"):
        time.sleep(turn["delay_ms"] / 1000)
    stream = api == GEMINI_STREAM
    failure = turn.get("error") or (None if stream else turn.get("sse_error"))
    if failure is not None:
        status, _, _, extra = scripted_error(turn, failure, 500, "-")
        return _error(status, failure.get("message"), failure.get("type"), **extra)
    reply = GeminiReply(route, turn, body, script_model)
    if not stream:
        return Outcome(body=reply.message(), turn=turn)
    events = reply.event_bytes()
    if "sse_error" in turn:
        events = reply.stream_error(events, turn["sse_error"])
    return Outcome(events=events, turn=turn)
