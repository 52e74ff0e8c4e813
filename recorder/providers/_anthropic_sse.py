"""The Anthropic Messages SSE stream: assemble it into a message, or synthesise one.

The stream codec of :class:`recorder.providers.anthropic.MessagesFormat`; readers go
through the provider (``assemble``, ``synthesize``, ``message``).

``assemble`` turns a recorded event stream into the message the SDK would build from it
(content blocks with text, tool input parsed from ``input_json_delta``, thinking, stop
reason, usage). ``synthesize`` does the reverse for an edited message, producing a valid
stream that the SDK's ``messages.stream()`` and ``create(stream=True)`` accept.
"""

from __future__ import annotations

import json
from typing import Any

from recorder import _fastjson
from recorder.providers.base import sse_events


def assemble(text: str) -> dict[str, Any]:
    message: dict[str, Any] = {}
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, list[str]] = {}
    read = _fastjson.parts_reader(text)
    for event, data in sse_events(text):
        try:
            doc = read(data)
        except (ValueError, RecursionError):
            continue
        kind = doc.get("type", event) if isinstance(doc, dict) else event
        if kind == "message_start":
            message = dict(doc.get("message") or {})
            message["content"] = []
        elif kind == "content_block_start":
            blocks[doc["index"]] = dict(doc.get("content_block") or {})
        elif kind == "content_block_delta":
            block = blocks.setdefault(doc["index"], {})
            delta = doc.get("delta") or {}
            dtype = delta.get("type")
            if dtype == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")
            elif dtype == "input_json_delta":
                partial.setdefault(doc["index"], []).append(delta.get("partial_json", ""))
            elif dtype == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
            elif dtype == "signature_delta":
                block["signature"] = block.get("signature", "") + delta.get("signature", "")
        elif kind == "content_block_stop":
            index = doc["index"]
            if index in partial:
                raw = "".join(partial.pop(index))
                try:
                    blocks[index]["input"] = json.loads(raw) if raw else {}
                except ValueError:
                    blocks[index]["input"] = raw
        elif kind == "message_delta":
            delta = doc.get("delta") or {}
            for key in ("stop_reason", "stop_sequence"):
                if key in delta:
                    message[key] = delta[key]
            usage = dict(message.get("usage") or {})
            usage.update(doc.get("usage") or {})
            message["usage"] = usage
        elif kind == "error":
            message["error"] = doc.get("error")
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return message


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def synthesize(message: dict[str, Any]) -> str:
    """A complete, valid event stream that delivers ``message``."""
    usage = dict(message.get("usage") or {})
    start = {k: v for k, v in message.items() if k not in ("content", "stop_reason",
                                                             "stop_sequence", "usage")}
    start.update(content=[], stop_reason=None, stop_sequence=None,
                 usage={**usage, "output_tokens": min(1, usage.get("output_tokens", 1))})
    out = [_event("message_start", {"type": "message_start", "message": start}),
           _event("ping", {"type": "ping"})]
    for index, block in enumerate(message.get("content") or []):
        btype = block.get("type")
        if btype == "text":
            head = {**block, "text": ""}
            deltas = [{"type": "text_delta", "text": block.get("text", "")}]
        elif btype == "tool_use":
            head = {**block, "input": {}}
            deltas = [{"type": "input_json_delta",
                       "partial_json": json.dumps(block.get("input", {}), ensure_ascii=False)}]
        elif btype == "thinking":
            head = {**block, "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": block.get("thinking", "")},
                      {"type": "signature_delta", "signature": block.get("signature", "")}]
        else:
            head, deltas = block, []
        out.append(_event("content_block_start", {"type": "content_block_start", "index": index,
                                                  "content_block": head}))
        out.extend(_event("content_block_delta", {"type": "content_block_delta",
                                                  "index": index, "delta": d}) for d in deltas)
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
    out.append(_event("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": message.get("stop_reason"),
                  "stop_sequence": message.get("stop_sequence")},
        "usage": {"output_tokens": usage.get("output_tokens", 0)}}))
    out.append(_event("message_stop", {"type": "message_stop"}))
    return "".join(out)
