"""What the stub server (:mod:`recorder.testing.server`) sends to an OpenAI request.

The stub answers ``POST /v1/chat/completions`` and ``POST /v1/responses`` from the same
scripts as the Messages API (:mod:`recorder.testing.script`), chosen by the same rules
(:mod:`recorder.testing.match` reads OpenAI conversations too). A turn's parts become
OpenAI's wire format:

- ``text`` is the assistant message's content (a Responses ``message`` output item);
  ``tool_use`` entries are ``tool_calls`` (``function_call`` output items), their
  ``input`` sent as the JSON text of ``arguments``; ``thinking`` is not sent.
- ``stop_reason`` is read in either vocabulary (``end_turn`` is ``stop``, ``max_tokens``
  is ``length``, ``tool_use`` is ``tool_calls``); for the Responses API ``max_tokens`` or
  ``length`` makes the response ``incomplete`` (``max_output_tokens``).
- ``usage`` is given in deja's names; ``cache_read_input_tokens`` become the cached prompt
  tokens (``prompt_tokens_details.cached_tokens``, ``input_tokens_details.cached_tokens``),
  counted inside the prompt tokens as OpenAI counts them.
- A recorded Anthropic ``message`` (or ``sse`` stream) is sent as its text and tool calls;
  an ``sse`` body that is already an OpenAI stream is sent verbatim to a streaming request.
  A recorded OpenAI ``message`` (a ``chat.completion``, a Responses ``response``) is sent as
  it is to a JSON request of its own API, and as its text, tool calls (with their ids),
  usage and stop reason otherwise.
- Errors (``error``, ``sse_error``) keep their keys and retry headers; the body is OpenAI's
  ``{"error": {"message", "type", "param", "code"}}``, and a stream cut by ``sse_error`` ends
  with an error chunk (Chat Completions) or an ``error`` event (Responses).

Streams: Chat Completions sends ``data: {chunk}`` lines (text a few words a chunk, tool
arguments in pieces), a last chunk with the usage when ``stream_options.include_usage`` is
set, then ``data: [DONE]``. The Responses API sends typed events, ``response.created``
through ``response.completed`` with the whole response and its usage. Standard library and
the stub's own modules only: this is an implementation of the format independent of the
recorder's.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from recorder.testing.events import compact_json, read_events
from recorder.testing.match import RESPONSE_ID_PREFIX, last_user_text, position
from recorder.testing.reply import random_id

__all__ = ["CHAT", "RESPONSES", "OpenAIReply", "default_message", "error_body", "error_type",
           "validate"]

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"

_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
           "tool_use": "tool_calls", "pause_turn": "stop", "refusal": "content_filter"}
_INCOMPLETE = {"max_tokens": "max_output_tokens", "length": "max_output_tokens",
               "max_output_tokens": "max_output_tokens", "content_filter": "content_filter",
               "refusal": "content_filter"}


def validate(api: str, body: dict) -> str | None:
    """An error message like OpenAI's for a malformed request (None: it is well formed)."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "you must provide a model parameter"
    if api == CHAT and not isinstance(body.get("messages"), list):
        return "Missing required parameter: 'messages'."
    if api == RESPONSES and not isinstance(body.get("input", ""), str | list):
        return "Invalid type for 'input': expected a string or an array of input items."
    return None


def error_type(status: int) -> str:
    """The ``type`` OpenAI's error body has for a status."""
    if status == 429:
        return "requests"
    return "server_error" if status >= 500 else "invalid_request_error"


def default_message(status: int) -> str:
    """The message of an error a script gives none for."""
    if status == 429:
        return "Rate limit reached for requests. Please try again later."
    if status >= 500:
        return "The server had an error while processing your request. Sorry about that!"
    return "Invalid request."


_CODES = {401: "invalid_api_key", 404: "not_found", 429: "rate_limit_exceeded"}


def error_body(status: int, error_type: str, message: str) -> dict:
    return {"error": {"message": message, "type": error_type, "param": None,
                      "code": _CODES.get(status, error_type if status >= 500 else None)}}


