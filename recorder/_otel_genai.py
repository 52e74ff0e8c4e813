"""A step of a run in the terms of the OpenTelemetry GenAI semantic conventions.

:mod:`recorder.otel` builds the trace; this module says what each span of a step holds:
the conventions' attribute names, a model call's attributes (provider, models, response
id, finish reasons, token usage, server) and a tool call's, an error status for a failed
exchange, an API error or a tool's error, the tool calls a model reply asks for, and the
message content (``gen_ai.input.messages``, ``gen_ai.output.messages``,
``gen_ai.system_instructions``, tool arguments and results) in the conventions' form.

Token usage follows the conventions' rule, which is not Anthropic's wire format:
``gen_ai.usage.input_tokens`` counts every input token, cache reads and writes included
(deja's ``input_tokens + cache_creation_input_tokens + cache_read_input_tokens``; for an
OpenAI call that is its ``prompt_tokens``), and the cache counts are given apart as
``gen_ai.usage.cache_read.input_tokens`` and ``gen_ai.usage.cache_creation.input_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.trace import Status, StatusCode

from recorder import providers, values
from recorder.canonical import content_decoded, decode_body

# The GenAI semantic conventions' names (opentelemetry-semantic-conventions 0.66b2,
# ``opentelemetry.semconv._incubating.attributes.gen_ai_attributes``; a test checks them).
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
AGENT_NAME = "gen_ai.agent.name"
CONVERSATION = "gen_ai.conversation.id"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_PARAMS = {"temperature": "gen_ai.request.temperature",
                  "top_p": "gen_ai.request.top_p", "top_k": "gen_ai.request.top_k"}
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
CACHE_CREATION = "gen_ai.usage.cache_creation.input_tokens"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_TYPE = "gen_ai.tool.type"
TOOL_ARGUMENTS = "gen_ai.tool.call.arguments"
TOOL_RESULT = "gen_ai.tool.call.result"
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"


# ---------------------------------------------------------------------- attributes


def _tokens(usage: Mapping[str, Any] | None) -> dict[str, int]:
    counts = providers.token_counts(usage or {})
    read = counts.get("cache_read_input_tokens", 0)
    written = counts.get("cache_creation_input_tokens", 0)
    out = {INPUT_TOKENS: counts.get("input_tokens", 0) + read + written,
           OUTPUT_TOKENS: counts.get("output_tokens", 0)}
    if "cache_read_input_tokens" in counts:
        out[CACHE_READ] = read
    if "cache_creation_input_tokens" in counts:
        out[CACHE_CREATION] = written
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                           default=str)


def _response(obs: Mapping[str, Any]) -> tuple[Any, str | None]:
    """The message a model line's response holds, and the model it names (None, None
    when the body is not readable)."""
    response = obs.get("response")
    if not isinstance(response, Mapping) or not isinstance(response.get("body"), str):
        return None, None
    headers = [h for h in response.get("headers") or () if h]
    try:
        body = content_decoded(decode_body(response["body"], response.get("encoding")),
                               headers)
        message = providers.for_line(obs).message(headers, body)
    except (ValueError, UnicodeDecodeError):
        return None, None
    model = message.get("model") if isinstance(message, dict) else None
    return message, model if isinstance(model, str) else None


def _model_attributes(obs: Mapping[str, Any], request: Any, content: bool
                      ) -> tuple[dict[str, Any], Status | None]:
    provider = providers.for_line(obs)
    attrs: dict[str, Any] = {OPERATION: "chat", PROVIDER: str(obs.get("provider")
                                                               or provider.name)}
    model = obs.get("model") or provider.request_model(request, obs.get("url") or "")
    if isinstance(model, str):
        attrs[REQUEST_MODEL] = model
    max_tokens = provider.request_max_tokens(request)
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        attrs[REQUEST_MAX_TOKENS] = max_tokens
    if isinstance(request, dict):
        attrs.update({name: request[key] for key, name in REQUEST_PARAMS.items()
                      if isinstance(request.get(key), int | float)
                      and not isinstance(request.get(key), bool)})
    parts = urlsplit(str(obs.get("url") or ""))
    if parts.hostname:
        attrs[SERVER_ADDRESS] = parts.hostname
        if parts.port:
            attrs[SERVER_PORT] = parts.port
    message, response_model = _response(obs)
    if response_model:
        attrs[RESPONSE_MODEL] = response_model
    if isinstance(obs.get("message_id"), str):
        attrs[RESPONSE_ID] = obs["message_id"]
    if isinstance(obs.get("stop_reason"), str):
        attrs[FINISH_REASONS] = [obs["stop_reason"]]
    if isinstance(obs.get("ttft_ms"), int | float):
        attrs[TIME_TO_FIRST_CHUNK] = obs["ttft_ms"] / 1000
    if "response" in obs:
        attrs.update(_tokens(obs.get("usage")))
    if content:
        attrs[INPUT_MESSAGES] = _text(input_messages(request))
        system = system_instructions(request)
        if system:
            attrs[SYSTEM_INSTRUCTIONS] = _text(system)
        if message is not None:
            attrs[OUTPUT_MESSAGES] = _text(output_messages(message, obs.get("stop_reason")))
    if isinstance(obs.get("cost_usd"), int | float):
        attrs["deja.cost_usd"] = obs["cost_usd"]
    return attrs, _model_status(obs, attrs)


def _model_status(obs: Mapping[str, Any], attrs: dict[str, Any]) -> Status | None:
    """An error status for a failed exchange or an API error (its type as ``error.type``)."""
    status = (obs.get("response") or {}).get("status")
    err = obs.get("error") or obs.get("api_error")
    if not err and not (isinstance(status, int) and status >= 400):
        return None
    err = err if isinstance(err, Mapping) else {}
    attrs[ERROR_TYPE] = str(err.get("type") or status or "error")
    return Status(StatusCode.ERROR, str(err.get("message") or f"HTTP {status}"))


def _tool_attributes(obs: Mapping[str, Any], args: Any, call_id: str | None,
                     content: bool) -> tuple[dict[str, Any], Status | None]:
    attrs: dict[str, Any] = {OPERATION: "execute_tool", TOOL_NAME: str(obs.get("name")),
                             TOOL_TYPE: "function"}
    if call_id:
        attrs[TOOL_CALL_ID] = call_id
    if content:
        attrs[TOOL_ARGUMENTS] = _text(values.decode(args))
        if "result" in obs:
            attrs[TOOL_RESULT] = _text(values.decode(obs["result"]))
    err = obs.get("error")
    if isinstance(err, Mapping):
        attrs[ERROR_TYPE] = str(err.get("type") or "error")
        return attrs, Status(StatusCode.ERROR, str(err.get("message") or ""))
    if obs.get("is_error"):
        attrs[ERROR_TYPE] = "tool_error"
        return attrs, Status(StatusCode.ERROR, "the tool reported an error")
    return attrs, None


def _tool_calls(message: Any) -> list[tuple[str, str, Any]]:
    """(id, name, input) of the tool calls a model message asks for (Anthropic's
    ``tool_use`` blocks, OpenAI's ``tool_calls`` and ``function_call`` items)."""
    found: list[tuple[str, str, Any]] = []
    if not isinstance(message, dict):
        return found
    blocks = list(message.get("content") or []) if isinstance(message.get("content"),
                                                              list) else []
    for choice in message.get("choices") or []:
        if isinstance(choice, dict) and isinstance(choice.get("message"), dict):
            blocks.extend(choice["message"].get("tool_calls") or [])
    blocks.extend(message.get("output") or [] if isinstance(message.get("output"), list)
                  else [])
    for block in blocks:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "tool_use":
            found.append((str(block.get("id")), str(block.get("name")), block.get("input")))
        elif block.get("type") in ("function", "function_call"):
            fn = _obj(block.get("function")) or block
            found.append((str(block.get("call_id") or block.get("id")), str(fn.get("name")),
                          _args(fn.get("arguments"))))
    return found


# ---------------------------------------------------------------------- content
#
# Messages in the conventions' form: {"role", "parts": [{"type": "text", "content"},
# {"type": "tool_call", "id", "name", "arguments"}, {"type": "tool_call_response", "id",
# "response"}, {"type": "reasoning", "content"}, ...]}, read from the Anthropic Messages
# API, OpenAI Chat Completions and OpenAI Responses bodies. A block of another type is
# kept as it is, under its own type.


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _part(block: Any) -> dict[str, Any]:
    if isinstance(block, str):
        return {"type": "text", "content": block}
    if not isinstance(block, dict):
        return {"type": "unknown", "content": block}
    kind = block.get("type")
    if kind in ("text", "input_text", "output_text"):
        return {"type": "text", "content": block.get("text")}
    if kind == "tool_use":
        return {"type": "tool_call", "id": block.get("id"), "name": block.get("name"),
                "arguments": block.get("input")}
    if kind == "tool_result":
        return {"type": "tool_call_response", "id": block.get("tool_use_id"),
                "response": block.get("content")}
    if kind == "function_call":
        return {"type": "tool_call", "id": block.get("call_id"), "name": block.get("name"),
                "arguments": _args(block.get("arguments"))}
    if kind == "function_call_output":
        return {"type": "tool_call_response", "id": block.get("call_id"),
                "response": block.get("output")}
    if kind == "thinking":
        return {"type": "reasoning", "content": block.get("thinking")}
    return {**block, "type": str(kind or "unknown")}


def _message(msg: Any) -> dict[str, Any]:
    if not isinstance(msg, dict):
        return {"role": "user", "parts": [_part(msg)]}
    if "role" not in msg and msg.get("type") in ("function_call", "function_call_output"):
        role = "assistant" if msg["type"] == "function_call" else "tool"
        return {"role": role, "parts": [_part(msg)]}
    content = msg.get("content")
    parts = [_part(b) for b in content] if isinstance(content, list) else (
        [_part(content)] if content is not None else [])
    if msg.get("role") == "tool":  # an OpenAI chat tool result
        parts = [{"type": "tool_call_response", "id": msg.get("tool_call_id"),
                  "response": content}]
    for call in msg.get("tool_calls") or []:
        if not isinstance(call, dict):
            continue
        fn = _obj(call.get("function"))
        parts.append({"type": "tool_call", "id": call.get("id"), "name": fn.get("name"),
                      "arguments": _args(fn.get("arguments"))})
    return {"role": str(msg.get("role") or "user"), "parts": parts}


def input_messages(request: Any) -> list[dict[str, Any]]:
    """The conversation a model request sends, in the conventions' form."""
    if not isinstance(request, dict):
        return []
    given = request.get("messages", request.get("input"))
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    return [_message(m) for m in given or [] if not (isinstance(m, dict)
                                                    and m.get("type") == "reasoning")]


def system_instructions(request: Any) -> list[dict[str, Any]]:
    """The instructions a request gives apart from its messages (Anthropic's ``system``,
    the Responses API's ``instructions``)."""
    if not isinstance(request, dict):
        return []
    given = request.get("system", request.get("instructions"))
    if given is None:
        return []
    return [_part(b) for b in given] if isinstance(given, list) else [_part(given)]


def output_messages(message: Any, stop_reason: Any) -> list[dict[str, Any]]:
    """What a model response says, in the conventions' form, with its finish reason."""
    if not isinstance(message, dict):
        return []
    if isinstance(message.get("choices"), list):  # Chat Completions
        return [{**_message(c.get("message") or {}), "finish_reason": c.get("finish_reason")}
                for c in message["choices"] if isinstance(c, dict)]
    if isinstance(message.get("output"), list):  # Responses
        parts = [p for item in message["output"] if isinstance(item, dict)
                 for p in (_message(item)["parts"] if item.get("type") == "message"
                           else [_part(item)])]
        return [{"role": "assistant", "parts": parts, "finish_reason": stop_reason}]
    return [{**_message(message), "role": str(message.get("role") or "assistant"),
             "finish_reason": stop_reason}]
