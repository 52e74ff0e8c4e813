"""OpenAI's two event streams: assemble each into its message, or synthesise one.

The stream codec of :class:`recorder.providers.openai.OpenAIFormat`; readers go through
the provider (``assemble``, ``synthesize``, ``message``).

Chat Completions streams ``data: {chunk}`` lines (``chat.completion.chunk`` objects whose
choices carry deltas of the message: content, refusal, tool calls whose ``arguments``
arrive in pieces) and ends with ``data: [DONE]``; with ``stream_options.include_usage`` a
last chunk with no choices carries the usage. :func:`assemble_chat` folds the chunks into
the ``chat.completion`` object the SDK's ``get_final_completion()`` builds, and
:func:`synthesize_chat` writes the chunks that deliver a completion.

The Responses API streams typed events (``event: response.created`` and its ``data``):
the response's lifecycle (``response.created``, ``response.in_progress``,
``response.completed`` / ``incomplete`` / ``failed``, each with the whole response), its
output items (``response.output_item.added`` / ``done``), a message's content parts and
text deltas, a function call's argument deltas, and ``error``. :func:`assemble_responses`
gives the final response (the terminal event's, else one rebuilt from the items);
:func:`synthesize_responses` writes the events of a response in the order the SDK's
``responses.stream()`` checks, numbered by ``sequence_number``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from recorder import _fastjson
from recorder.providers.base import data_lines, sse_events, string_spans

__all__ = ["assemble_chat", "assemble_responses", "is_responses", "stream_pieces",
           "synthesize_chat", "synthesize_responses"]

_TERMINAL = ("response.completed", "response.incomplete", "response.failed")
_LIFECYCLE = ("response.created", "response.queued", "response.in_progress", *_TERMINAL)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def is_responses(text: str) -> bool:
    """Is this event stream a Responses API stream (rather than Chat Completions chunks)?"""
    head = text[:4096]
    return "event: response." in head or '"type":"response.' in head \
        or '"type": "response.' in head


# ------------------------------------------------------------------ Chat Completions


def assemble_chat(text: str) -> dict[str, Any]:
    """The ``chat.completion`` a recorded chunk stream delivers (an ``error`` chunk is
    kept as ``error``)."""
    completion: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    calls: dict[int, dict[int, dict[str, Any]]] = {}
    read = _fastjson.parts_reader(text)
    for _, data in sse_events(text):
        if data.startswith("[DONE]"):
            break
        try:
            doc = read(data)
        except (ValueError, RecursionError):
            continue
        if not isinstance(doc, dict):
            continue
        if "error" in doc and "choices" not in doc:
            completion["error"] = doc["error"]
            continue
        for key, value in doc.items():
            if key not in ("choices", "object", "usage", "obfuscation"):
                completion.setdefault(key, value)
        if doc.get("usage") is not None:
            completion["usage"] = doc["usage"]
        for choice in doc.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            into = choices.setdefault(index, {"index": index, "message": {"role": "assistant"},
                                              "logprobs": None, "finish_reason": None})
            _fold_delta(into["message"], calls.setdefault(index, {}), choice.get("delta") or {})
            if choice.get("finish_reason") is not None:
                into["finish_reason"] = choice["finish_reason"]
            if choice.get("logprobs") is not None:
                into["logprobs"] = choice["logprobs"]
    for index, choice in choices.items():
        message = choice["message"]
        message.setdefault("content", None)
        message.setdefault("refusal", None)
        if calls[index]:
            message["tool_calls"] = [calls[index][i] for i in sorted(calls[index])]
    completion["object"] = "chat.completion"
    completion["choices"] = [choices[i] for i in sorted(choices)]
    completion.setdefault("usage", None)
    return completion


def _fold_delta(message: dict[str, Any], calls: dict[int, dict[str, Any]],
                delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        if key == "tool_calls":
            for part in value or []:
                call = calls.setdefault(part.get("index", len(calls)),
                                        {"id": None, "type": "function",
                                         "function": {"name": "", "arguments": ""}})
                if part.get("id"):
                    call["id"] = part["id"]
                if part.get("type"):
                    call["type"] = part["type"]
                fn = part.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
        elif key in ("content", "refusal") and isinstance(value, str):
            message[key] = (message.get(key) or "") + value
        elif value is not None:
            message[key] = value


def synthesize_chat(completion: dict[str, Any]) -> str:
    """A complete chunk stream that delivers ``completion``: per choice a role chunk, its
    content, each tool call (id and name, then its arguments) and its finish reason; the
    usage in a last chunk of its own (as ``include_usage`` asks), then ``[DONE]``."""
    head = {k: v for k, v in completion.items() if k not in ("choices", "object", "usage")}
    head["object"] = "chat.completion.chunk"
    out: list[str] = []

    def emit(index: int, delta: dict[str, Any], finish: Any = None) -> None:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        out.append(f"data: {_json({**head, 'choices': [choice]})}\n\n")

    for choice in completion.get("choices") or []:
        index = choice.get("index", 0)
        message = choice.get("message") or {}
        extra = {k: v for k, v in message.items()
                 if k not in ("role", "content", "refusal", "tool_calls")}
        opening = "" if isinstance(message.get("content"), str) else None
        emit(index, {"role": message.get("role", "assistant"), "content": opening,
                     "refusal": None, **extra})
        if message.get("content"):
            emit(index, {"content": message["content"]})
        if message.get("refusal"):
            emit(index, {"refusal": message["refusal"]})
        for n, call in enumerate(message.get("tool_calls") or []):
            fn = call.get("function") or {}
            emit(index, {"tool_calls": [{"index": n, "id": call.get("id"),
                                         "type": call.get("type", "function"),
                                         "function": {"name": fn.get("name", ""),
                                                      "arguments": ""}}]})
            if fn.get("arguments"):
                emit(index, {"tool_calls": [{"index": n,
                                             "function": {"arguments": fn["arguments"]}}]})
        emit(index, {}, choice.get("finish_reason") or "stop")
    if completion.get("usage") is not None:
        out.append(f"data: {_json({**head, 'choices': [], 'usage': completion['usage']})}\n\n")
    out.append("data: [DONE]\n\n")
    return "".join(out)


# ------------------------------------------------------------------ the Responses API


def assemble_responses(text: str) -> dict[str, Any]:
    """The response a recorded Responses stream delivers: the one its terminal event
    carries, else (a stream cut short) the last lifecycle response with the output items
    seen so far; an ``error`` event is kept as ``error``."""
    response: dict[str, Any] = {}
    items: dict[int, dict[str, Any]] = {}
    error: Any = None
    read = _fastjson.parts_reader(text)
    for event, data in sse_events(text):
        try:
            doc = read(data)
        except (ValueError, RecursionError):
            continue
        if not isinstance(doc, dict):
            continue
        kind = doc.get("type", event)
        if kind in _LIFECYCLE and isinstance(doc.get("response"), dict):
            response = copy.deepcopy(doc["response"])
            if kind in _TERMINAL and response.get("output"):
                items = {}
        elif kind in ("response.output_item.added", "response.output_item.done"):
            items[doc.get("output_index", len(items))] = copy.deepcopy(doc.get("item") or {})
        elif kind == "response.content_part.added":
            item = items.get(_index(doc))
            if item is not None:
                item.setdefault("content", []).append(copy.deepcopy(doc.get("part") or {}))
        elif kind == "response.output_text.delta":
            part = _part(items, doc)
            if part is not None:
                part["text"] = part.get("text", "") + str(doc.get("delta", ""))
        elif kind == "response.function_call_arguments.delta":
            item = items.get(_index(doc))
            if item is not None:
                item["arguments"] = item.get("arguments", "") + str(doc.get("delta", ""))
        elif kind == "error":
            error = {k: v for k, v in doc.items() if k not in ("type", "sequence_number")}
    if items and not response.get("output"):
        response["output"] = [items[i] for i in sorted(items)]
    if error is not None:
        response["error"] = error
    return response


def _index(doc: dict[str, Any]) -> int:
    index = doc.get("output_index")
    return index if isinstance(index, int) else -1


def _part(items: dict[int, dict[str, Any]], doc: dict[str, Any]) -> dict[str, Any] | None:
    item = items.get(_index(doc))
    content = item.get("content") if item is not None else None
    index = doc.get("content_index", 0)
    if isinstance(content, list) and isinstance(index, int) and 0 <= index < len(content):
        part = content[index]
        return part if isinstance(part, dict) else None
    return None


def synthesize_responses(response: dict[str, Any]) -> str:
    """A complete Responses event stream that delivers ``response``: created and in
    progress (with no output yet), each output item added, filled in and done, then the
    terminal event its status names with the whole response."""
    out: list[str] = []

    def emit(kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": len(out), **fields}
        out.append(f"event: {kind}\ndata: {_json(data)}\n\n")

    opening = {**response, "status": "in_progress", "output": [], "usage": None,
               "incomplete_details": None, "error": None}
    emit("response.created", response=opening)
    emit("response.in_progress", response=opening)
    for index, item in enumerate(response.get("output") or []):
        _emit_item(emit, index, item)
    status = response.get("status") or "completed"
    terminal = {"incomplete": "response.incomplete",
                "failed": "response.failed"}.get(status, "response.completed")
    emit(terminal, response=response)
    return "".join(out)


def _emit_item(emit: Any, index: int, item: dict[str, Any]) -> None:
    kind, item_id = item.get("type"), item.get("id")
    if kind == "message":
        emit("response.output_item.added", output_index=index,
             item={**item, "status": "in_progress", "content": []})
        for n, part in enumerate(item.get("content") or []):
            streamed = part.get("type") == "output_text"
            empty = {**part, "text": ""} if streamed else part
            emit("response.content_part.added", item_id=item_id, output_index=index,
                 content_index=n, part=empty)
            if streamed:
                text = part.get("text", "")
                emit("response.output_text.delta", item_id=item_id, output_index=index,
                     content_index=n, delta=text, logprobs=[])
                emit("response.output_text.done", item_id=item_id, output_index=index,
                     content_index=n, text=text, logprobs=[])
            emit("response.content_part.done", item_id=item_id, output_index=index,
                 content_index=n, part=part)
    elif kind == "function_call":
        emit("response.output_item.added", output_index=index,
             item={**item, "status": "in_progress", "arguments": ""})
        arguments = item.get("arguments", "")
        emit("response.function_call_arguments.delta", item_id=item_id, output_index=index,
             delta=arguments)
        emit("response.function_call_arguments.done", item_id=item_id, output_index=index,
             arguments=arguments, name=item.get("name"))
    else:
        emit("response.output_item.added", output_index=index, item=item)
    emit("response.output_item.done", output_index=index, item=item)


# ------------------------------------------------------------------ pieces, for redaction

# Responses events whose ``delta`` is a piece of a value, and what names that value.
_PIECES = {"response.output_text.delta": ("output_index", "content_index"),
           "response.refusal.delta": ("output_index", "content_index"),
           "response.function_call_arguments.delta": ("output_index",),
           "response.custom_tool_call_input.delta": ("output_index",),
           "response.reasoning_text.delta": ("output_index", "content_index"),
           "response.reasoning_summary_text.delta": ("output_index", "summary_index")}
# Chat Completions delta fields that arrive in pieces (a choice's text, its refusal, the
# reasoning some compatible servers stream).
_CHAT_TEXT = ("content", "refusal", "reasoning_content", "reasoning")


def stream_pieces(body: bytes) -> list[list[tuple[int, int]]]:
    """For each value a Chat Completions or Responses stream sends in pieces (a choice's
    content, a tool call's arguments, an output item's text), the byte spans of its
    pieces in ``body``. A line that does not read as expected is left out."""
    chat = b"chat.completion.chunk" in body
    if not chat and b".delta" not in body:
        return []
    values: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    for offset, line in data_lines(body):
        if chat and b'"choices"' in line:
            found = _chat_pieces(line)
        elif not chat and b'.delta"' in line:
            found = _responses_pieces(line)
        else:
            continue
        for name, (start, end) in found:
            values.setdefault(name, []).append((offset + start, offset + end))
    return list(values.values())


def _doc(line: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):  # nested too deep: no pieces read
        return None
    return doc if isinstance(doc, dict) else None


def _chat_pieces(line: bytes) -> list[tuple[tuple[Any, ...], tuple[int, int]]]:
    doc = _doc(line)
    if doc is None or not isinstance(doc.get("choices"), list):
        return []
    by_key: dict[str, list[tuple[tuple[Any, ...], str]]] = {}
    for choice in doc["choices"]:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            continue
        index = choice.get("index", 0)
        for key in _CHAT_TEXT:
            if isinstance(delta.get(key), str):
                by_key.setdefault(key, []).append(((key, index), delta[key]))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                by_key.setdefault("arguments", []).append(
                    (("arguments", index, call.get("index", 0)), fn["arguments"]))
    out = []
    for key, named in by_key.items():
        spans = string_spans(line, key, [value for _, value in named])
        if spans is not None:
            out += [(name, span) for (name, _), span in zip(named, spans, strict=True)]
    return out


def _responses_pieces(line: bytes) -> list[tuple[tuple[Any, ...], tuple[int, int]]]:
    doc = _doc(line)
    if doc is None or doc.get("type") not in _PIECES or not isinstance(doc.get("delta"), str):
        return []
    name = (doc["type"], *(doc.get(k) for k in _PIECES[doc["type"]]))
    spans = string_spans(line, "delta", [doc["delta"]])
    return [(name, spans[0])] if spans else []
