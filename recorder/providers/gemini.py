"""Google's Gemini API (``POST .../models/{model}:generateContent`` and
``:streamGenerateContent``) as deja reads and writes it.

The endpoints are known by their path's ending, whatever the host and version: the
Gemini Developer API (``generativelanguage.googleapis.com/v1beta/models/...``) and Vertex
AI (``.../publishers/google/models/...``) speak the same format. The model is named in
the URL, not in the body (:meth:`GeminiCarriage.request_model`), and so is streaming
(``:streamGenerateContent``, with ``?alt=sse`` for the event stream the SDK asks for).

A request holds its conversation in ``contents`` (turns of role ``user`` or ``model``,
each a list of ``parts``: ``text``, ``functionCall``, ``functionResponse``,
``inlineData`` ...), which a cassette stores as what each request adds
(:meth:`GeminiFormat.history_field`); ``systemInstruction``, ``tools`` and
``generationConfig`` (``maxOutputTokens``) are its settings. A response is one
``GenerateContentResponse`` (``candidates``, ``usageMetadata``, ``modelVersion``,
``responseId``), or the stream of chunks that deliver it, folded into it by
:mod:`recorder.providers._gemini_stream`.

Usage is read into deja's names, so that one price table prices every provider the same
way. Gemini counts context-cache hits inside its prompt count
(``cachedContentTokenCount`` within ``promptTokenCount``): deja's ``input_tokens`` leaves
them out and counts them as ``cache_read_input_tokens``, and adds the tokens of a tool's
own prompt (``toolUsePromptTokenCount``), which Gemini counts apart and bills as input.
``output_tokens`` are the candidates' tokens and the thinking tokens
(``thoughtsTokenCount``), which are billed as output. The stop reason is the first
candidate's ``finishReason`` (``STOP``, ``MAX_TOKENS``, ``SAFETY``, ...; a function call
ends with ``STOP`` too), or the ``promptFeedback.blockReason`` of a prompt refused whole.

Read as a conversation (:meth:`GeminiFormat.conversation`), a ``model`` turn is the
assistant's, a ``functionCall`` part a ``tool_use`` block (its ``args`` the input), a
``functionResponse`` part a ``tool_result`` (its ``response`` the content), a thought
(``"thought": true``) a ``thinking`` block, and an image part an ``image`` block; the
``systemInstruction`` is the system prompt. Gemini pairs a result with its call by the
function's name, and by an ``id`` only when the model gave one: a call's block id (and a
result's ``tool_use_id``) is that id, else the function's name.

The API key travels in the ``x-goog-api-key`` header or a ``key=`` query parameter; both
are secrets by name (:mod:`recorder.capture.redact`), and a key's ``AIza`` shape is one
anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from recorder.providers._gemini_stream import assemble, fold, stream_pieces, synthesize
from recorder.providers.base import (
    VOLATILE_HEADERS,
    Carriage,
    Conversation,
    Format,
    Provider,
    Summary,
    token_counts,
)

__all__ = ["GeminiCarriage", "GeminiFormat", "model_of_url", "normalized_usage", "provider"]

STREAM = ":streamGenerateContent"
GENERATE = ":generateContent"
_USAGE = ("promptTokenCount", "candidatesTokenCount", "cachedContentTokenCount",
          "thoughtsTokenCount", "toolUsePromptTokenCount")


def normalized_usage(meta: Any) -> dict[str, int]:
    """A ``usageMetadata`` object in deja's names (see the module docstring)."""
    counts = token_counts(meta, _USAGE)
    if not counts:
        return {}
    out: dict[str, int] = {}
    cached = counts.get("cachedContentTokenCount")
    if "promptTokenCount" in counts or "toolUsePromptTokenCount" in counts:
        out["input_tokens"] = (max(0, counts.get("promptTokenCount", 0) - (cached or 0))
                               + counts.get("toolUsePromptTokenCount", 0))
    if "candidatesTokenCount" in counts or "thoughtsTokenCount" in counts:
        out["output_tokens"] = (counts.get("candidatesTokenCount", 0)
                                + counts.get("thoughtsTokenCount", 0))
    if cached is not None:
        out["cache_read_input_tokens"] = cached
    return token_counts(out)


def model_of_url(url: str) -> str | None:
    """The model a Gemini endpoint's URL names (``.../models/gemini-2.5-flash:generateContent``
    names ``gemini-2.5-flash``); None when it names none."""
    path = urlsplit(url).path.rstrip("/")
    head, colon, _ = path.rpartition(":")
    at = head.rfind("/models/")
    if not colon or at < 0:
        return None
    return head[at + len("/models/"):] or None


