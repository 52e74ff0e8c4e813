"""The Anthropic Messages format, and Anthropic's API that carries it (``POST /v1/messages``).

A response is one JSON message, or the event stream of a streamed call: ``message_start``
carries the id, model and input usage, ``content_block_*`` the content, ``message_delta``
the stop reason and output usage, ``error`` an error that came after the headers. Usage
has the cache counts (``cache_creation_input_tokens``, ``cache_read_input_tokens``) the
price table charges for. Assembling a stream into the message and synthesising a stream
from a message live in :mod:`recorder.providers._anthropic_sse`.

:class:`MessagesFormat` is the format alone: Amazon Bedrock carries it too
(:mod:`recorder.providers.bedrock`), framed otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from recorder import _fastjson
from recorder.providers._anthropic_sse import assemble, synthesize
from recorder.providers.base import (
    Carriage,
    Format,
    Provider,
    Summary,
    sse_blocks,
    sse_event,
    token_counts,
)
from recorder.providers.pricing import CACHE_WRITE_1H

__all__ = ["MessagesFormat", "provider"]


def provider() -> Provider:
    """The Messages format over Anthropic's API."""
    return Provider("anthropic", MessagesFormat(),
                    Carriage(("/v1/messages",), key_env=("ANTHROPIC_API_KEY",),
                             base_url_env={"ANTHROPIC_BASE_URL": ""}))


class MessagesFormat(Format):
    def volatile_request_fields(self) -> tuple[str, ...]:
        """The user id in ``metadata`` (for abuse tracking only) and every
        ``cache_control`` marker (where the cache breaks is no part of the conversation)."""
        return ("/metadata/user_id", "/**/cache_control")

    def is_request_id(self, holder: str | None, obj: Mapping[str, Any], key: str) -> bool:
        """A tool call's ``id`` (``tool_use``, ``server_tool_use``, ``mcp_tool_use``) and a
        result's ``tool_use_id``."""
        kind = obj.get("type")
        return key == "tool_use_id" or (key == "id" and isinstance(kind, str)
                                        and kind.endswith("tool_use"))

    def stream_pieces(self, text: bytes) -> list[list[tuple[int, int]]]:
        """Text, thinking and tool input deltas, per content block."""
        if b"_delta" not in text:
            return []
        blocks: dict[bytes, list[tuple[int, int]]] = {}
        for m in _DELTA.finditer(text):
            blocks.setdefault(m.group(1), []).append(m.span(2))
        return list(blocks.values())

    def assemble(self, text: str) -> dict[str, Any]:
        return assemble(text)

    def synthesize(self, message: dict[str, Any]) -> str:
        return synthesize(message)

    def usage(self, message: Any) -> dict[str, int]:
        return _usage(message.get("usage")) if isinstance(message, dict) else {}

    def stop_reason(self, message: Any) -> Any:
        return message.get("stop_reason") if isinstance(message, dict) else None

    def turn_unfinished(self, stop_reason: Any) -> bool:
        """A reply that asks for tool calls (``tool_use``), or a long turn the API paused
        (``pause_turn``, which the agent resumes by sending it back)."""
        return stop_reason in ("tool_use", "pause_turn")

    def tool_result_slots(self, body: Any) -> list[tuple[dict[str, Any], str]]:
        """Each ``tool_result`` block's ``content``, in any message's list of blocks."""
        messages = body.get("messages") if isinstance(body, dict) else None
        return [(block, "content") for message in messages or () if isinstance(message, dict)
                and isinstance(message.get("content"), list) for block in message["content"]
                if isinstance(block, dict) and block.get("type") == "tool_result"] \
            if isinstance(messages, list) else []

    def summarize_json(self, status: int, doc: Any) -> Summary:
        if not isinstance(doc, dict):
            return {}
        if status >= 400 or doc.get("type") == "error":
            # Bedrock's errors are {"message": ...}, its type in a header
            return {"error": _error(doc.get("error", doc))}
        return {"message_id": doc.get("id"), "model": doc.get("model"),
                "stop_reason": self.stop_reason(doc), "usage": self.usage(doc)}

    def summarize_stream(self, text: str) -> Summary:
        """Read event by event, so that a stream cut short still says what it said."""
        usage: dict[str, int] = {}
        out: Summary = {"usage": usage}
        for block in sse_blocks(text):
            # a block without these words can hold neither a summary event's name nor
            # any of _SUMMARY_TOKENS: content, not read further
            if "message_" not in block and "error" not in block and "\\u" not in block:
                continue
            found = sse_event(block)
            if found is None:
                continue
            event, data = found
            if event not in _SUMMARY_EVENTS and not any(t in data for t in _SUMMARY_TOKENS):
                continue  # content: nothing the summary reads (and cheaper not to parse)
            try:
                doc = _fastjson.loads_text(data)
            except (ValueError, RecursionError):  # nested too deep: says nothing
                continue
            if not isinstance(doc, dict):
                continue
            kind = doc.get("type", event)
            if kind == "message_start":
                msg = doc.get("message") or {}
                out["message_id"] = msg.get("id")
                out["model"] = msg.get("model")
                usage.update(_usage(msg.get("usage")))
            elif kind == "message_delta":
                delta = doc.get("delta") or {}
                if delta.get("stop_reason"):
                    out["stop_reason"] = delta["stop_reason"]
                usage.update(_usage(doc.get("usage")))
            elif kind == "error":
                out["error"] = _error(doc.get("error"))
        return out


_DELTA = re.compile(
    rb'"index":\s*(\d+),\s*"delta":\s*\{\s*"type":\s*"(?:text|thinking|input_json)_delta",'
    rb'\s*"(?:text|thinking|partial_json)":\s*"((?:[^"\\]|\\.)*)"')

# The events a summary reads. An event whose name is none of them, and whose data holds
# none of their names as a JSON string (nor a \u escape, which could spell one), cannot be
# one of them: its data is skipped unparsed.
_SUMMARY_EVENTS = frozenset({"message_start", "message_delta", "error"})
_SUMMARY_TOKENS = ('"message_start"', '"message_delta"', '"error"', "\\u")


def _usage(usage: Any) -> dict[str, int]:
    """Token counts in deja's names, with the one-hour share of the cache writes apart
    (priced at its own rate) when the usage breaks the writes down by lifetime."""
    counts = token_counts(usage)
    split = token_counts(usage.get("cache_creation") if isinstance(usage, dict) else None,
                         ("ephemeral_1h_input_tokens",))
    if split.get("ephemeral_1h_input_tokens"):
        counts[CACHE_WRITE_1H] = split["ephemeral_1h_input_tokens"]
    return counts


def _error(err: Any) -> dict[str, Any]:
    """The type and message of an API error object."""
    err = err if isinstance(err, dict) else {}
    return {"type": err.get("type"), "message": err.get("message")}
