"""OpenAI's Chat Completions (``POST /v1/chat/completions``) and Responses
(``POST /v1/responses``) APIs as deja reads and writes them.

Any server that speaks these endpoints is read the same way, whatever its host: an
OpenAI-compatible base URL (a local model server, a gateway) records and replays like the
official one.

A response is one JSON object (a ``chat.completion``, or a ``response``), or the verbatim
event stream of a streamed call: Chat Completions chunks ending ``data: [DONE]``, whose
usage comes in a last chunk when the request sets ``stream_options.include_usage``; or
the Responses API's typed events, whose ``response.completed`` carries the whole response
and its usage. Assembling and synthesising both streams live in
:mod:`recorder.providers._openai_sse`.

Read as a conversation (:meth:`OpenAIFormat.conversation`), either API's call is in
deja's shape: a Chat Completions message keeps its role (``system``, ``developer``,
``user``, ``assistant``, ``tool``), its ``tool_calls`` become ``tool_use`` blocks with
parsed arguments and a ``role: tool`` message a ``tool_result``; a Responses call's
``instructions`` are the system prompt and each ``input`` item one turn
(``function_call`` a ``tool_use``, ``function_call_output`` a ``tool_result``), and its
``output`` items are the reply's blocks.

Either API's request resends its conversation every turn: Chat Completions' as
``messages``, a Responses call's as its ``input`` items
(:meth:`OpenAIFormat.history_field`). A cassette stores such a request as the items it
adds to an earlier one.

Usage is read into deja's names, so that one price table prices every provider the same
way: OpenAI counts cached prompt tokens inside its input count
(``prompt_tokens_details.cached_tokens``, ``input_tokens_details.cached_tokens``), deja's
``input_tokens`` leaves them out and counts them as ``cache_read_input_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from recorder import _fastjson
from recorder.providers._openai_sse import (
    assemble_chat,
    assemble_responses,
    is_responses,
    stream_pieces,
    synthesize_chat,
    synthesize_responses,
)
from recorder.providers.base import (
    Carriage,
    Conversation,
    Format,
    Provider,
    Summary,
    sse_events,
    token_counts,
)

__all__ = ["OpenAIFormat", "normalized_usage", "provider"]

# The request fields that cap a call's output tokens, by API, in the order they win.
_MAX_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
# Responses stream events a summary reads; every other named event is content.
_SUMMARY_EVENTS = frozenset({"response.created", "response.queued", "response.in_progress",
                             "response.completed", "response.incomplete", "response.failed",
                             "error"})


def _count(value: Any) -> int | None:
    return value if type(value) is int and 0 <= value < 2**63 else None


def normalized_usage(usage: Any) -> dict[str, int]:
    """A Chat Completions or Responses ``usage`` object in deja's names: ``input_tokens``
    without the cached prompt tokens, which are ``cache_read_input_tokens``."""
    if not isinstance(usage, dict):
        return {}
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        prompt, output = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
    else:
        prompt, output = usage.get("input_tokens"), usage.get("output_tokens")
        details = usage.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    out: dict[str, Any] = {"output_tokens": output}
    prompt = _count(prompt)
    if prompt is not None:
        out["input_tokens"] = max(0, prompt - (cached or 0))
    if cached is not None:
        out["cache_read_input_tokens"] = cached
    return token_counts(out)


def _is_response(message: Any) -> bool:
    return isinstance(message, dict) and "choices" not in message and (
        message.get("object") == "response" or "output" in message)


def provider() -> Provider:
    """Both APIs' format over OpenAI's endpoints, at any host (a compatible server too)."""
    return Provider("openai", OpenAIFormat(),
                    Carriage(("/v1/chat/completions", "/v1/responses"),
                             key_env=("OPENAI_API_KEY",),
                             base_url_env={"OPENAI_BASE_URL": "/v1"}))


class OpenAIFormat(Format):
    # a completion's creation time differs between any two runs, like its id
    volatile_message_keys: tuple[str, ...] = ("id", "created", "created_at")
    # and its serving tier and system fingerprint say how it was served
    answer_meta_keys: tuple[str, ...] = ("usage", "model", "service_tier",
                                         "system_fingerprint")

    # -- requests

    def request_max_tokens(self, body: Any) -> Any:
        if not isinstance(body, dict):
            return None
        return next((body[k] for k in _MAX_TOKEN_FIELDS if body.get(k) is not None), None)

    def with_max_tokens(self, body: dict[str, Any], limit: int) -> dict[str, Any]:
        field = next((k for k in _MAX_TOKEN_FIELDS if body.get(k) is not None),
                     "max_output_tokens" if "input" in body and "messages" not in body
                     else "max_completion_tokens")
        return {**body, field: limit}

    def volatile_request_fields(self) -> tuple[str, ...]:
        """Who the end user is (``user``, and ``safety_identifier``, which replaces it),
        the key a request's prompt cache is kept under (``prompt_cache_key``), and the
        ``cache_control`` markers a compatible gateway passes on to Claude: none changes
        what the model is asked."""
        return ("/user", "/safety_identifier", "/prompt_cache_key", "/**/cache_control")

    def is_request_id(self, holder: str | None, obj: Mapping[str, Any], key: str) -> bool:
        """A chat message's ``tool_calls[].id`` and ``tool_call_id``; a Responses item's
        ``call_id``, and the ``id`` of an item the program sends back (``fc_...``,
        ``msg_...``: the server mints them in every run)."""
        if key in ("tool_call_id", "call_id"):
            return True
        return key == "id" and (holder == "tool_calls" or (
            holder == "input" and isinstance(obj.get("type"), str)))

    def history_field(self, body: Any) -> str | None:
        """Chat Completions' ``messages``, or a Responses request's ``input`` items (an
        ``input`` that is one string is no list: that request is stored whole)."""
        if isinstance(body, dict) and "messages" not in body:
            return "input" if isinstance(body.get("input"), list) else None
        return super().history_field(body)

    # -- responses

    def stream_pieces(self, text: bytes) -> list[list[tuple[int, int]]]:
        return stream_pieces(text)

    def assemble(self, text: str) -> dict[str, Any]:
        return assemble_responses(text) if is_responses(text) else assemble_chat(text)

    def synthesize(self, message: dict[str, Any]) -> str:
        return synthesize_responses(message) if _is_response(message) else synthesize_chat(message)

    def conversation(self, request: Any, message: Any = None) -> Conversation:
        body = request if isinstance(request, dict) else {}
        # Chat Completions; a reply read without its request is known by its own shape
        if "messages" in body or ("input" not in body and not _is_response(message)):
            messages = body.get("messages")
            return {"system": None,
                    "messages": [_chat_turn(m) for m in messages if isinstance(m, dict)]
                    if isinstance(messages, list) else [],
                    "reply": _chat_reply(message) if isinstance(message, dict) else None,
                    "settings": {k: v for k, v in body.items() if k != "messages"}}
        items = body.get("input")
        turns = ([{"role": "user", "content": items}] if isinstance(items, str) else
                 [_item_turn(i) for i in items if isinstance(i, dict)]
                 if isinstance(items, list) else [])
        return {"system": body.get("instructions"), "messages": turns,
                "reply": _responses_reply(message) if isinstance(message, dict) else None,
                "settings": {k: v for k, v in body.items() if k not in ("input", "instructions")}}

    def turn_unfinished(self, stop_reason: Any) -> bool:
        """A chat completion that asks for tool calls (``tool_calls``, or the older
        ``function_call``). A Responses reply says ``completed`` either way: its
        ``function_call`` items say it."""
        return stop_reason in ("tool_calls", "function_call")

    def tool_result_slots(self, body: Any) -> list[tuple[dict[str, Any], str]]:
        """A ``role: tool`` message's ``content``, a ``function_call_output`` item's
        ``output`` (and a ``tool_result`` part's ``content``, as the conversation reads
        one in a message), in order."""
        if not isinstance(body, dict):
            return []
        chat = "messages" in body or "input" not in body
        items = body.get("messages" if chat else "input")
        slots: list[tuple[dict[str, Any], str]] = []
        for item in items if isinstance(items, list) else ():
            if not isinstance(item, dict):
                continue
            if chat and item.get("role") == "tool":
                slots.append((item, "content"))
            elif not chat and item.get("type") == "function_call_output":
                slots.append((item, "output"))
            elif isinstance(item.get("content"), list) and (chat or "role" in item):
                slots.extend((part, "content") for part in item["content"]
                             if isinstance(part, dict) and part.get("type") == "tool_result")
        return slots

    def usage(self, message: Any) -> dict[str, int]:
        return normalized_usage(message.get("usage")) if isinstance(message, dict) else {}

    def stop_reason(self, message: Any) -> Any:
        if not isinstance(message, dict):
            return None
        if "choices" in message:  # a chat completion: its first choice's finish reason
            choices = message.get("choices") or [{}]
            return choices[0].get("finish_reason") if isinstance(choices[0], dict) else None
        status = message.get("status")
        details = message.get("incomplete_details")
        if status == "incomplete" and isinstance(details, dict) and details.get("reason"):
            return details["reason"]  # "max_output_tokens", "content_filter"
        return status

    def summarize_json(self, status: int, doc: Any) -> Summary:
        if not isinstance(doc, dict):
            return {}
        if status >= 400 or (isinstance(doc.get("error"), dict) and "choices" not in doc
                             and "output" not in doc):
            return {"error": _error(doc.get("error"))}
        return {"message_id": doc.get("id"), "model": doc.get("model"),
                "stop_reason": self.stop_reason(doc), "usage": self.usage(doc)}

    def summarize_stream(self, text: str) -> Summary:
        """Read chunk by chunk (event by event), so that a stream cut short still says
        what it said."""
        if is_responses(text):
            return self._from_responses_stream(text)
        usage: dict[str, int] = {}
        out: Summary = {"usage": usage}
        first = True
        for _, data in sse_events(text):
            if data.startswith("[DONE]"):
                break
            if not (first or _may_summarize(data)):
                continue  # content: nothing the summary reads (and cheaper not to parse)
            try:
                doc = _fastjson.loads_text(data)
            except (ValueError, RecursionError):  # nested too deep: says nothing
                continue
            if not isinstance(doc, dict):
                continue
            if "error" in doc and "choices" not in doc:
                out["error"] = _error(doc["error"])
                continue
            if first:
                out["message_id"], out["model"], first = doc.get("id"), doc.get("model"), False
            for choice in doc.get("choices") or []:
                if (isinstance(choice, dict) and choice.get("index", 0) == 0
                        and choice.get("finish_reason") is not None):
                    out["stop_reason"] = choice["finish_reason"]
            if doc.get("usage") is not None:
                usage.update(normalized_usage(doc["usage"]))
        return out

    def _from_responses_stream(self, text: str) -> Summary:
        out: Summary = {"usage": {}}
        for event, data in sse_events(text):
            if event != "message" and event not in _SUMMARY_EVENTS:
                continue
            try:
                doc = _fastjson.loads_text(data)
            except (ValueError, RecursionError):  # nested too deep: says nothing
                continue
            if not isinstance(doc, dict):
                continue
            kind = doc.get("type", event)
            response = doc.get("response")
            if kind == "error":
                out["error"] = {"type": doc.get("code") or kind, "message": doc.get("message")}
            elif kind in _SUMMARY_EVENTS and isinstance(response, dict):
                out["message_id"] = response.get("id")
                out["model"] = response.get("model")
                out["stop_reason"] = self.stop_reason(response)
                if response.get("usage") is not None:
                    out["usage"] = self.usage(response)
        return out


# ------------------------------------------------------------------ as a conversation

# Fields of a Responses item that differ between any two runs, or that its turn says.
_ITEM_NOISE = frozenset({"id", "type", "status"})


def _rest(obj: dict[str, Any], used: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in used}


def _arguments(text: Any) -> Any:
    """A tool call's ``arguments`` (JSON text) as the value it spells; the text itself
    when it spells none."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _image_source(url: Any) -> dict[str, Any]:
    """An image URL as a Messages API image source (a ``data:`` URL: base64 bytes)."""
    if isinstance(url, str) and url.startswith("data:") and ";base64," in url:
        media_type, _, data = url[5:].partition(";base64,")
        return {"type": "base64", "media_type": media_type or None, "data": data}
    return {"type": "url", "url": url}