def provider() -> Provider:
    """Gemini's format over Google's endpoints."""
    return Provider("gemini", GeminiFormat(), GeminiCarriage())


class GeminiCarriage(Carriage):
    """``generateContent`` and ``streamGenerateContent`` at any host and version, the
    model and streaming named in the URL."""

    def __init__(self) -> None:
        # The SDK reads GOOGLE_API_KEY first and GEMINI_API_KEY else (and warns when both
        # are set): one placeholder, in the variable the Gemini documentation names, is
        # enough. x-goog-api-client is the SDK's telemetry (its version and Python's), like
        # the x-stainless- headers.
        super().__init__((GENERATE, STREAM), key_env=("GEMINI_API_KEY", "GOOGLE_API_KEY"),
                         base_url_env={"GOOGLE_GEMINI_BASE_URL": ""},
                         volatile_headers=VOLATILE_HEADERS | {"x-goog-api-client"})

    def request_model(self, url: str) -> str | None:
        return model_of_url(url)

    def request_streams(self, url: str) -> bool | None:
        return urlsplit(url).path.rstrip("/").endswith(STREAM)


class GeminiFormat(Format):
    # a response's id and (on Vertex AI) its creation time differ between any two runs
    volatile_message_keys: tuple[str, ...] = ("id", "responseId", "createTime")
    answer_meta_keys: tuple[str, ...] = ("usageMetadata", "modelVersion")

    # -- requests

    def history_field(self, body: Any) -> str | None:
        if isinstance(body, dict) and isinstance(body.get("contents"), list):
            return "contents"
        return None

    def is_request_id(self, holder: str | None, obj: Mapping[str, Any], key: str) -> bool:
        """The ``id`` of a ``functionCall`` and of the ``functionResponse`` that answers
        it (when the model gave one)."""
        return key == "id" and holder in ("functionCall", "functionResponse")

    def request_model(self, body: Any) -> Any:
        """None: the body does not name the model (its URL does)."""
        return None

    def request_max_tokens(self, body: Any) -> Any:
        config = body.get("generationConfig") if isinstance(body, dict) else None
        return config.get("maxOutputTokens") if isinstance(config, dict) else None

    def with_max_tokens(self, body: dict[str, Any], limit: int) -> dict[str, Any]:
        config = body.get("generationConfig")
        config = config if isinstance(config, dict) else {}
        return {**body, "generationConfig": {**config, "maxOutputTokens": limit}}

    # -- responses

    def stream_pieces(self, text: bytes) -> list[list[tuple[int, int]]]:
        return stream_pieces(text)

    def assemble(self, text: str) -> dict[str, Any]:
        return assemble(text)

    def synthesize(self, message: dict[str, Any]) -> str:
        return synthesize(message)

    def from_json(self, doc: Any) -> Any:
        """A response; the chunks of a stream asked for without ``alt=sse`` (a JSON array)
        folded into one."""
        return fold(doc) if isinstance(doc, list) else doc

    def usage(self, message: Any) -> dict[str, int]:
        return normalized_usage(message.get("usageMetadata")) if isinstance(message, dict) \
            else {}

    def stop_reason(self, message: Any) -> Any:
        if not isinstance(message, dict):
            return None
        candidates = message.get("candidates")
        first = candidates[0] if isinstance(candidates, list) and candidates else None
        if isinstance(first, dict) and first.get("finishReason") is not None:
            return first["finishReason"]
        feedback = message.get("promptFeedback")
        return feedback.get("blockReason") if isinstance(feedback, dict) else None

    def tool_result_slots(self, body: Any) -> list[tuple[dict[str, Any], str]]:
        """Each ``functionResponse`` part's ``response``, in ``contents`` order. (A reply
        that calls functions ends with ``STOP``, as one that does not: its
        ``functionCall`` parts say it, so :meth:`turn_unfinished` is the default's.)"""
        contents = body.get("contents") if isinstance(body, dict) else None
        slots: list[tuple[dict[str, Any], str]] = []
        for content in contents if isinstance(contents, list) else ():
            parts = content.get("parts") if isinstance(content, dict) else None
            for part in parts if isinstance(parts, list) else ():
                if not isinstance(part, dict) or isinstance(part.get("text"), str) \
                        or isinstance(part.get("functionCall"), dict):
                    continue  # read as text, or as a call (see _part)
                if isinstance(part.get("functionResponse"), dict):
                    slots.append((part["functionResponse"], "response"))
        return slots

    def summarize_json(self, status: int, doc: Any) -> Summary:
        return self._summary(status, self.from_json(doc))

    def summarize_stream(self, text: str) -> Summary:
        return self._summary(200, assemble(text))

    def _summary(self, status: int, message: Any) -> Summary:
        """What a response says; a stream cut by an error says what came before it too."""
        if not isinstance(message, dict):
            return {}
        error = message.get("error")
        if status >= 400 or (isinstance(error, dict) and "candidates" not in message):
            return {"error": _error(error)}
        out: Summary = {"message_id": message.get("responseId"),
                        "model": message.get("modelVersion"),
                        "stop_reason": self.stop_reason(message), "usage": self.usage(message)}
        if isinstance(error, dict):
            out["error"] = _error(error)
        return out

    def conversation(self, request: Any, message: Any = None) -> Conversation:
        body = request if isinstance(request, dict) else {}
        contents = body.get("contents")
        return {"system": _system(body.get("systemInstruction")),
                "messages": [_turn(c) for c in contents if isinstance(c, dict)]
                if isinstance(contents, list) else [],
                "reply": _reply(message) if isinstance(message, dict) else None,
                "settings": {k: v for k, v in body.items()
                             if k not in ("contents", "systemInstruction")}}