def _words(text: str) -> list[str]:
    pieces = re.split(r"(?<=\s)(?=\S)", text)
    return ["".join(pieces[i:i + 3]) for i in range(0, len(pieces), 3)] if text else []


def _thirds(raw: str) -> list[str]:
    a, b = len(raw) // 3, 2 * len(raw) // 3
    return [p for p in (raw[:a], raw[a:b], raw[b:]) if p] or [raw]


def _parts_of(message: dict) -> dict:
    """A recorded Anthropic message as turn parts: its text, tool uses, stop and usage."""
    blocks = [b for b in message.get("content") or [] if isinstance(b, dict)]
    parts: dict[str, Any] = {"usage": message.get("usage") or {},
                             "stop_reason": message.get("stop_reason")}
    texts = [str(b.get("text", "")) for b in blocks if b.get("type") == "text"]
    if texts:
        parts["text"] = "".join(texts)
    parts["tool_use"] = [{"id": b.get("id"), "name": b.get("name"), "input": b.get("input")}
                         for b in blocks if b.get("type") == "tool_use"]
    return parts


def _api_of(message: dict) -> str | None:
    """The OpenAI API a recorded message object is an answer of (None: a Messages API one)."""
    if "content" in message:
        return None
    if isinstance(message.get("choices"), list):
        return CHAT
    return RESPONSES if isinstance(message.get("output"), list) else None


def _arguments(text: Any) -> Any:
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return {"arguments": text}
    return value if isinstance(value, dict) else {"arguments": value}


