"""A recorded run as OpenTelemetry spans, following the GenAI semantic conventions.

A loaded (and checked) cassette becomes one trace, built with the OpenTelemetry SDK:

- one ``invoke_agent`` span for the run, the root (``gen_ai.agent.name`` from the run's
  ``agent`` label, else its command);
- one ``chat {model}`` span per model call, a child of the root: provider (by the
  conventions' names: ``anthropic``, ``openai``, ``aws.bedrock``, ``gcp.gemini`` or
  ``gcp.vertex_ai`` for Gemini), request and response model, response id, finish
  reasons, token usage, an error status for an API error or a failed exchange;
- one ``execute_tool {name}`` span per tool call (a ``tool`` line, or a side effect's
  ``outcome`` line, timed from its ``intent``), a child of the root; a call to an MCP
  server's tool is a client span with the MCP conventions' attributes too;
- one span per other request to an MCP server (an ``mcp`` line: ``initialize``,
  ``tools/list``, ``prompts/get {prompt}`` ...), a client span named as the MCP
  conventions name it.

What a step's span holds, in the conventions' terms (their attribute names, token usage,
message content), is :mod:`recorder._otel_genai`; a call's messages and the tool calls a
reply asks for (whose ids a tool span carries) are read through its provider's
conversation, whatever the provider.

Every exported string (attributes, status descriptions, span names) goes through the run's
redaction rules with today's built-in ones (:meth:`Redaction.latest`): what a cassette
recorded before a rule existed, or what only shows once a stream is assembled, is
redacted on the way out too.

Every span carries ``gen_ai.conversation.id``, the run id. Times come from each line's
``t`` (epoch seconds) and ``ms``. Message content (``gen_ai.input.messages``,
``gen_ai.output.messages``, ``gen_ai.system_instructions``, tool arguments and results)
is left out unless asked for: it is what a tracing backend should not hold by default.

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

from recorder._otel_genai import (
    AGENT_NAME,
    CONVERSATION,
    ERROR_TYPE,
    OPERATION,
    REQUEST_MODEL,
    TOOL_NAME,
    _model_attributes,
    _tool_attributes,
    mcp_attributes,
    mcp_versions,
    reply_calls,
)
from recorder.capture.redact import DEFAULT, Redaction
from recorder.cassette import Cassette
from recorder.cassette.schema import Kind, run_status
from recorder.errors import ConfigError, ExportFailed
from recorder.harness.progress import read_status
from recorder.providers.conversation import ToolCall

__all__ = ["root_span_id", "send", "to_json", "to_spans", "trace_id"]

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
    pending: list[ToolCall] = []  # tool calls the last model reply asked for
    intents: dict[Any, Mapping[str, Any]] = {o["seq"]: o for o in steps
                                             if o.get("kind") == Kind.INTENT}
    versions = mcp_versions(steps)
    for index, obs in enumerate(steps):
        kind = obs.get("kind")
        if kind == Kind.MODEL:
            attrs, status = _model_attributes(obs, cassette.requests.get(obs["seq"]), content)
            name = f"chat {attrs.get(REQUEST_MODEL, '')}".strip()
            span_kind = SpanKind.CLIENT
            if "within" not in obs:
                pending = reply_calls(obs, cassette.requests.get(obs["seq"]))
        elif kind in (Kind.TOOL, Kind.OUTCOME):
            intent = intents.get(obs.get("intent"), {}) if kind == Kind.OUTCOME else obs
            args = intent.get("args")
            call_id = _str(obs.get("call_id")) or _match(pending, str(obs.get("name")), args)
            attrs, status = _tool_attributes(obs, args, call_id, content)
            name, span_kind = f"execute_tool {attrs[TOOL_NAME]}", SpanKind.INTERNAL
            if "mcp" in obs:  # a call to an MCP server: the MCP conventions' client span
                _, more, rpc = mcp_attributes(obs, versions)
                attrs, status, span_kind = {**attrs, **more}, rpc or status, SpanKind.CLIENT
        elif kind == Kind.MCP:
            name, attrs, status = mcp_attributes(obs, versions)
            span_kind = SpanKind.CLIENT
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


def _match(pending: list[ToolCall], name: str, args: Any) -> str | None:
    """The id of the tool call the last model reply made with this name and arguments
    (taken, so that two identical calls get their own ids in order)."""
    for index, call in enumerate(pending):
        if call.name == name and call.input == args:
            del pending[index]
            return call.id
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