# ------------------------------------------------------------------ as a conversation


def _rest(obj: dict[str, Any], used: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in used}


def _image(part: dict[str, Any], key: str) -> dict[str, Any] | None:
    """An ``inlineData`` or ``fileData`` image part as an image block (None: no image)."""
    data = part.get(key)
    if not isinstance(data, dict) or not str(data.get("mimeType", "")).startswith("image/"):
        return None
    source = ({"type": "base64", "media_type": data.get("mimeType"), "data": data.get("data")}
              if key == "inlineData" else {"type": "url", "url": data.get("fileUri")})
    return {"type": "image", "source": source, **_rest(part, (key,))}


def _part(part: Any) -> Any:
    """One part as a deja block (a part of any other kind as it is)."""
    if not isinstance(part, dict):
        return part
    if isinstance(part.get("text"), str):
        if part.get("thought"):
            return {"type": "thinking", "thinking": part["text"],
                    **_rest(part, ("text", "thought"))}
        return {"type": "text", "text": part["text"], **_rest(part, ("text",))}
    call = part.get("functionCall")
    if isinstance(call, dict):
        return {"type": "tool_use", "id": call.get("id") or call.get("name"),
                "name": call.get("name"),
                "input": call.get("args", {}), **_rest(call, ("id", "name", "args")),
                **_rest(part, ("functionCall",))}
    result = part.get("functionResponse")
    if isinstance(result, dict):
        return {"type": "tool_result", "tool_use_id": result.get("id") or result.get("name"),
                "name": result.get("name"), "content": result.get("response"),
                **_rest(result, ("id", "name", "response")),
                **_rest(part, ("functionResponse",))}
    return _image(part, "inlineData") or _image(part, "fileData") or part


def _blocks(content: Any) -> list[Any]:
    parts = content.get("parts") if isinstance(content, dict) else None
    return [_part(p) for p in parts] if isinstance(parts, list) else []


def _turn(content: dict[str, Any]) -> dict[str, Any]:
    """A ``contents`` entry as a turn: ``model`` is the assistant."""
    role = content.get("role")
    return {"role": "assistant" if role == "model" else role, "content": _blocks(content),
            **_rest(content, ("role", "parts"))}


def _system(instruction: Any) -> Any:
    """The system instruction: its text when it is one text part, else its blocks."""
    if not isinstance(instruction, dict):
        return instruction
    blocks = _blocks(instruction)
    if len(blocks) == 1 and isinstance(blocks[0], dict) and set(blocks[0]) == {"type", "text"}:
        return blocks[0]["text"]
    return blocks


def _reply(response: dict[str, Any]) -> dict[str, Any]:
    """A response as one assistant turn: its first candidate's parts, with the
    candidate's and the response's own fields; further candidates as they are."""
    candidates = response.get("candidates")
    candidates = candidates if isinstance(candidates, list) else []
    first = candidates[0] if candidates and isinstance(candidates[0], dict) else {}
    out = {**_rest(response, ("candidates",)), **_rest(first, ("content", "index")),
           "role": "assistant", "content": _blocks(first.get("content"))}
    if len(candidates) > 1:
        out["candidates"] = candidates[1:]
    return out


def _error(err: Any) -> dict[str, Any]:
    """The status (or code) and message of a Google API error object."""
    err = err if isinstance(err, dict) else {}
    kind = err.get("status") or err.get("code")
    return {"type": kind, "message": err.get("message")}