def _openai_usage(usage: Any) -> dict:
    """An OpenAI usage object in the script's names (cached tokens apart from the input)."""
    if not isinstance(usage, dict):
        return {}
    chat = "prompt_tokens" in usage
    prompt = usage.get("prompt_tokens" if chat else "input_tokens")
    output = usage.get("completion_tokens" if chat else "output_tokens")
    details = usage.get("prompt_tokens_details" if chat else "input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if isinstance(cached, int) else 0
    out = {"cache_read_input_tokens": cached}
    if isinstance(prompt, int):
        out["input_tokens"] = max(0, prompt - cached)
    if isinstance(output, int):
        out["output_tokens"] = output
    return out


def _openai_parts(message: dict) -> dict:
    """A recorded chat completion or Responses response as turn parts: its text, tool calls
    (by their ids), usage and stop reason."""
    texts: list[str] = []
    tools: list[dict] = []
    stop: Any = None
    if _api_of(message) == CHAT:
        choice = message["choices"][0] if message["choices"] else {}
        inner = (choice.get("message") if isinstance(choice, dict) else None) or {}
        if isinstance(inner.get("content"), str):
            texts.append(inner["content"])
        for call in inner.get("tool_calls") or []:
            fn = call.get("function") or {}
            tools.append({"id": call.get("id"), "name": fn.get("name"),
                          "input": _arguments(fn.get("arguments"))})
        stop = choice.get("finish_reason") if isinstance(choice, dict) else None
    else:
        for item in message["output"]:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "message":
                texts += [str(p.get("text", "")) for p in item.get("content") or []
                          if isinstance(p, dict) and p.get("type") == "output_text"]
            elif item.get("type") == "function_call":
                tools.append({"id": item.get("call_id"), "name": item.get("name"),
                              "input": _arguments(item.get("arguments"))})
        details = message.get("incomplete_details") or {}
        stop = details.get("reason") if message.get("status") == "incomplete" else None
    parts: dict[str, Any] = {"usage": _openai_usage(message.get("usage")),
                             "stop_reason": stop, "tool_use": tools}
    if texts:
        parts["text"] = "".join(texts)
    return parts


class OpenAIReply:
    """A successful answer to an OpenAI request, as one JSON object or its stream."""

    def __init__(self, api: str, turn: dict, body: dict, script_model: str | None) -> None:
        self.api, self.body = api, body
        self.raw_stream: str | None = None
        self.recorded: dict | None = None  # a recorded OpenAI message, sent as it is
        if "sse" in turn:
            if "event: message_start" not in turn["sse"]:
                self.raw_stream = turn["sse"]  # an OpenAI stream as recorded
                turn = {}
            else:
                turn = _parts_of(read_events(turn["sse"]))
        elif "message" in turn:
            recorded_api = _api_of(turn["message"])
            if recorded_api == api and body.get("stream") is not True:
                self.recorded = turn["message"]
            turn = _parts_of(turn["message"]) if recorded_api is None else \
                _openai_parts(turn["message"])
        echo = last_user_text(body)
        self.text: str | None = turn["text"].replace("{echo}", echo) if "text" in turn else None
        tools = turn.get("tool_use") or []
        self.tools = [tools] if isinstance(tools, dict) else list(tools)
        self.model = body.get("model") or script_model or "gpt-stub"
        self.created = int(time.time())
        given = turn.get("stop_reason")
        self.stop = given or ("tool_use" if self.tools else "end_turn")
        usage = turn.get("usage") or {}
        out_text = (self.text or "") + "".join(t["name"] + compact_json(t.get("input") or {})
                                               for t in self.tools)
        self.cached = usage.get("cache_read_input_tokens", 0)
        self.input = usage.get("input_tokens", self._rough_input()) + self.cached
        self.output = usage.get("output_tokens", max(1, len(out_text) // 4))
        self.calls = [{"id": t.get("id") or random_id("call_"), "name": t["name"],
                       "arguments": compact_json(t.get("input") or {})} for t in self.tools]

    def _rough_input(self) -> int:
        text = compact_json([self.body.get(k) for k in ("messages", "input", "instructions",
                                                       "tools")])
        return max(1, len(text) // 4)

    # -- Chat Completions

    def _chat_usage(self) -> dict:
        return {"prompt_tokens": self.input, "completion_tokens": self.output,
                "total_tokens": self.input + self.output,
                "prompt_tokens_details": {"cached_tokens": self.cached, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                              "accepted_prediction_tokens": 0,
                                              "rejected_prediction_tokens": 0}}

    def _finish(self) -> str:
        return _FINISH.get(self.stop, self.stop)

    def _head(self, kind: str) -> dict:
        if not hasattr(self, "_id"):
            self._id = random_id("chatcmpl-", 29)
        return {"id": self._id, "object": kind, "created": self.created, "model": self.model,
                "service_tier": "default", "system_fingerprint": "fp_deja_stub"}

    def _tool_calls(self) -> list[dict]:
        return [{"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self.calls]

    def chat(self) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": self.text, "refusal": None,
                                   "annotations": []}
        if self.calls:
            message["tool_calls"] = self._tool_calls()
        return {**self._head("chat.completion"),
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": self._finish()}],
                "usage": self._chat_usage()}

    def chat_chunks(self) -> list[bytes]:
        usage_asked = (self.body.get("stream_options") or {}).get("include_usage") is True
        head = self._head("chat.completion.chunk")
        if usage_asked:
            head["usage"] = None
        out: list[bytes] = []

        def emit(delta: dict, finish: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            out.append(f"data: {compact_json({**head, 'choices': [choice]})}\n\n".encode())

        emit({"role": "assistant", "content": "", "refusal": None})
        for piece in _words(self.text or ""):
            emit({"content": piece})
        for n, call in enumerate(self.calls):
            emit({"tool_calls": [{"index": n, "id": call["id"], "type": "function",
                                  "function": {"name": call["name"], "arguments": ""}}]})
            for piece in _thirds(call["arguments"]):
                emit({"tool_calls": [{"index": n, "function": {"arguments": piece}}]})
        emit({}, self._finish())
        if usage_asked:
            last = {**head, "choices": [], "usage": self._chat_usage()}
            out.append(f"data: {compact_json(last)}\n\n".encode())
        out.append(b"data: [DONE]\n\n")
        return out

    # -- the Responses API

    def _response_usage(self) -> dict:
        return {"input_tokens": self.input, "input_tokens_details": {"cached_tokens": self.cached},
                "output_tokens": self.output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input + self.output}

    def _output(self) -> list[dict]:
        items: list[dict] = []
        if self.text is not None:
            items.append({"id": random_id("msg_", 32), "type": "message", "status": "completed",
                          "role": "assistant",
                          "content": [{"type": "output_text", "text": self.text,
                                       "annotations": [], "logprobs": []}]})
        items.extend({"id": random_id("fc_", 32), "type": "function_call",
                      "status": "completed", "call_id": c["id"], "name": c["name"],
                      "arguments": c["arguments"]} for c in self.calls)
        return items

    def response(self) -> dict:
        if not hasattr(self, "_response"):
            reason = _INCOMPLETE.get(self.stop)
            b = self.body
            self._response = {
                "id": f"{RESPONSE_ID_PREFIX}{position(b)}_{random_id('', 32)}",
                "object": "response", "created_at": self.created,
                "status": "incomplete" if reason else "completed",
                "background": False, "error": None,
                "incomplete_details": {"reason": reason} if reason else None,
                "instructions": b.get("instructions"),
                "max_output_tokens": b.get("max_output_tokens"), "metadata": {},
                "model": self.model, "output": self._output(),
                "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "previous_response_id": b.get("previous_response_id"),
                "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
                "store": b.get("store", True), "temperature": b.get("temperature", 1.0),
                "text": {"format": {"type": "text"}}, "tool_choice": b.get("tool_choice", "auto"),
                "tools": b.get("tools", []), "top_p": b.get("top_p", 1.0),
                "truncation": "disabled", "usage": self._response_usage(), "user": None}
        return self._response

    def response_events(self) -> list[bytes]:
        final = self.response()
        out: list[bytes] = []

        def emit(kind: str, **fields: Any) -> None:
            data = {"type": kind, "sequence_number": len(out), **fields}
            out.append(f"event: {kind}\ndata: {compact_json(data)}\n\n".encode())

        opening = {**final, "status": "in_progress", "incomplete_details": None, "output": [],
                   "usage": None}
        emit("response.created", response=opening)
        emit("response.in_progress", response=opening)
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "content": []})
                part = item["content"][0]
                emit("response.content_part.added", item_id=item["id"], output_index=index,
                     content_index=0, part={**part, "text": ""})
                for piece in _words(part["text"]):
                    emit("response.output_text.delta", item_id=item["id"],
                         output_index=index, content_index=0, delta=piece, logprobs=[])
                emit("response.output_text.done", item_id=item["id"], output_index=index,
                     content_index=0, text=part["text"], logprobs=[])
                emit("response.content_part.done", item_id=item["id"], output_index=index,
                     content_index=0, part=part)
            else:
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "arguments": ""})
                for piece in _thirds(item["arguments"]):
                    emit("response.function_call_arguments.delta", item_id=item["id"],
                         output_index=index, delta=piece)
                emit("response.function_call_arguments.done", item_id=item["id"],
                     output_index=index, name=item["name"], arguments=item["arguments"])
            emit("response.output_item.done", output_index=index, item=item)
        emit("response.incomplete" if final["status"] == "incomplete" else "response.completed",
             response=final)
        return out

    # -- what the server asks

    def message(self) -> dict:
        """The JSON body of a non-streaming answer."""
        if self.recorded is not None:
            return self.recorded
        return self.chat() if self.api == CHAT else self.response()

    def event_bytes(self) -> list[bytes]:
        """The events of a streaming answer, each encoded."""
        if self.raw_stream is not None:
            return [p.encode() for p in re.split(r"(?<=\n\n)", self.raw_stream) if p]
        return self.chat_chunks() if self.api == CHAT else self.response_events()

    def stream_error(self, events: list[bytes], err: dict) -> list[bytes]:
        """``events`` cut after ``after_events`` by the error an ``sse_error`` turn sends."""
        cut = events[:min(err.get("after_events", 0), len(events))]
        status = err.get("status", 500)
        kind = err.get("type") or error_type(status)
        message = err.get("message") or default_message(status)
        if self.api == CHAT:
            data = compact_json(error_body(status, kind, message))
            return [*cut, f"data: {data}\n\n".encode()]
        event = {"type": "error", "code": kind, "message": message, "param": None,
                 "sequence_number": len(cut)}
        return [*cut, f"event: error\ndata: {compact_json(event)}\n\n".encode()]
