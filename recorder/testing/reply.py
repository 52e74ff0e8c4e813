"""What the stub Anthropic server (:mod:`recorder.testing.server`) sends for a turn of its script.

:func:`reply_for` turns a successful turn into a reply that renders as one JSON message or as
the SSE events of a stream: :class:`Reply` builds it from the turn's parts (``text``,
``tool_use``, ...), :class:`RecordedReply` sends a recorded ``message`` as it is, and
:class:`RawStream` a recorded ``sse`` body verbatim, event by event.
:func:`stream_events` renders the events (cut short by the turn's ``sse_error``), and
:func:`scripted_error` the status, body fields and headers of an ``error`` turn. Token counts
a built turn leaves out are rough estimates (four characters a token). The events themselves
are written and read by the stub's own :mod:`recorder.testing.events`.
"""

from __future__ import annotations

import copy
import re
import secrets
import string
from typing import Any, Protocol

from recorder.testing.events import (
    compact_json,
    encode_event,
    read_events,
    split_events,
    write_events,
)
from recorder.testing.match import last_user_text

_BASE62 = string.ascii_letters + string.digits

_DEFAULT_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}

_DEFAULT_ERROR_MESSAGES: dict[str, str] = {
    "overloaded_error": "Overloaded",
    "api_error": "Internal server error",
    "rate_limit_error": "Rate limited",
    "not_found_error": "Not found",
}


def random_id(prefix: str, n: int = 24) -> str:
    return prefix + "".join(secrets.choice(_BASE62) for _ in range(n))


def dumps(obj: Any) -> str:
    return compact_json(obj)


def _rough_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def input_tokens(body: dict) -> int:
    """A rough input token count for a Messages request body."""
    text = dumps(body.get("messages"))
    for key in ("system", "tools"):
        if key in body:
            text += dumps(body[key])
    return _rough_tokens(text)


def _split_words(text: str, words_per_chunk: int = 3) -> list[str]:
    """Split text into chunks of a few words; the chunks concatenate back to ``text``."""
    if not text:
        return []
    pieces = re.split(r"(?<=\s)(?=\S)", text)
    return [
        "".join(pieces[i : i + words_per_chunk]) for i in range(0, len(pieces), words_per_chunk)
    ]


def _split_json(raw: str) -> list[str]:
    """Split a JSON string into 2-3 chunks (as input_json_delta partial_json values)."""
    if len(raw) < 2:
        return [raw]
    if len(raw) < 6:
        mid = len(raw) // 2
        return [raw[:mid], raw[mid:]]
    a, b = len(raw) // 3, 2 * len(raw) // 3
    return [raw[:a], raw[a:b], raw[b:]]


def _turn_uses_echo(turn: dict) -> bool:
    return "{echo}" in turn.get("text", "") or "{echo}" in turn.get("thinking", "")


class Reply:
    """A successful message reply built from a turn, renderable as JSON or SSE events."""

    def __init__(self, turn: dict, body: dict, script_model: str | None) -> None:
        echo = last_user_text(body) if _turn_uses_echo(turn) else ""
        self.model = body.get("model") or script_model or "claude-stub"
        self.id = random_id("msg_")
        self.content: list[dict] = []
        output_parts: list[str] = []

        if "thinking" in turn:
            thinking = turn["thinking"].replace("{echo}", echo)
            self.content.append(
                {"type": "thinking", "thinking": thinking, "signature": random_id("", 64)}
            )
            output_parts.append(thinking)
        if "text" in turn:
            text = turn["text"].replace("{echo}", echo)
            self.content.append({"type": "text", "text": text})
            output_parts.append(text)
        tools = turn.get("tool_use")
        if isinstance(tools, dict):
            tools = [tools]
        for tool in tools or []:
            tool_input = copy.deepcopy(tool.get("input", {}))
            self.content.append(
                {
                    "type": "tool_use",
                    "id": tool.get("id") or random_id("toolu_"),
                    "name": tool["name"],
                    "input": tool_input,
                }
            )
            output_parts.append(tool["name"] + dumps(tool_input))

        self.stop_reason = turn.get("stop_reason") or ("tool_use" if tools else "end_turn")
        self.stop_sequence = turn.get("stop_sequence")
        given = turn.get("usage") or {}
        self.usage = {
            "input_tokens": given.get("input_tokens", input_tokens(body)),
            "output_tokens": given.get("output_tokens", _rough_tokens("".join(output_parts))),
            "cache_creation_input_tokens": given.get("cache_creation_input_tokens", 0),
            "cache_read_input_tokens": given.get("cache_read_input_tokens", 0),
        }

    def message(self) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage,
        }

    def event_bytes(self) -> list[bytes]:
        return write_events(self.message(), cut_text=_split_words,
                            cut_input=lambda value: _split_json(dumps(value)),
                            opening_output_tokens=1)

    @property
    def stream_error(self) -> dict | None:
        return None


