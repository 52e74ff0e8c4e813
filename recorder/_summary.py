"""What a model response says, read once it is complete: id, usage, stop reason, text.

Works on a JSON body or on the verbatim SSE event stream of the Anthropic Messages API
(``message_start`` carries the id and input usage, ``message_delta`` the stop reason and
output usage) and on OpenAI chat completions. Never raises: an unreadable body gives an
empty summary, since the body itself is stored exactly either way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def sse_events(text: str) -> Iterator[tuple[str, str]]:
    """(event, data) pairs of a text/event-stream body."""
    for block in text.replace("\r\n", "\n").split("\n\n"):
        event, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if data:
            yield event, "\n".join(data)


def summarize(provider: str, status: int, content_type: str, body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return {}
    try:
        if "event-stream" in content_type:
            return _from_sse(text)
        doc = json.loads(text) if text else None
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    if status >= 400 or doc.get("type") == "error":
        err = doc.get("error") if isinstance(doc.get("error"), dict) else {}
        return {"error": {"type": err.get("type"), "message": err.get("message")}}
    if provider == "openai":
        usage = doc.get("usage") or {}
        choice = (doc.get("choices") or [{}])[0]
        return {"message_id": doc.get("id"), "model": doc.get("model"),
                "stop_reason": choice.get("finish_reason"),
                "usage": _usage({"input_tokens": usage.get("prompt_tokens", 0),
                                 "output_tokens": usage.get("completion_tokens", 0)})}
    return {"message_id": doc.get("id"), "model": doc.get("model"),
            "stop_reason": doc.get("stop_reason"), "usage": _usage(doc.get("usage"))}


def _usage(u: Any) -> dict[str, int]:
    if not isinstance(u, dict):
        return {}
    keys = ("input_tokens", "output_tokens", "cache_creation_input_tokens",
            "cache_read_input_tokens")
    # Counts only: a body is whatever the upstream sent, and a count that is no
    # non-negative 64-bit integer (a string, true, 10**30) is no count at all.
    return {k: u[k] for k in keys if type(u.get(k)) is int and 0 <= u[k] < 2**63}


def _from_sse(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"usage": {}}
    for event, data in sse_events(text):
        try:
            doc = json.loads(data)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        kind = doc.get("type", event)
        if kind == "message_start":
            msg = doc.get("message") or {}
            out["message_id"] = msg.get("id")
            out["model"] = msg.get("model")
            out["usage"].update(_usage(msg.get("usage")))
        elif kind == "message_delta":
            delta = doc.get("delta") or {}
            if delta.get("stop_reason"):
                out["stop_reason"] = delta["stop_reason"]
            out["usage"].update(_usage(doc.get("usage")))
        elif kind == "error":
            err = doc.get("error") or {}
            out["error"] = {"type": err.get("type"), "message": err.get("message")}
    return out
