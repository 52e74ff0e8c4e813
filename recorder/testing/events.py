"""The stub server's own Messages event stream: a message written as SSE events, and back.

The stub is the witness the recorder, the replayer and the SDK are tested against, so it
writes and reads the wire format itself instead of sharing the recorder's code for it: a
mistake in one implementation then shows up as a disagreement with the other, not as two
sides agreeing on the same wrong bytes.

:func:`write_events` renders a complete message as the events the API streams for it
(``message_start``, ``ping``, a start, deltas and a stop per content block, ``message_delta``,
``message_stop``); how a block's text or tool input is cut into deltas is the caller's choice.
:func:`read_events` folds a recorded stream back into the message it delivers, and
:func:`split_events` cuts a stream's text into its events, bytes for bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["compact_json", "encode_event", "read_events", "split_events", "write_events"]

_COMPACT = (",", ":")
# Block types whose content arrives in deltas, and the field each one empties in its start.
_STREAMED = {"text": ("text",), "thinking": ("thinking", "signature"), "tool_use": ("input",)}
# The fields of message_start's message that the stream fills in only later.
_LATER = ("content", "stop_reason", "stop_sequence", "usage")


def compact_json(value: Any) -> str:
    """JSON without spaces, non-ASCII kept: the form the stub sends everything in."""
    return json.dumps(value, separators=_COMPACT, ensure_ascii=False)


def encode_event(name: str, data: Mapping[str, Any]) -> bytes:
    """One server-sent event, with the blank line that ends it."""
    return f"event: {name}\ndata: {compact_json(data)}\n\n".encode()


def _whole_text(text: str) -> list[str]:
    return [text]


def _whole_input(value: Any) -> list[str]:
    return [json.dumps(value, ensure_ascii=False)]


def _empty_head(block: Mapping[str, Any]) -> dict[str, Any]:
    head = dict(block)
    for name in _STREAMED[block["type"]]:
        head[name] = {} if name == "input" else ""
    return head


def _deltas(block: Mapping[str, Any], cut_text: Callable[[str], list[str]],
            cut_input: Callable[[Any], list[str]]) -> list[dict[str, Any]]:
    kind = block["type"]
    if kind == "text":
        return [{"type": "text_delta", "text": piece} for piece in cut_text(block.get("text", ""))]
    if kind == "thinking":
        pieces = cut_text(block.get("thinking", ""))
        return [*({"type": "thinking_delta", "thinking": piece} for piece in pieces),
                {"type": "signature_delta", "signature": block.get("signature", "")}]
    return [{"type": "input_json_delta", "partial_json": piece}
            for piece in cut_input(block.get("input", {}))]


def write_events(
    message: Mapping[str, Any],
    *,
    cut_text: Callable[[str], list[str]] = _whole_text,
    cut_input: Callable[[Any], list[str]] = _whole_input,
    opening_output_tokens: int | None = None,
) -> list[bytes]:
    """The events that stream ``message``, each encoded.

    ``cut_text`` cuts a text or thinking block's text into its deltas, ``cut_input`` a tool
    block's input into ``partial_json`` pieces (by default each arrives whole, in one delta).
    ``message_start`` reports ``opening_output_tokens`` output tokens (by default at most one),
    ``message_delta`` the message's own count. A block of a type with no deltas is sent whole
    in its start event.
    """
    usage = dict(message.get("usage") or {})
    final_output = usage.get("output_tokens", 0)
    opening = opening_output_tokens
    if opening is None:
        opening = min(1, usage.get("output_tokens", 1))
    start = {key: value for key, value in message.items() if key not in _LATER}
    start.update(content=[], stop_reason=None, stop_sequence=None,
                 usage={**usage, "output_tokens": opening})
    out = [encode_event("message_start", {"type": "message_start", "message": start}),
           encode_event("ping", {"type": "ping"})]
    for index, block in enumerate(message.get("content") or []):
        streamed = block.get("type") in _STREAMED
        head = _empty_head(block) if streamed else block
        out.append(encode_event("content_block_start",
                                {"type": "content_block_start", "index": index,
                                 "content_block": head}))
        for delta in _deltas(block, cut_text, cut_input) if streamed else []:
            out.append(encode_event("content_block_delta",
                                    {"type": "content_block_delta", "index": index,
                                     "delta": delta}))
        out.append(encode_event("content_block_stop",
                                {"type": "content_block_stop", "index": index}))
    out.append(encode_event("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": message.get("stop_reason"),
                  "stop_sequence": message.get("stop_sequence")},
        "usage": {"output_tokens": final_output},
    }))
    out.append(encode_event("message_stop", {"type": "message_stop"}))
    return out


def split_events(text: str) -> list[bytes]:
    """The events of an event-stream text, each with its blank line, bytes for bytes."""
    return [part.encode() for part in re.split(r"(?<=\n\n)|(?<=\r\n\r\n)", text) if part]


def _parsed(text: str) -> list[tuple[str, Any]]:
    """Each event's name and decoded data; events without data or with bad JSON are left out."""
    parsed: list[tuple[str, Any]] = []
    for raw in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in raw.split("\n"):
            field, _, value = line.partition(":")
            if field == "event":
                name = value.strip()
            elif field == "data":
                data.append(value.lstrip(" "))
        if not data:
            continue
        try:
            parsed.append((name, json.loads("\n".join(data))))
        except ValueError:
            continue
    return parsed


