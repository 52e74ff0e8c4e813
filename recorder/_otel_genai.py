"""A step of a run in the terms of the OpenTelemetry GenAI semantic conventions.

:mod:`recorder.otel` builds the trace; this module says what each span of a step holds:
the conventions' attribute names, a model call's attributes (provider, models, response
id, finish reasons, token usage, server) and a tool call's, an error status for a failed
exchange, an API error or a tool's error, the tool calls a model reply asks for, and the
message content (``gen_ai.input.messages``, ``gen_ai.output.messages``,
``gen_ai.system_instructions``, tool arguments and results) in the conventions' form.
Messages and tool calls are read through the call's conversation
(:mod:`recorder.providers.conversation`), so a Gemini call exports as an Anthropic or
OpenAI one does; its provider is named as the conventions name Google's endpoints
(:func:`provider_name`).

A call to an MCP server's tool is an ``execute_tool`` span with the MCP conventions'
attributes besides (``mcp.method.name``, ``mcp.protocol.version``, ``network.transport``,
the server's address for HTTP), and every other MCP request a span of its own named for
its method (:func:`mcp_attributes`). What differs on every run was never recorded: no
span has an ``mcp.session.id`` or a ``jsonrpc.request.id``.

Token usage follows the conventions' rule, which is not Anthropic's wire format:
``gen_ai.usage.input_tokens`` counts every input token, cache reads and writes included
(deja's ``input_tokens + cache_creation_input_tokens + cache_read_input_tokens``; for an
OpenAI call that is its ``prompt_tokens``), and the cache counts are given apart as
``gen_ai.usage.cache_read.input_tokens`` and ``gen_ai.usage.cache_creation.input_tokens``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.trace import Status, StatusCode

from recorder import providers, values
from recorder.canonical import content_decoded, decode_body
from recorder.capture.mcp.calls import TOOLS_CALL, URL_TRANSPORTS, server_key
from recorder.providers import Conversation
from recorder.providers import conversation as shape
from recorder.providers.conversation import BlockKind, ToolCall

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
# The MCP conventions' names (opentelemetry-semantic-conventions 0.66b2 has them too,
# ``mcp_attributes``, ``network_attributes``, ``rpc_attributes``; a test checks them).
MCP_METHOD = "mcp.method.name"
MCP_PROTOCOL_VERSION = "mcp.protocol.version"
MCP_RESOURCE_URI = "mcp.resource.uri"
PROMPT_NAME = "gen_ai.prompt.name"
NETWORK_TRANSPORT = "network.transport"
NETWORK_PROTOCOL_NAME = "network.protocol.name"
RPC_STATUS_CODE = "rpc.response.status_code"
# deja's provider names that the conventions name otherwise (Gemini's: provider_name)
_PROVIDER_NAMES = {"bedrock": "aws.bedrock"}
_GEMINI_API_PATH = re.compile(r"^/v1[a-z0-9]*/models/[^/]+:")


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
    when the body is not readable), both as its provider reads them."""
    response = obs.get("response")
    if not isinstance(response, Mapping) or not isinstance(response.get("body"), str):
        return None, None
    headers = [h for h in response.get("headers") or () if h]
    provider = providers.for_line(obs)
    try:
        body = content_decoded(decode_body(response["body"], response.get("encoding")),
                               headers)
        message = provider.message(headers, body)
    except (ValueError, UnicodeDecodeError):
        return None, None
    status = response.get("status")
    model = provider.summarize_parsed(status if isinstance(status, int) else 200, headers,
                                      body, message).get("model")
    return message, model if isinstance(model, str) else None


def provider_name(provider: str, url: str) -> str:
    """The conventions' name of the provider a call went to (``gen_ai.provider.name``):
    Bedrock's is ``aws.bedrock``; Google's by its endpoint, ``gcp.gemini`` for the Gemini
    API (generativelanguage.googleapis.com), ``gcp.vertex_ai`` for Vertex AI
    (aiplatform.googleapis.com), known by the path each speaks when the host is neither
    (a proxy, a gateway, a stub), else ``gcp.gen_ai`` (a Google endpoint, which one not
    known)."""
    if provider != "gemini":
        return _PROVIDER_NAMES.get(provider, provider)
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if host == "generativelanguage.googleapis.com":
        return "gcp.gemini"
    if host == "aiplatform.googleapis.com" or host.endswith("-aiplatform.googleapis.com"):
        return "gcp.vertex_ai"
    if "/publishers/google/models/" in parts.path:  # Vertex AI's resource path
        return "gcp.vertex_ai"
    if _GEMINI_API_PATH.match(parts.path):  # /v1beta/models/MODEL:generateContent
        return "gcp.gemini"
    return "gcp.gen_ai"


def _model_attributes(obs: Mapping[str, Any], request: Any, content: bool
                      ) -> tuple[dict[str, Any], Status | None]:
    provider = providers.for_line(obs)
    attrs: dict[str, Any] = {OPERATION: "chat", PROVIDER: provider_name(
        str(obs.get("provider") or provider.name), str(obs.get("url") or ""))}
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
    attrs.update(_server_attributes(str(obs.get("url") or "")))
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
        conv = provider.conversation(request, message)
        attrs[INPUT_MESSAGES] = _text(input_messages(conv))
        system = system_instructions(conv)
        if system:
            attrs[SYSTEM_INSTRUCTIONS] = _text(system)
        if message is not None:
            attrs[OUTPUT_MESSAGES] = _text(output_messages(conv, obs.get("stop_reason")))
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


