"""A recorded run as OpenTelemetry spans, following the GenAI semantic conventions.

A loaded (and checked) cassette becomes one trace, built with the OpenTelemetry SDK:

- one ``invoke_agent`` span for the run, the root (``gen_ai.agent.name`` from the run's
  ``agent`` label, else its command);
- one ``chat {model}`` span per model call, a child of the root: provider, request and
  response model, response id, finish reasons, token usage, an error status for an API
  error or a failed exchange;
- one ``execute_tool {name}`` span per tool call (a ``tool`` line, or a side effect's
  ``outcome`` line, timed from its ``intent``), a child of the root.

Every exported string (attributes, status descriptions, span names) goes through the run's
redaction rules with today's built-in ones (:meth:`Redaction.latest`): what a cassette
recorded before a rule existed, or what only shows once a stream is assembled, is
redacted on the way out too.

Every span carries ``gen_ai.conversation.id``, the run id. Times come from each line's
``t`` (epoch seconds) and ``ms``. Message content (``gen_ai.input.messages``,
``gen_ai.output.messages``, ``gen_ai.system_instructions``, tool arguments and results)
is left out unless asked for: it is what a tracing backend should not hold by default.

Token usage follows the conventions' rule, which is not Anthropic's wire format:
``gen_ai.usage.input_tokens`` counts every input token, cache reads and writes included
(deja's ``input_tokens + cache_creation_input_tokens + cache_read_input_tokens``; for an
OpenAI call that is its ``prompt_tokens``), and the cache counts are given apart as
``gen_ai.usage.cache_read.input_tokens`` and ``gen_ai.usage.cache_creation.input_tokens``.

The ids are derived from the run id and the step numbers, not drawn at random, so
exporting a run twice gives the same trace and span ids (a backend sees one trace), and a
fork's root span links to its parent run's root.

Nothing here is imported by ``import recorder``: the SDK loads only when a run is exported.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from recorder import providers, values
from recorder.canonical import content_decoded, decode_body
from recorder.capture.redact import DEFAULT, Redaction
from recorder.cassette import Cassette
from recorder.cassette.schema import Kind, run_status
from recorder.errors import ConfigError, ExportFailed
from recorder.harness.progress import read_status

__all__ = ["root_span_id", "send", "to_json", "to_spans", "trace_id"]

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

SCOPE = "deja"
_log_of_exporter = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


# ---------------------------------------------------------------------- ids


def _digest(*parts: str, size: int) -> int:
    data = "\x00".join(("deja-otel", *parts)).encode()
    value = int.from_bytes(hashlib.sha256(data).digest()[:size], "big")
    return value or 1  # an all-zero id is invalid


def trace_id(run: str) -> int:
    """The trace id of run ``run``: the same every time it is exported."""
    return _digest(run, size=16)


def root_span_id(run: str) -> int:
    """The span id of run ``run``'s ``invoke_agent`` span (a fork's root links to it)."""
    return _digest(run, "root", size=8)


class _Ids(IdGenerator):
    """Ids from the run and the step a span stands for, set before each span starts."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.key = "root"

    def generate_trace_id(self) -> int:
        return trace_id(self.run)

    def generate_span_id(self) -> int:
        return _digest(self.run, self.key, size=8)


# ---------------------------------------------------------------------- times


def _ns(seconds: Any) -> int | None:
    """Epoch seconds as nanoseconds, exactly as written (``1795941439.84`` is .84 s)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return None
    return int(Decimal(repr(seconds)) * 1_000_000_000)


def _span_ns(obs: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """A line's start and end in nanoseconds: ``t``, and ``t`` plus ``ms``."""
    begin = _ns(obs.get("t"))
    if begin is None:
        return None, None
    ms = obs.get("ms")
    took = 0 if isinstance(ms, bool) or not isinstance(ms, int | float) else ms
    return begin, begin + max(0, int(Decimal(repr(took)) * 1_000_000))