class _Folder:
    """The message a stream builds up, event by event."""

    def __init__(self) -> None:
        self.message: dict[str, Any] = {}
        self.blocks: dict[int, dict[str, Any]] = {}
        self.json_parts: dict[int, list[str]] = {}

    def fold(self, kind: str, doc: Any) -> None:
        if kind == "message_start":
            self.message = {**(doc.get("message") or {}), "content": []}
        elif kind == "content_block_start":
            self.blocks[doc["index"]] = dict(doc.get("content_block") or {})
        elif kind == "content_block_delta":
            self._delta(self.blocks.setdefault(doc["index"], {}), doc["index"],
                        doc.get("delta") or {})
        elif kind == "content_block_stop" and doc["index"] in self.json_parts:
            raw = "".join(self.json_parts.pop(doc["index"]))
            try:
                self.blocks[doc["index"]]["input"] = json.loads(raw) if raw else {}
            except ValueError:
                self.blocks[doc["index"]]["input"] = raw
        elif kind == "message_delta":
            delta = doc.get("delta") or {}
            self.message.update({k: delta[k] for k in ("stop_reason", "stop_sequence")
                                 if k in delta})
            self.message["usage"] = {**(self.message.get("usage") or {}),
                                     **(doc.get("usage") or {})}
        elif kind == "error":
            self.message["error"] = doc.get("error")

    def _delta(self, block: dict[str, Any], index: int, delta: Mapping[str, Any]) -> None:
        appended = {"text_delta": "text", "thinking_delta": "thinking",
                    "signature_delta": "signature"}.get(delta.get("type", ""))
        if appended is not None:
            block[appended] = block.get(appended, "") + delta.get(appended, "")
        elif delta.get("type") == "input_json_delta":
            self.json_parts.setdefault(index, []).append(delta.get("partial_json", ""))


def read_events(text: str) -> dict[str, Any]:
    """The message a recorded event stream delivers; an ``error`` event is kept as ``error``.

    Tool input is parsed from its ``partial_json`` pieces (kept as the text when it is not
    JSON); the usage of ``message_delta`` is laid over that of ``message_start``.
    """
    folder = _Folder()
    for name, doc in _parsed(text):
        kind = doc.get("type", name) if isinstance(doc, dict) else name
        folder.fold(kind, doc)
    folder.message["content"] = [folder.blocks[i] for i in sorted(folder.blocks)]
    return folder.message
