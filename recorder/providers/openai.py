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

Usage is read into deja's names, so that one price table prices every provider the same
way: OpenAI counts cached prompt tokens inside its input count
(``prompt_tokens_details.cached_tokens``, ``input_tokens_details.cached_tokens``), deja's
``input_tokens`` leaves them out and counts them as ``cache_read_input_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

from recorder.providers import Headers, Provider, Summary, sse_events, token_counts
from recorder.providers._openai_sse import (
    assemble_chat,
    assemble_responses,
    is_responses,
    synthesize_chat,
    synthesize_responses,
)

__all__ = ["OpenAIProvider", "normalized_usage"]

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


class OpenAIProvider(Provider):
    name: str = "openai"
    endpoints: tuple[str, ...] = ("/v1/chat/completions", "/v1/responses")
    # a completion's creation time differs between any two runs, like its id
    volatile_message_keys: tuple[str, ...] = ("id", "created", "created_at")

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

    # -- responses

    def assemble(self, text: str) -> dict[str, Any]:
        return assemble_responses(text) if is_responses(text) else assemble_chat(text)

    def synthesize(self, message: dict[str, Any]) -> str:
        return synthesize_responses(message) if _is_response(message) else synthesize_chat(message)

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

    def summarize(self, status: int, headers: Headers, body: bytes) -> Summary:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            return {}
        try:
            if self.is_stream(headers):
                return self._from_stream(text)
            doc = json.loads(text) if text else None
        except ValueError:
            return {}
        return self._from_json(status, doc)

    def summarize_parsed(self, status: int, headers: Headers, body: bytes, doc: Any) -> Summary:
        if self.is_stream(headers):
            return self.summarize(status, headers, body)
        return self._from_json(status, doc)

    def _from_json(self, status: int, doc: Any) -> Summary:
        if not isinstance(doc, dict):
            return {}
        if status >= 400 or (isinstance(doc.get("error"), dict) and "choices" not in doc
                             and "output" not in doc):
            return {"error": _error(doc.get("error"))}
        return {"message_id": doc.get("id"), "model": doc.get("model"),
                "stop_reason": self.stop_reason(doc), "usage": self.usage(doc)}

    def _from_stream(self, text: str) -> Summary:
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
                doc = json.loads(data)
            except ValueError:
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
                doc = json.loads(data)
            except ValueError:
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