def _created_ns(header: Mapping[str, Any]) -> int | None:
    created = header.get("created")
    if not isinstance(created, str):
        return None
    try:
        when = datetime.fromisoformat(created)
    except ValueError:
        return None
    return _ns(round(when.timestamp(), 6))


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
        message = providers.for_line(obs).message(headers, body.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None, None
    model = message.get("model") if isinstance(message, dict) else None
    return message, model if isinstance(model, str) else None


def _model_attributes(obs: Mapping[str, Any], request: Any, content: bool
                      ) -> tuple[dict[str, Any], Status | None]:
    provider = providers.for_line(obs)
    attrs: dict[str, Any] = {OPERATION: "chat", PROVIDER: str(obs.get("provider")
                                                               or provider.name)}
    model = obs.get("model") or provider.request_model(request)
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


# ---------------------------------------------------------------------- the trace


def _agent_name(cassette: Cassette) -> str:
    labels = cassette.header.get("labels") or {}
    for key in ("agent", "name"):
        if isinstance(labels.get(key), str) and labels[key]:
            return labels[key]
    argv = [str(a) for a in cassette.header.get("argv") or []]
    if argv and Path(argv[0]).name.startswith("python"):  # the program, not the interpreter
        argv = argv[2:3] if argv[1:2] == ["-m"] else argv[1:2]
    return " ".join(argv) or "agent"


def _rules(cassette: Cassette) -> Redaction:
    """The rules the run was recorded with, brought up to today's built-in ones."""
    try:
        return Redaction.from_header(cassette.header.get("redact")).latest()
    except ConfigError:
        return DEFAULT


def _clean(rules: Redaction, attrs: dict[str, Any]) -> dict[str, Any]:
    """``attrs`` with every string (and string in a list) redacted."""
    out: dict[str, Any] = {}
    for key, value in attrs.items():
        if isinstance(value, str):
            value = rules.text(value)
        elif isinstance(value, list | tuple):
            value = [rules.text(v) if isinstance(v, str) else v for v in value]
        out[key] = value
    return out


def _status(rules: Redaction, status: Status | None) -> Status | None:
    if status is None or status.description is None:
        return status
    return Status(status.status_code, rules.text(status.description))


def to_spans(cassette: Cassette, *, content: bool = False) -> list[ReadableSpan]:
    """The run in ``cassette`` as finished spans, root first (see the module docstring).
    ``content`` adds the messages, system instructions and tool arguments and results.

    A model call or a tool call made inside a tool's body (a line ``within`` it) is a
    child of that tool's span; every other step is a child of the root."""
    run, steps = cassette.run, cassette.observations
    rules = _rules(cassette)
    ids = _Ids(run)
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON, id_generator=ids, shutdown_on_exit=False,
                              resource=Resource({"service.name": "deja"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer(SCOPE)
    name, context, root_kind, attributes, links = _root(cassette)
    root = tracer.start_span(rules.text(name), context, root_kind, _clean(rules, attributes),
                             links,
                             start_time=_run_start(cassette))
    end: Mapping[str, Any] = cassette.end or {}
    if end.get("status") == "error":
        err = end.get("error") or {}
        root.set_attribute(ERROR_TYPE, rules.text(str(err.get("type") or "error")))
        root.set_status(Status(StatusCode.ERROR, rules.text(str(err.get("message")
                                                                or "the run failed"))))
    pending: list[tuple[str, str, Any]] = []  # tool calls the last model reply asked for
    intents: dict[Any, Mapping[str, Any]] = {o["seq"]: o for o in steps
                                             if o.get("kind") == Kind.INTENT}
    for index, obs in enumerate(steps):
        kind = obs.get("kind")
        if kind == Kind.MODEL:
            attrs, status = _model_attributes(obs, cassette.requests.get(obs["seq"]), content)
            name = f"chat {attrs.get(REQUEST_MODEL, '')}".strip()
            span_kind = SpanKind.CLIENT
            if "within" not in obs:
                pending = _tool_calls(_response(obs)[0])
        elif kind in (Kind.TOOL, Kind.OUTCOME):
            intent = intents.get(obs.get("intent"), {}) if kind == Kind.OUTCOME else obs
            args = intent.get("args")
            call_id = _str(obs.get("call_id")) or _match(pending, str(obs.get("name")), args)
            attrs, status = _tool_attributes(obs, args, call_id, content)
            name, span_kind = f"execute_tool {attrs[TOOL_NAME]}", SpanKind.INTERNAL
        else:
            continue
        attrs.update({CONVERSATION: run, "deja.step": obs["seq"]})
        begin, finish = _span_ns(obs)
        ids.key = f"step {obs['seq']}"
        span = tracer.start_span(rules.text(name), context=_parent(run, steps, index, root),
                                 kind=span_kind, attributes=_clean(rules, attrs),
                                 start_time=begin)
        status = _status(rules, status)
        if status is not None:
            span.set_status(status)
        span.end(end_time=finish)
    root.end(end_time=_run_end(cassette))
    provider.force_flush()
    provider.shutdown()
    spans = list(exporter.get_finished_spans())
    return [spans[-1], *spans[:-1]]


def _root(cassette: Cassette) -> tuple[str, Any, SpanKind, dict[str, Any], list[Link]]:
    """Name, context, kind, attributes and links of the run's ``invoke_agent`` span."""
    agent = _agent_name(cassette)
    attrs: dict[str, Any] = {OPERATION: "invoke_agent", AGENT_NAME: agent,
                             CONVERSATION: cassette.run, "deja.run.status": _run_status(cassette)}
    links = []
    parent = cassette.header.get("parent")
    if isinstance(parent, dict) and isinstance(parent.get("run"), str):
        attrs["deja.parent.run"] = parent["run"]
        if isinstance(parent.get("step"), int):
            attrs["deja.parent.step"] = parent["step"]
        links.append(Link(SpanContext(trace_id(parent["run"]), root_span_id(parent["run"]),
                                      is_remote=True, trace_flags=TraceFlags(1))))
    return f"invoke_agent {agent}", None, SpanKind.INTERNAL, attrs, links


def _parent(run: str, steps: Sequence[Mapping[str, Any]], index: int, root: Any) -> Any:
    """The context a step's span starts in: under the tool whose body made it (the first
    tool line after it with the name its ``within`` gives), else under the root."""
    within = steps[index].get("within")
    if isinstance(within, str):
        name = within.rpartition("#")[0]
        for later in steps[index + 1:]:
            if later.get("kind") in (Kind.TOOL, Kind.OUTCOME) and later.get("name") == name:
                tool = SpanContext(trace_id(run), _digest(run, f"step {later['seq']}", size=8),
                                   is_remote=False, trace_flags=TraceFlags(1))
                return trace.set_span_in_context(trace.NonRecordingSpan(tool))
    return trace.set_span_in_context(root)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _run_start(cassette: Cassette) -> int:
    """When the run started: its header's ``created``, else its first step."""
    firsts = [b for o in cassette.observations if (b := _span_ns(o)[0]) is not None]
    return _created_ns(cassette.header) or min(firsts, default=0)


def _run_end(cassette: Cassette) -> int:
    """When the run ended: its start plus the end line's duration, or its last step's
    end if that is later."""
    start = _run_start(cassette)
    ends = [start, *(e for o in cassette.observations if (e := _span_ns(o)[1]) is not None)]
    end: Mapping[str, Any] = cassette.end or {}
    duration = (end.get("totals") or {}).get("duration_s")
    if isinstance(duration, int | float) and not isinstance(duration, bool):
        ends.append(start + int(Decimal(repr(duration)) * 1_000_000_000))
    return max(ends)


def _match(pending: list[tuple[str, str, Any]], name: str, args: Any) -> str | None:
    """The id of the tool call the last model reply made with this name and arguments
    (taken, so that two identical calls get their own ids in order)."""
    for index, (call_id, called, given) in enumerate(pending):
        if called == name and given == args:
            del pending[index]
            return call_id
    return None


def _run_status(cassette: Cassette) -> str:
    """The run's one status as deja shows it: the end line (``failed`` for ``error``),
    else what its status record says (a worker failed it), else torn or incomplete."""
    if cassette.end is not None:
        return run_status(cassette.end)
    state = (read_status(cassette.run) or {}).get("status")
    return run_status(None, state if isinstance(state, str) else None) if state else \
        "torn" if cassette.torn_offset is not None else "incomplete"


# ---------------------------------------------------------------------- out


@contextmanager
def _exporter_log() -> Iterator[list[str]]:
    """What the OTLP exporter logs while it runs, kept for the error (not printed)."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger(_log_of_exporter)
    handler, propagate = Keep(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def send(spans: Sequence[ReadableSpan], endpoint: str, *, timeout: float = 10.0) -> None:
    """Send ``spans`` in one OTLP/HTTP (protobuf) request to ``endpoint``, the full traces
    URL (``http://127.0.0.1:4318/v1/traces``); headers come from
    ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` or ``OTEL_EXPORTER_OTLP_HEADERS``. Raises
    :class:`ExportFailed` when the endpoint cannot be reached within ``timeout`` seconds
    (retries included) or answers with an error."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ExportFailed(f"{endpoint!r} is not an OTLP/HTTP URL; give the traces endpoint, "
                           "e.g. http://127.0.0.1:4318/v1/traces")
    exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout)
    try:
        with _exporter_log() as seen:
            result = exporter.export(spans)
    finally:
        exporter.shutdown()
    if result is not SpanExportResult.SUCCESS:
        why = "; ".join(dict.fromkeys(seen)) or "no reason given"
        raise ExportFailed(f"the OTLP endpoint {endpoint} did not take the {len(spans)} spans "
                           f"({why}). Is a collector listening there? Check the URL (the "
                           "traces path included, usually /v1/traces) or write a file "
                           "instead: --format otlp-json -o FILE")


def to_json(spans: Sequence[ReadableSpan]) -> str:
    """The OTLP/JSON encoding of ``spans``: the ``ExportTraceServiceRequest`` that
    :func:`send` posts (the SDK's own encoder), in protobuf's JSON mapping with the OTLP
    rules on top: trace and span ids as hex, enums as integers. One line, so a file of
    it is also what a collector's ``otlpjsonfile`` receiver reads."""
    from google.protobuf import json_format  # type: ignore[import-untyped]

    doc = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    _hex_ids(doc)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def _hex_ids(node: Any) -> None:
    import base64

    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            else:
                _hex_ids(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids(item)
