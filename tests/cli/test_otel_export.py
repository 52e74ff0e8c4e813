"""``deja export``: a recorded run sent as OpenTelemetry spans to a real OTLP/HTTP receiver.

The run is recorded with the real anthropic SDK against the stub server (a tool call, a
turn that writes the prompt cache, one that reads it, an API error); the receiver is a
small HTTP server on 127.0.0.1 that decodes each POST /v1/traces body as the OTLP
``ExportTraceServiceRequest`` protobuf and answers with an empty response, as a collector
does. What it received is checked against the GenAI semantic conventions.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import pytest
from click.testing import CliRunner
from conftest import API_KEY, MODEL
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

import recorder
from deja.cli import main as cli_main
from recorder import otel
from recorder.cassette.keys import Keyring
from recorder.testing.server import StubServer

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Find the notes on tracing"
SYSTEM = "You are terse."
TOOLS = [{"name": "search", "description": "Search the notes.",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}]
SCRIPT = {"turns": [
    {"text": "Let me search.", "tool_use": {"id": "toolu_otel_01", "name": "search",
                                            "input": {"query": "tracing"}},
     "usage": {"input_tokens": 40, "output_tokens": 12, "cache_creation_input_tokens": 300,
               "cache_read_input_tokens": 0}},
    {"text": "It is in notes/tracing.md.",
     "usage": {"input_tokens": 25, "output_tokens": 7, "cache_creation_input_tokens": 0,
               "cache_read_input_tokens": 300}},
    {"error": {"status": 400, "type": "invalid_request_error", "message": "bad request"}},
]}


class Receiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1: keeps every request it decodes."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.content_types: list[str] = []
        self.api_keys: list[str | None] = []
        received = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                received.requests.append(request)
                received.content_types.append(self.headers.get("Content-Type", ""))
                received.api_keys.append(self.headers.get("x-api-key"))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self, index: int = -1) -> list[Span]:
        request = self.requests[index]
        for rs in request.resource_spans:
            assert _attrs(rs.resource.attributes)["service.name"] == "deja"
        return [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _record(stub: Callable[[dict], StubServer], path: Path, **options: Any) -> dict[str, Any]:
    """Record the run; what the SDK saw, to check the spans against."""
    server = stub(SCRIPT)

    @recorder.tool
    def search(query: str) -> dict[str, Any]:
        return {"hits": [f"notes/{query}.md"]}

    with recorder.record(path, labels={"agent": "notes-searcher"}, **options):
        client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": PROMPT}]
        first = client.messages.create(model=MODEL, max_tokens=256, system=SYSTEM,
                                       messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        call = next(b for b in first.content if b.type == "tool_use")
        found = search(**call.input)  # type: ignore[arg-type]
        messages += [{"role": "assistant", "content": first.content},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": call.id,
                                                   "content": json.dumps(found)}]}]
        second = client.messages.create(model=MODEL, max_tokens=256, system=SYSTEM,
                                        messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=MODEL, max_tokens=256,
                                   messages=[{"role": "user", "content": "again"}])
        client.close()
    return {"ids": [first.id, second.id]}


def export(*args: str) -> Any:
    return CliRunner().invoke(cli_main, ["export", *args], catch_exceptions=False)


def test_a_run_reaches_the_receiver_as_genai_spans(stub: Callable[[dict], StubServer],
                                                   receiver: Receiver, tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    seen = _record(stub, path)
    cassette = recorder.load(path)
    result = export(str(path), "--otlp", receiver.url)
    assert result.exit_code == 0, result.output
    assert len(receiver.requests) == 1 and receiver.content_types == ["application/x-protobuf"]
    spans = receiver.spans()
    assert [s.name for s in spans] == [
        "invoke_agent notes-searcher", f"chat {MODEL}", "execute_tool search",
        f"chat {MODEL}", f"chat {MODEL}"]
    root, chat1, tool, chat2, failed = spans
    run = cassette.run
    assert root.trace_id == otel.trace_id(run).to_bytes(16, "big")
    assert root.span_id == otel.root_span_id(run).to_bytes(8, "big")
    assert root.parent_span_id == b""
    for child in spans[1:]:
        assert child.trace_id == root.trace_id and child.parent_span_id == root.span_id
    assert {s.span_id for s in spans}.__len__() == 5

    a = _attrs(root.attributes)
    assert a["gen_ai.operation.name"] == "invoke_agent"
    assert a["gen_ai.agent.name"] == "notes-searcher" and a["gen_ai.conversation.id"] == run

    a = _attrs(chat1.attributes)
    assert chat1.kind == Span.SPAN_KIND_CLIENT
    assert {k: a[k] for k in ("gen_ai.operation.name", "gen_ai.provider.name",
                              "gen_ai.request.model", "gen_ai.response.model",
                              "gen_ai.response.id", "gen_ai.response.finish_reasons",
                              "gen_ai.conversation.id")} == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "anthropic",
        "gen_ai.request.model": MODEL, "gen_ai.response.model": MODEL,
        "gen_ai.response.id": seen["ids"][0], "gen_ai.response.finish_reasons": ["tool_use"],
        "gen_ai.conversation.id": run}
    # input tokens include the cache write (40 + 300) and the cache counts stand apart
    assert a["gen_ai.usage.input_tokens"] == 340 and a["gen_ai.usage.output_tokens"] == 12
    assert a["gen_ai.usage.cache_creation.input_tokens"] == 300
    assert a["gen_ai.usage.cache_read.input_tokens"] == 0
    assert a["gen_ai.request.max_tokens"] == 256
    a = _attrs(chat2.attributes)
    assert a["gen_ai.usage.input_tokens"] == 325  # 25 + 300 read from the cache
    assert a["gen_ai.usage.cache_read.input_tokens"] == 300
    assert a["gen_ai.response.id"] == seen["ids"][1]
    assert a["gen_ai.response.finish_reasons"] == ["end_turn"]
    assert chat2.status.code == Status.STATUS_CODE_UNSET

    assert failed.status.code == Status.STATUS_CODE_ERROR
    assert "bad request" in failed.status.message
    assert _attrs(failed.attributes)["error.type"] == "invalid_request_error"

    a = _attrs(tool.attributes)
    assert a == {**a, "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search",
                 "gen_ai.tool.call.id": "toolu_otel_01", "gen_ai.conversation.id": run}

    # times: each span from its line's t and ms, inside the run's span
    by_seq = {o["seq"]: o for o in cassette.observations}
    for span in spans[1:]:
        obs = by_seq[_attrs(span.attributes)["deja.step"]]
        assert span.start_time_unix_nano == round(obs["t"] * 1000) * 1_000_000
        assert span.end_time_unix_nano - span.start_time_unix_nano == round(obs["ms"] * 1e6)
        assert root.start_time_unix_nano <= span.start_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano

    # no content without --content
    body = receiver.requests[0].SerializeToString()
    for secret in (PROMPT.encode(), SYSTEM.encode(), b"notes/tracing.md"):
        assert secret not in body
    assert not {k for s in spans for k in _attrs(s.attributes)} & {
        "gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.system_instructions",
        "gen_ai.tool.call.arguments", "gen_ai.tool.call.result"}

    # exported again: the same trace, the same spans
    again = export(str(path), "--otlp", receiver.url)
    assert again.exit_code == 0, again.output
    assert [(s.trace_id, s.span_id, s.parent_span_id) for s in receiver.spans()] == [
        (s.trace_id, s.span_id, s.parent_span_id) for s in spans]


def test_content_only_with_the_flag(stub: Callable[[dict], StubServer], receiver: Receiver,
                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.jsonl"
    _record(stub, path)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-api-key=backend-key")
    result = export(str(path), "--otlp", receiver.url, "--content")
    assert result.exit_code == 0, result.output
    assert receiver.api_keys == ["backend-key"]  # the exporter's own header variable
    _, chat1, tool, chat2, _ = receiver.spans()
    a = _attrs(chat1.attributes)
    assert json.loads(a["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": PROMPT}]}]
    assert json.loads(a["gen_ai.system_instructions"]) == [{"type": "text", "content": SYSTEM}]
    out = json.loads(a["gen_ai.output.messages"])
    assert out[0]["role"] == "assistant" and out[0]["finish_reason"] == "tool_use"
    assert out[0]["parts"][1] == {"type": "tool_call", "id": "toolu_otel_01", "name": "search",
                                  "arguments": {"query": "tracing"}}
    history = json.loads(_attrs(chat2.attributes)["gen_ai.input.messages"])
    assert history[-1]["parts"][0]["type"] == "tool_call_response"
    assert history[-1]["parts"][0]["id"] == "toolu_otel_01"
    a = _attrs(tool.attributes)
    assert json.loads(a["gen_ai.tool.call.arguments"]) == {"query": "tracing"}
    assert json.loads(a["gen_ai.tool.call.result"]) == {"hits": ["notes/tracing.md"]}


def test_the_otlp_json_file_holds_the_same_spans(stub: Callable[[dict], StubServer],
                                                 receiver: Receiver, tmp_path: Path) -> None:
    path, out = tmp_path / "run.jsonl", tmp_path / "run.otlp.json"
    _record(stub, path)
    assert export(str(path), "--otlp", receiver.url).exit_code == 0
    result = export(str(path), "--format", "otlp-json", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 1  # one request a line, as OTLP files are
    doc = json.loads(out.read_text())
    (resource,) = doc["resourceSpans"]
    assert resource["resource"]["attributes"] == [
        {"key": "service.name", "value": {"stringValue": "deja"}}]
    spans = [s for ss in resource["scopeSpans"] for s in ss["spans"]]
    sent = receiver.spans()
    assert [(s["name"], s["traceId"], s["spanId"], s.get("parentSpanId", "")) for s in spans] == [
        (s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex()) for s in sent]
    assert [int(s["startTimeUnixNano"]) for s in spans] == [s.start_time_unix_nano for s in sent]
    assert [[kv["key"] for kv in s["attributes"]] for s in spans] == [
        [kv.key for kv in s.attributes] for s in sent]
    chat = spans[1]["attributes"]
    assert {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "340"}} in chat
    # the same request the receiver decoded, once ids are read back from hex
    assert len(json.dumps(doc)) > 0 and doc == json.loads(otel.to_json(
        otel.to_spans(recorder.load(path))))


def test_an_unreachable_endpoint_exits_2(stub: Callable[[dict], StubServer],
                                         tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    _record(stub, path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}/v1/traces"
    result = export(str(path), "--otlp", url, "--timeout", "1")
    assert result.exit_code == 2, result.output
    assert "ExportFailed" in result.output and url in result.output
    assert "Is a collector listening there?" in result.output
    bad = export(str(path), "--otlp", "127.0.0.1:4318")
    assert bad.exit_code == 2 and "not an OTLP/HTTP URL" in bad.output


def test_a_tampered_or_unverified_cassette_is_refused(stub: Callable[[dict], StubServer],
                                                      receiver: Receiver,
                                                      tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    _record(stub, path)
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_bytes(path.read_bytes().replace(b"notes/tracing.md", b"notes/tracing.mx", 1))
    result = export(str(tampered), "--otlp", receiver.url)
    assert result.exit_code == 2 and "SignatureError" in result.output, result.output

    stranger = tmp_path / "stranger.jsonl"
    _record(stub, stranger, keyring=Keyring.of(b"a stranger's key, not this machine's"))
    result = export(str(stranger), "--otlp", receiver.url)
    assert result.exit_code == 2 and "UnverifiedCassette" in result.output, result.output
    assert receiver.requests == []
    result = export(str(stranger), "--otlp", receiver.url, "--allow-unverified")
    assert result.exit_code == 0 and "NOT VERIFIED" in result.output, result.output
    assert len(receiver.spans()) == 5


def test_the_command_needs_one_destination(tmp_path: Path) -> None:
    help_text = export("--help")
    assert help_text.exit_code == 0 and "--otlp" in help_text.output
    assert "--content" in help_text.output
    none = export(str(tmp_path / "x.jsonl"))
    assert none.exit_code == 2 and "--otlp URL or --format otlp-json" in none.output
    no_file = export(str(tmp_path / "x.jsonl"), "--format", "otlp-json")
    assert no_file.exit_code == 2 and "needs -o FILE" in no_file.output


def test_the_attribute_names_are_the_conventions() -> None:
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as semconv

    from recorder import _otel_genai as genai

    for ours, theirs in [
        (genai.OPERATION, "GEN_AI_OPERATION_NAME"), (genai.PROVIDER, "GEN_AI_PROVIDER_NAME"),
        (genai.AGENT_NAME, "GEN_AI_AGENT_NAME"), (genai.CONVERSATION, "GEN_AI_CONVERSATION_ID"),
        (genai.REQUEST_MODEL, "GEN_AI_REQUEST_MODEL"),
        (genai.REQUEST_MAX_TOKENS, "GEN_AI_REQUEST_MAX_TOKENS"),
        (genai.RESPONSE_MODEL, "GEN_AI_RESPONSE_MODEL"), (genai.RESPONSE_ID, "GEN_AI_RESPONSE_ID"),
        (genai.FINISH_REASONS, "GEN_AI_RESPONSE_FINISH_REASONS"),
        (genai.TIME_TO_FIRST_CHUNK, "GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK"),
        (genai.INPUT_TOKENS, "GEN_AI_USAGE_INPUT_TOKENS"),
        (genai.OUTPUT_TOKENS, "GEN_AI_USAGE_OUTPUT_TOKENS"),
        (genai.CACHE_READ, "GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS"),
        (genai.CACHE_CREATION, "GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS"),
        (genai.INPUT_MESSAGES, "GEN_AI_INPUT_MESSAGES"),
        (genai.OUTPUT_MESSAGES, "GEN_AI_OUTPUT_MESSAGES"),
        (genai.SYSTEM_INSTRUCTIONS, "GEN_AI_SYSTEM_INSTRUCTIONS"),
        (genai.TOOL_NAME, "GEN_AI_TOOL_NAME"), (genai.TOOL_CALL_ID, "GEN_AI_TOOL_CALL_ID"),
        (genai.TOOL_TYPE, "GEN_AI_TOOL_TYPE"), (genai.TOOL_ARGUMENTS, "GEN_AI_TOOL_CALL_ARGUMENTS"),
        (genai.TOOL_RESULT, "GEN_AI_TOOL_CALL_RESULT")]:
        assert ours == getattr(semconv, theirs)
    values = [m.value for m in vars(semconv)["GenAiOperationNameValues"]]
    assert {"chat", "invoke_agent", "execute_tool"} <= set(values)


def test_import_recorder_does_not_load_opentelemetry() -> None:
    code = ("import json, sys\nimport recorder\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('opentelemetry'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True)
    assert json.loads(out.stdout) == []
    seen = subprocess.run([sys.executable, "-c", "import sys, recorder.otel\n"
                           "print('opentelemetry.sdk.trace' in sys.modules)"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    assert seen.stdout.strip() == "True"  # the check above can see the SDK when it loads


def test_a_call_inside_a_tool_is_a_child_of_the_tool(stub: Callable[[dict], StubServer],
                                                     receiver: Receiver,
                                                     tmp_path: Path) -> None:
    server = stub({"default": {"text": "summarised"}})
    path = tmp_path / "run.jsonl"

    with recorder.record(path):
        client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)

        @recorder.tool
        def summarise(text: str) -> str:
            reply = client.messages.create(model=MODEL, max_tokens=64,
                                           messages=[{"role": "user", "content": text}])
            return reply.content[0].text  # type: ignore[union-attr]

        summarise("a long text")
        client.close()
    assert export(str(path), "--otlp", receiver.url).exit_code == 0
    root, inner, tool = receiver.spans()
    assert (inner.name, tool.name) == (f"chat {MODEL}", "execute_tool summarise")
    assert tool.parent_span_id == root.span_id and inner.parent_span_id == tool.span_id
    assert _attrs(root.attributes)["gen_ai.agent.name"]  # the command, without a label


def test_a_fork_links_to_its_parent_run(tmp_path: Path) -> None:
    from recorder.cassette import CassetteWriter

    path = tmp_path / "fork.jsonl"
    writer = CassetteWriter(path, {"run": "r_fork", "parent": {"run": "r_parent", "step": 1}},
                            b"test-key-0123456789abcdef", "turn")
    writer.append({"kind": "tool", "name": "lookup", "args": {"q": 1}, "result": 2,
                   "t": 1795941439.25, "ms": 1.5})
    writer.close({"status": "completed"})
    root, tool = otel.to_spans(recorder.load(path))
    (link,) = root.links
    assert (link.context.trace_id, link.context.span_id) == (
        otel.trace_id("r_parent"), otel.root_span_id("r_parent"))
    assert root.attributes is not None and root.attributes["deja.parent.run"] == "r_parent"
    assert (tool.start_time, tool.end_time) == (1795941439250000000, 1795941439251500000)


MCP_TESTS = ROOT / "tests" / "mcp"


def _ledger_over_http() -> tuple[subprocess.Popen, str]:
    """The MCP tests' ledger server over Streamable HTTP, a real process on 127.0.0.1 (its
    ledger: ``LEDGER_DB``)."""
    name = "deja_otel_mcp_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, MCP_TESTS / "mcp_helpers.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    process, port = sys.modules[name].serve("--http")
    return process, f"http://127.0.0.1:{port}/mcp"


async def _use_the_ledger(db: Path, url: str) -> None:
    """An agent's MCP sessions: the ledger over stdio (a lookup, a prompt, a resource that
    is not there) and over HTTP (a refund)."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.exceptions import MCPError

    params = StdioServerParameters(command=sys.executable,
                                   args=[str(MCP_TESTS / "ledger_server.py")],
                                   env={"LEDGER_DB": str(db)})
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        await session.list_tools()
        await session.call_tool("lookup", {"order": "A-1"})
        await session.get_prompt("apology", {"order": "A-1"})
        with pytest.raises(MCPError):
            await session.read_resource("ledger://nowhere")
    async with streamable_http_client(url) as (read, write, *_), \
            ClientSession(read, write) as session:
        await session.initialize()
        await session.list_tools()
        await session.call_tool("refund", {"order": "A-1", "amount": 40})