def _part(part: Any) -> Any:
    """One content part of either API as a deja block (any other part as it is)."""
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text"):
        return {"type": "text", "text": part.get("text"), **_rest(part, ("type", "text"))}
    if kind == "image_url" and isinstance(part.get("image_url"), dict):
        image = part["image_url"]
        return {"type": "image", "source": _image_source(image.get("url")),
                **_rest(image, ("url",)), **_rest(part, ("type", "image_url"))}
    if kind == "input_image" and part.get("image_url") is not None:
        return {"type": "image", "source": _image_source(part["image_url"]),
                **_rest(part, ("type", "image_url"))}
    return part


def _content(content: Any) -> Any:
    """Message content: a string stays one, a list of parts becomes blocks."""
    if isinstance(content, list):
        return [_part(p) for p in content]
    return content


def _tool_use(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": _arguments(arguments)}


def _chat_turn(message: dict[str, Any]) -> dict[str, Any]:
    """A Chat Completions message as a turn: ``tool_calls`` as ``tool_use`` blocks, a
    ``role: tool`` message as a ``tool_result``."""
    role = message.get("role")
    content = _content(message.get("content"))
    if role == "tool":
        block = {"type": "tool_result", "tool_use_id": message.get("tool_call_id"),
                 "content": content}
        return {"role": "tool", "content": [block],
                **_rest(message, ("role", "content", "tool_call_id"))}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        blocks = ([{"type": "text", "text": content}] if isinstance(content, str) and content
                  else list(content) if isinstance(content, list) else [])
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                blocks.append(_tool_use(call.get("id"), fn.get("name"), fn.get("arguments")))
            else:
                blocks.append(call)
        content = blocks
    return {"role": role, "content": content,
            **_rest(message, ("role", "content", "tool_calls"))}


def _chat_reply(completion: dict[str, Any]) -> dict[str, Any]:
    """A chat completion as one turn: its first choice's message, with the choice's finish
    reason and the completion's own fields; further choices as they are."""
    choices = completion.get("choices")
    choices = choices if isinstance(choices, list) else []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    inner = first.get("message")
    inner = inner if isinstance(inner, dict) else {}
    turn = _chat_turn({"role": "assistant", **inner})
    content = turn["content"]
    if isinstance(content, str):
        turn["content"] = [{"type": "text", "text": content}] if content else []
    elif content is None:
        turn["content"] = []
    out = {**_rest(completion, ("choices",)), **turn,
           **_rest(first, ("index", "message"))}
    if len(choices) > 1:
        out["choices"] = choices[1:]
    return out


def _item_blocks(item: dict[str, Any]) -> tuple[str, list[Any]]:
    """A Responses input or output item as (role, blocks)."""
    kind = item.get("type")
    if kind == "function_call":
        block = _tool_use(item.get("call_id"), item.get("name"), item.get("arguments"))
        return "assistant", [{**block, **_rest(item, (*_ITEM_NOISE, "call_id", "name",
                                                      "arguments"))}]
    if kind == "function_call_output":
        return "tool", [{"type": "tool_result", "tool_use_id": item.get("call_id"),
                         "content": _content(item.get("output")),
                         **_rest(item, (*_ITEM_NOISE, "call_id", "output"))}]
    if kind == "reasoning":
        summary = item.get("summary")
        summary = summary if isinstance(summary, list) else []
        text = "\n\n".join(str(s.get("text", "")) for s in summary if isinstance(s, dict))
        return "assistant", [{"type": "thinking", "thinking": text}]
    other = _rest(item, ("id",))
    return ("tool" if str(kind).endswith("_output") else "assistant"), [other]


def _item_turn(item: dict[str, Any]) -> dict[str, Any]:
    """A Responses input item as a turn: a message by its role, a function call the
    assistant's ``tool_use``, its output the ``tool`` turn's ``tool_result``."""
    if "role" in item and item.get("type", "message") == "message":
        return {"role": item.get("role"), "content": _content(item.get("content")),
                **_rest(item, (*_ITEM_NOISE, "role", "content"))}
    role, blocks = _item_blocks(item)
    return {"role": role, "content": blocks}


def _responses_reply(response: dict[str, Any]) -> dict[str, Any]:
    """A Responses response as one assistant turn: its output items' blocks in order (a
    message's text, a function call's ``tool_use``), with the response's own fields."""
    blocks: list[Any] = []
    output = response.get("output")
    for item in output if isinstance(output, list) else []:
        if not isinstance(item, dict):
            blocks.append(item)
        elif item.get("type", "message") == "message" and "content" in item:
            content = _content(item.get("content"))
            blocks.extend(content if isinstance(content, list) else
                          [{"type": "text", "text": content}] if content else [])
        else:
            blocks.extend(_item_blocks(item)[1])
    return {**_rest(response, ("output",)), "role": "assistant", "content": blocks}


def _may_summarize(data: str) -> bool:
    """Can this chunk carry a finish reason, usage or an error? A content chunk says
    ``"finish_reason":null`` and, at most, ``"usage":null``; one that holds none of the
    names (nor a \\u escape, which could spell one) is skipped unparsed."""
    if "\\u" in data or "error" in data:
        return True
    if "finish_reason" in data and '"finish_reason":null' not in data \
            and '"finish_reason": null' not in data:
        return True
    return "usage" in data and '"usage":null' not in data and '"usage": null' not in data


def _error(err: Any) -> dict[str, Any]:
    """The type (or code) and message of an API error object."""
    err = err if isinstance(err, dict) else {}
    return {"type": err.get("type") or err.get("code"), "message": err.get("message")}