def _server_attributes(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    attrs: dict[str, Any] = {}
    if parts.hostname:
        attrs[SERVER_ADDRESS] = parts.hostname
        if parts.port:
            attrs[SERVER_PORT] = parts.port
    return attrs


def mcp_versions(steps: Any) -> dict[str, str]:
    """The MCP protocol version each server of a run agreed to in its handshake, by the
    server's key (:func:`recorder.capture.mcp.calls.server_key`)."""
    found: dict[str, str] = {}
    for obs in steps:
        part = obs.get("mcp") if isinstance(obs, Mapping) else None
        result = obs.get("result")
        if isinstance(part, Mapping) and part.get("method") == "initialize" \
                and isinstance(result, Mapping) and isinstance(result.get("protocolVersion"), str):
            found[json.dumps(server_key(part.get("server") or {}))] = result["protocolVersion"]
    return found


def mcp_attributes(obs: Mapping[str, Any], versions: Mapping[str, str]
                   ) -> tuple[str, dict[str, Any], Status | None]:
    """The name, attributes and error status of the span of an MCP exchange: a tool line
    with an ``mcp`` field (its ``execute_tool`` attributes come from
    :func:`_tool_attributes`), or an ``mcp`` line, named ``{method} {target}`` (the prompt
    of a ``prompts/get``) as the MCP conventions name a client span. A JSON-RPC error's
    code is its ``error.type`` and ``rpc.response.status_code``."""
    part: Mapping[str, Any] = obs.get("mcp") or {}
    server: Mapping[str, Any] = part.get("server") or {}
    method = str(part.get("method") or "")
    attrs: dict[str, Any] = {MCP_METHOD: method}
    version = versions.get(json.dumps(server_key(server)))
    if version:
        attrs[MCP_PROTOCOL_VERSION] = version
    if server.get("transport") in URL_TRANSPORTS:
        attrs.update({NETWORK_TRANSPORT: "tcp", NETWORK_PROTOCOL_NAME: "http",
                      **_server_attributes(str(server.get("url") or ""))})
    else:
        attrs[NETWORK_TRANSPORT] = "pipe"
    raw = obs.get("params")
    params: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    name = method
    if method == "prompts/get" and isinstance(params.get("name"), str):
        attrs[PROMPT_NAME] = params["name"]
        name = f"{method} {params['name']}"
    if isinstance(params.get("uri"), str):
        attrs[MCP_RESOURCE_URI] = params["uri"]
    err = obs.get("error")
    if isinstance(err, Mapping) and isinstance(err.get("code"), int):
        attrs[ERROR_TYPE] = attrs[RPC_STATUS_CODE] = str(err["code"])
        return name, attrs, Status(StatusCode.ERROR, str(err.get("message") or ""))
    if isinstance(err, Mapping) and method != TOOLS_CALL:
        attrs[ERROR_TYPE] = str(err.get("type") or "error")
        return name, attrs, Status(StatusCode.ERROR, str(err.get("message") or ""))
    return name, attrs, None


def reply_calls(obs: Mapping[str, Any], request: Any) -> list[ToolCall]:
    """The tool calls the reply of model line ``obs`` (to ``request``) asks for, read
    through its provider's conversation, whatever the provider."""
    message, _ = _response(obs)
    if message is None:
        return []
    answer = shape.reply(providers.for_line(obs).conversation(request, message))
    return shape.tool_calls(answer) if answer is not None else []


# ---------------------------------------------------------------------- content
#
# Messages in the conventions' form: {"role", "parts": [{"type": "text", "content"},
# {"type": "tool_call", "id", "name", "arguments"}, {"type": "tool_call_response", "id",
# "response"}, {"type": "reasoning", "content"}, ...]}, read from the call's conversation
# (recorder.providers.conversation), so every provider's call reads alike. A block of
# another type is kept as it is, under its own type.


def _part(block: Any) -> dict[str, Any]:
    what = shape.kind(block)
    if what is BlockKind.TEXT:
        return {"type": "text", "content": shape.text(block)}
    if what is BlockKind.THINKING:
        return {"type": "reasoning", "content": shape.text(block)}
    if what is BlockKind.TOOL_USE:
        call = shape.tool_call(block)
        return {"type": "tool_call", "id": call.id, "name": call.name,
                "arguments": call.input}
    if what is BlockKind.TOOL_RESULT:
        result = shape.tool_result(block)
        return {"type": "tool_call_response", "id": result.tool_use_id,
                "response": result.content}
    if not isinstance(block, dict):
        return {"type": "unknown", "content": block}
    return {**block, "type": shape.type_name(block) or "unknown"}


def _message(turn: Any, role: str = "user") -> dict[str, Any]:
    return {"role": shape.role(turn) or role, "parts": [_part(b) for b in shape.blocks(turn)]}


def input_messages(conv: Conversation) -> list[dict[str, Any]]:
    """The conversation a model request sends, in the conventions' form."""
    return [_message(turn) for turn in shape.turns(conv)]


def system_instructions(conv: Conversation) -> list[dict[str, Any]]:
    """The instructions a request gives apart from its messages (Anthropic's ``system``,
    the Responses API's ``instructions``, Gemini's ``systemInstruction``)."""
    return [_part(block) for block in shape.system(conv)]


def output_messages(conv: Conversation, stop_reason: Any) -> list[dict[str, Any]]:
    """What a model response says, in the conventions' form, with its finish reason."""
    answer = shape.reply(conv)
    if answer is None:
        return []
    return [{**_message(answer, "assistant"), "finish_reason": stop_reason}]