def test_mcp_calls_are_spans_in_the_mcp_conventions(receiver: Receiver, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool call to an MCP server is an ``execute_tool`` client span with the MCP
    conventions' attributes; another request a span named for its method; neither has a
    session id or a JSON-RPC id, which deja never records."""
    import anyio

    monkeypatch.setenv("LEDGER_DB", str(tmp_path / "ledger.db"))
    server, url = _ledger_over_http()
    path = tmp_path / "run.jsonl"
    try:
        with recorder.record(path):
            anyio.run(_use_the_ledger, tmp_path / "ledger.db", url)
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert export(str(path), "--otlp", receiver.url).exit_code == 0
    spans = {s.name: s for s in receiver.spans()[1:]}
    assert list(spans) == ["initialize", "tools/list", "execute_tool lookup",
                           "prompts/get apology", "resources/read", "execute_tool refund"]
    assert all(s.kind == Span.SPAN_KIND_CLIENT for s in spans.values())
    lookup = _attrs(spans["execute_tool lookup"].attributes)
    assert lookup == {**lookup, "gen_ai.operation.name": "execute_tool",
                      "gen_ai.tool.name": "lookup", "mcp.method.name": "tools/call",
                      "mcp.protocol.version": "2025-11-25", "network.transport": "pipe"}
    assert "server.address" not in lookup
    refund = _attrs(spans["execute_tool refund"].attributes)
    assert refund == {**refund, "gen_ai.tool.name": "refund", "mcp.method.name": "tools/call",
                      "network.transport": "tcp", "network.protocol.name": "http",
                      "server.address": "127.0.0.1", "server.port": int(url.split(":")[2][:-4])}
    assert "mcp.protocol.version" in refund
    prompt = _attrs(spans["prompts/get apology"].attributes)
    assert prompt == {**prompt, "mcp.method.name": "prompts/get",
                      "gen_ai.prompt.name": "apology"}
    assert "gen_ai.operation.name" not in prompt  # only a tool call is one
    missing = spans["resources/read"]
    a = _attrs(missing.attributes)
    assert a["mcp.resource.uri"] == "ledger://nowhere"
    assert a["error.type"] == a["rpc.response.status_code"] and int(a["error.type"]) < 0
    assert missing.status.code == Status.STATUS_CODE_ERROR and missing.status.message
    assert not {k for s in spans.values() for k in _attrs(s.attributes)} & {
        "mcp.session.id", "jsonrpc.request.id"}


def test_the_mcp_attribute_names_are_the_conventions() -> None:
    from opentelemetry.semconv._incubating.attributes import (
        gen_ai_attributes,
        mcp_attributes,
        rpc_attributes,
    )
    from opentelemetry.semconv.attributes import network_attributes

    from recorder import _otel_genai as genai

    assert (genai.MCP_METHOD, genai.MCP_PROTOCOL_VERSION, genai.MCP_RESOURCE_URI) == (
        mcp_attributes.MCP_METHOD_NAME, mcp_attributes.MCP_PROTOCOL_VERSION,
        mcp_attributes.MCP_RESOURCE_URI)
    assert genai.PROMPT_NAME == gen_ai_attributes.GEN_AI_PROMPT_NAME
    assert (genai.NETWORK_TRANSPORT, genai.NETWORK_PROTOCOL_NAME) == (
        network_attributes.NETWORK_TRANSPORT, network_attributes.NETWORK_PROTOCOL_NAME)
    assert genai.RPC_STATUS_CODE == rpc_attributes.RPC_RESPONSE_STATUS_CODE
