"""What a step says, made readable: a model call as a conversation, a tool call with its
result, images as bytes; and the plain text of a step, which the index searches.

A model step is shown as its full request (system prompt and messages: text, images,
tool calls and results, thinking) followed by the response message, assembled from the
event stream when the call was streamed; its provider reads it as a conversation, so an
OpenAI Chat Completions or Responses call is shown like an Anthropic one. Payloads
longer than :data:`LIMIT` characters are cut (:class:`Clip` notes it, so that a page can
offer the whole text); base64 image data never appears as text: images become decoded
bytes, and raw JSON shows a short placeholder in their place.

Nothing here imports streamlit: the page lays these structures out, and tests read them.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from recorder import providers
from recorder.canonical import decode_body
from recorder.capture.mcp.calls import is_server_request
from recorder.cassette.schema import Kind
from recorder.providers import conversation as shape
from recorder.providers.conversation import BlockKind
from recorder.values import decode

LIMIT = 100_000  # characters of one payload shown before it is cut
_SEARCH_BODY_LIMIT = 1_000_000  # characters of an HTTP body kept for text search

Block = dict[str, Any]


class Clip:
    """Cuts strings longer than ``limit`` (None: never) and remembers that it did."""

    def __init__(self, limit: int | None = LIMIT) -> None:
        self.limit = limit
        self.truncated = False

    def text(self, value: str) -> str:
        if self.limit is None or len(value) <= self.limit:
            return value
        self.truncated = True
        return (value[:self.limit]
                + f"\n… [{len(value) - self.limit:,} more characters not shown]")

    def value(self, value: Any) -> Any:
        """``value`` with long strings cut and base64 payloads replaced by a placeholder."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1 and isinstance(value.get("$bytes"), str):  # a recorded bytes value
            return f"<{_b64_size(value['$bytes']):,} bytes>"
        if value.get("type") == "base64" and isinstance(value.get("data"), str):
            size = _b64_size(value["data"])
            return {**{k: self.value(v) for k, v in value.items() if k != "data"},
                    "data": f"<{value.get('media_type', 'data')} base64, {size:,} bytes>"}
        return {k: self.value(v) for k, v in value.items()}


def _b64_size(data: str) -> int:
    return len(data) * 3 // 4 - data.count("=", max(0, len(data) - 2))