class RecordedReply:
    """A recorded message, sent as it is; as a stream, the events that deliver it."""

    def __init__(self, message: dict) -> None:
        self._message = message

    def message(self) -> dict:
        return copy.deepcopy(self._message)

    def event_bytes(self) -> list[bytes]:
        return write_events(self._message)

    @property
    def stream_error(self) -> dict | None:
        return None


class RawStream:
    """A recorded event stream, sent verbatim; as JSON, the message it assembles into."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._assembled = read_events(text)

    def message(self) -> dict:
        return {k: v for k, v in self._assembled.items() if k != "error"}

    def event_bytes(self) -> list[bytes]:
        return split_events(self._text)

    @property
    def stream_error(self) -> dict | None:
        """The error event the stream carries, if any (a non-streaming request gets it)."""
        error = self._assembled.get("error")
        return error if isinstance(error, dict) else None


class Answer(Protocol):
    def message(self) -> dict: ...
    def event_bytes(self) -> list[bytes]: ...
    @property
    def stream_error(self) -> dict | None: ...


def reply_for(turn: dict, body: dict, script_model: str | None) -> Answer:
    """The reply a successful turn sends to the request ``body``."""
    if "sse" in turn:
        return RawStream(turn["sse"])
    if "message" in turn:
        return RecordedReply(turn["message"])
    return Reply(turn, body, script_model)


def stream_events(reply: Answer, turn: dict) -> list[bytes]:
    """The SSE events of ``reply``, each encoded; an ``sse_error`` turn cuts them short."""
    events = reply.event_bytes()
    sse_error = turn.get("sse_error")
    if sse_error is not None:
        cut = min(sse_error.get("after_events", 0), len(events))
        error_event = encode_event(
            "error",
            {
                "type": "error",
                "error": {
                    "type": sse_error.get("type", "overloaded_error"),
                    "message": sse_error.get("message", "Overloaded"),
                },
            },
        )
        events = [*events[:cut], error_event]
    return events


def chunk(payload: bytes) -> bytes:
    """One chunk of a chunked transfer encoding."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def error_body(error_type: str, message: str, request_id: str) -> dict:
    return {
        "type": "error",
        "error": {"type": error_type, "message": message},
        "request_id": request_id,
    }


def scripted_error(
    turn: dict, err: dict, default_status: int, default_type: str | None = None
) -> tuple[int, str, str, dict[str, str]]:
    """Status, error type, message and headers (``_`` for ``-``) of a scripted error."""
    status = err.get("status", default_status)
    error_type = err.get("type") or default_type or _DEFAULT_ERROR_TYPES.get(status)
    if error_type is None:
        error_type = "api_error" if status >= 500 else "invalid_request_error"
    message = err.get("message") or _DEFAULT_ERROR_MESSAGES.get(error_type, error_type)
    headers: dict[str, str] = {}
    retry_after = err.get("retry_after")
    if retry_after is not None:
        seconds = int(retry_after) if float(retry_after).is_integer() else retry_after
        headers["retry_after"] = str(seconds)
        headers["retry_after_ms"] = str(round(float(retry_after) * 1000))
    should_retry = err.get("should_retry", turn.get("should_retry"))
    if should_retry is not None:
        headers["x_should_retry"] = "true" if should_retry else "false"
    for name, value in (err.get("headers") or {}).items():  # given headers win
        key = name.lower().replace("-", "_")
        headers.pop(key, None)
        headers[name] = value
    return status, error_type, message, headers