def image_type(data: bytes) -> str | None:
    """The media type of image bytes, from their signature (None: not an image)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


# ---------------------------------------------------------------------- message blocks


def _image_block(block: Any) -> Block:
    source = shape.image(block)
    if source.source_type == "base64":
        try:
            data = base64.b64decode(source.data or "", validate=True)
        except (binascii.Error, ValueError) as exc:
            return {"type": BlockKind.IMAGE, "error": f"undecodable base64 image: {exc}"}
        return {"type": BlockKind.IMAGE, "media_type": source.media_type or image_type(data),
                "data": data, "size": len(data)}
    if source.source_type == "url":
        return {"type": BlockKind.IMAGE, "url": source.url}
    return {"type": BlockKind.IMAGE, "error": f"image source of type {source.source_type!r}"}


def blocks(content: Any, clip: Clip) -> list[Block]:
    """Message content (a string or a list of content blocks, read as
    :mod:`recorder.providers.conversation` reads them) as blocks to lay out; each block's
    ``type`` is a :class:`~recorder.providers.conversation.BlockKind` (a tool the API ran
    itself is laid out as a tool call or result too)."""
    if content is not None and not isinstance(content, str | list):
        return [{"type": BlockKind.OTHER, "label": type(content).__name__,
                 "raw": clip.value(content)}]
    return [_layout(block, clip) for block in shape.as_blocks(content)]


def _layout(block: Any, clip: Clip) -> Block:
    """One block of a message to lay out."""
    what = shape.kind(block)
    if what in (BlockKind.TEXT, BlockKind.THINKING):
        return {"type": what, "text": clip.text(shape.text(block))}
    if what is BlockKind.REDACTED_THINKING:
        return {"type": BlockKind.THINKING, "text": "(redacted thinking)", "redacted": True}
    if what in (BlockKind.TOOL_USE, BlockKind.SERVER_TOOL_USE):
        call = shape.tool_call(block)
        return {"type": BlockKind.TOOL_USE, "id": call.id, "name": call.name,
                "input": clip.value(call.input)}
    if what in (BlockKind.TOOL_RESULT, BlockKind.SERVER_TOOL_RESULT):
        result = shape.tool_result(block)
        return {"type": BlockKind.TOOL_RESULT, "tool_use_id": result.tool_use_id,
                "name": result.name, "is_error": result.is_error,
                "blocks": blocks(result.content, clip)}
    if what is BlockKind.IMAGE:
        return _image_block(block)
    label = shape.type_name(block) or type(block).__name__
    return {"type": BlockKind.OTHER, "label": label, "raw": clip.value(block)}


# ---------------------------------------------------------------------- responses


def is_streamed(obs: Mapping[str, Any]) -> bool:
    """Was the response of step ``obs`` a stream (by its provider's rule)?"""
    headers = (obs.get("response") or {}).get("headers") or []
    return providers.for_line(obs).is_stream(headers)


def body_text(response: dict[str, Any]) -> str | None:
    """The response body as text; None when it is not text (stored as base64, not UTF-8)."""
    data = decode_body(response.get("body", ""), response.get("encoding"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def response_message(obs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The message a model step answered with: parsed JSON, or assembled from its stream."""
    response = obs.get("response")
    if not response:
        return None
    data = decode_body(response.get("body", ""), response.get("encoding"))
    try:  # bytes: a stream's framing may be binary (Bedrock's event stream)
        doc = providers.for_line(obs).message(response.get("headers") or [], data)
    except ValueError:
        text = body_text(response)
        if text is None:
            return {"error": {"type": "binary_body", "message": "the body is not text"}}
        return {"error": {"type": "not_json", "message": text[:500]}}
    return doc if isinstance(doc, dict) else {"content": doc}


def _named_results(items: list[Block], names: dict[str, Any]) -> list[Block]:
    """Tool results with the name of the call they answer (OpenAI's results carry none)."""
    for block in items:
        if block["type"] == BlockKind.TOOL_USE and block.get("id") is not None:
            names[str(block["id"])] = block.get("name")
        elif block["type"] == BlockKind.TOOL_RESULT and block.get("name") is None:
            block["name"] = names.get(str(block.get("tool_use_id")))
    return items


def conversation(request: Any, obs: Mapping[str, Any], clip: Clip,
                 keep: int | None = None) -> dict[str, Any]:
    """A model step as a conversation: ``system``, the request's ``turns``, the ``response``.

    Read through the step's provider (:meth:`recorder.providers.Provider.conversation`),
    so an OpenAI call reads like an Anthropic one: who said what, tool calls with their
    arguments, tool results. The messages before ``keep`` (by default, those the stored
    request shares with an earlier step's) were in an earlier call; the rest are new.
    """
    body = request if isinstance(request, dict) else {}
    if keep is None:
        request_field = obs.get("request")
        stored = request_field if isinstance(request_field, dict) else {}
        keep = stored.get("keep", 0) if "base" in stored else 0
    provider = providers.for_line(obs)
    message = response_message(obs)
    conv = provider.conversation(body, message)
    system = blocks(shape.system(conv), clip)
    names: dict[str, Any] = {}
    messages: list[dict[str, Any]] = []
    for i, turn in enumerate(shape.turns(conv)):
        role = shape.role(turn) or "user"
        content = _named_results(blocks(shape.blocks(turn), clip), names)
        if role in ("system", "developer") and not messages and not system:
            system += content  # a system prompt kept in the messages (OpenAI's)
            continue
        messages.append({"role": role, "blocks": content, "new": i >= keep})
    response = None
    if message is not None:
        reply = shape.reply(conv)
        error = message.get("error")
        response = {"role": shape.role(reply) or "assistant",
                    "blocks": _named_results(blocks(shape.blocks(reply), clip), names),
                    "stop_reason": provider.stop_reason(message),
                    "usage": provider.usage(message) or None,
                    "model": message.get("model"),
                    "error": error if isinstance(error, dict) else None,
                    "status": (obs.get("response") or {}).get("status"),
                    "streamed": is_streamed(obs)}
    return {"model": body.get("model") or obs.get("model"), "system": system,
            "turns": messages, "response": response, "error": obs.get("error")}


def tool_call(obs: Mapping[str, Any], clip: Clip) -> dict[str, Any]:
    """A tool (or intent/outcome) step: its name, arguments and result or error; another
    request to an MCP server (an ``mcp`` step) as its method, params and result."""
    if obs.get("kind") == Kind.MCP:
        name, args = (obs.get("mcp") or {}).get("method"), obs.get("params")
    else:
        name, args = obs.get("name"), obs.get("args")
    out: dict[str, Any] = {"name": name, "args": clip.value(args), "images": []}
    if "error" in obs:
        out["error"] = obs["error"]
    elif "result" in obs:
        result = decode(obs.get("result"))
        if isinstance(result, (bytes, bytearray)):
            kind = image_type(bytes(result))
            if kind:
                out["images"].append({"type": "image", "media_type": kind,
                                      "data": bytes(result), "size": len(result)})
            out["result"] = f"<{len(result):,} bytes{', ' + kind if kind else ''}>"
        else:
            out["result"] = clip.value(obs.get("result"))
    return out


def mcp_exchange(obs: Mapping[str, Any], clip: Clip) -> dict[str, Any] | None:
    """An MCP step's own part (None: not one): the server (its name and version, its
    transport, its command or URL), the method, the tool called and whether the server's
    annotations make it destructive, and what the server sent before its answer, in order
    (``exchange``: each a notification, or a request the server made of the client, with
    the client's answer)."""
    part = obs.get("mcp")
    if not isinstance(part, Mapping):
        return None
    server = part.get("server") or {}
    exchange = []
    for note in part.get("notifications") or ():
        entry = {"kind": "request" if is_server_request(note) else "notification",
                 "method": note.get("method"), "params": clip.value(note.get("params"))}
        entry.update({k: clip.value(note[k]) for k in ("result", "error") if k in note})
        exchange.append(entry)
    return {"server": {k: server[k] for k in ("name", "version", "transport", "command",
                                              "url") if server.get(k) is not None},
            "method": part.get("method"),
            "tool": obs.get("name") if obs.get("kind") == Kind.TOOL else None,
            "destructive": part.get("destructive") is True, "exchange": exchange}


def mcp_notes(info: Mapping[str, Any]) -> list[str]:
    """An MCP step's part in words, a line each: the server and its transport, the
    method (and tool), and the messages the server sent before its answer."""
    server = info["server"]
    where = " ".join(server.get("command") or ()) or server.get("url") or "?"
    named = " ".join(str(server[k]) for k in ("name", "version") if k in server) or where
    notes = [f"MCP server {named} ({server.get('transport')}: {where})",
             f"{info['method']}" + (f" of tool {info['tool']}" if info["tool"] else "")
             + (" (destructive)" if info["destructive"] else "")]
    if info["exchange"]:
        notes.append("before its answer the server sent: " + ", ".join(
            f"{e['method']}" + (" (the client answered)" if e["kind"] == "request" else "")
            for e in info["exchange"]))
    return notes


# ---------------------------------------------------------------------- search text


def _block_strings(content: Any, out: list[str]) -> None:
    """The words of content (a string, blocks, a block): text and thinking, a tool call's
    name and input, a tool result's content (a value that is no block, as JSON)."""
    if isinstance(content, list):
        for block in content:
            _block_strings(block, out)
        return
    what = shape.kind(content)
    if what in (BlockKind.TEXT, BlockKind.THINKING):
        out.append(shape.text(content))
    elif what in (BlockKind.TOOL_USE, BlockKind.SERVER_TOOL_USE):
        call = shape.tool_call(content)
        out.extend([call.name or "", _json(call.input)])
    elif what in (BlockKind.TOOL_RESULT, BlockKind.SERVER_TOOL_RESULT):
        result = shape.tool_result(content).content
        if isinstance(result, str | list):
            _block_strings(result, out)
        elif result is not None:
            out.append(_json(result))
    elif isinstance(content, dict):  # a block of another kind: the words it names
        out.extend(v for k in ("text", "name", "arguments")
                   if isinstance(v := content.get(k), str))


def _model_strings(obs: Mapping[str, Any], out: list[str]) -> None:
    """The words of a model step: the system prompt and messages its request adds to the
    conversation (a request stored whole: all of them) and its reply, read through its
    provider's conversation."""
    provider = providers.for_line(obs)
    request_field = obs.get("request")
    stored = request_field if isinstance(request_field, dict) else {}
    body = stored.get("body")
    if not isinstance(body, dict):  # a delta: the items it adds, and the fields it sets
        changed = stored.get("set")
        history = provider.history_field(stored)
        body = {**(changed if isinstance(changed, dict) else {}),
                **({history: stored[history]} if history is not None else {})}
    conv = provider.conversation(body, response_message(obs))
    _block_strings(shape.system(conv), out)
    for turn in shape.turns(conv):
        _block_strings(shape.blocks(turn), out)
    _block_strings(shape.blocks(shape.reply(conv)), out)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _plain(value: Any) -> str:
    value = decode(value)
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return ""
    return json.dumps(_strip_bytes(value), ensure_ascii=False, default=str)


def _strip_bytes(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return None
    if isinstance(value, (list, tuple)):
        return [_strip_bytes(v) for v in value]
    if isinstance(value, dict):
        return {k: _strip_bytes(v) for k, v in value.items()}
    return value


def searchable_text(obs: Mapping[str, Any]) -> str:
    """The words of a step that a text search should find: message text and thinking,
    tool names, inputs and results, effect values, errors; not ids, headers or images.

    A model step contributes the messages its request adds to the conversation (the
    first request: all of them) and its response, assembled from the stream if streamed.
    """
    kind = obs.get("kind")
    out: list[str] = []
    if kind == Kind.MODEL:
        _model_strings(obs, out)
    elif kind == Kind.HTTP:
        out.append(str(obs.get("url", "")))
        request = (obs.get("request") or {}).get("body")
        out.append(request if isinstance(request, str) else _json(request))
        response = obs.get("response")
        if response:
            text = body_text(response)
            if text is not None:
                out.append(text[:_SEARCH_BODY_LIMIT])
    elif kind in (Kind.TOOL, Kind.INTENT, Kind.OUTCOME):
        out.append(str(obs.get("name", "")))
        if obs.get("args") is not None:
            out.append(_plain(obs["args"]))
        if "result" in obs:
            out.append(_plain(obs["result"]))
    elif kind == Kind.EFFECT:
        out.extend([str(obs.get("name", "")), _plain(obs.get("value"))])
    elif kind == Kind.CONTROL:
        out.extend([str(obs.get("event", "")), _json(obs.get("detail"))])
    for key in ("error", "api_error"):
        err = obs.get(key)
        if isinstance(err, dict) and err.get("message"):
            out.append(str(err["message"]))
    return "\n".join(s for s in out if s)
