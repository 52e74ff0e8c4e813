"""A recorded Gemini run exported as OpenTelemetry GenAI spans: a function-calling loop
recorded with the real google-genai SDK against the stub server (the Gemini API's paths,
and Vertex AI's), turned into spans by the OpenTelemetry SDK (``recorder.otel``, and
``deja export`` to an OTLP/JSON file). Each model call is a ``chat`` span with the
provider as the conventions name Google's endpoints, the request and response model,
usage, the input and output messages and the function calls read through the call's
conversation; the function a ``@recorder.tool`` ran is an ``execute_tool`` span carrying
the id of the call that asked for it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from gemini_helpers import MODEL, function_config, function_loop

import recorder
from deja.cli import main as cli_main
from recorder import otel
from recorder._otel_genai import provider_name
from recorder.testing.server import StubServer

API_KEY = "AIzaSyD-deja-otel-SECRET-0123456789ab"
PROMPT = "What is the weather in Oslo?"
SYSTEM = "Answer in one sentence."
USAGE = {"input_tokens": 40, "output_tokens": 12, "cache_read_input_tokens": 100}
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Let me look.", "tool_use": {"name": "get_weather", "input": {"city": "Oslo"}},
     "usage": USAGE},
    {"text": "It is snowing in Oslo.", "usage": USAGE}]}
CONFIG = function_config("get_weather", "city", "The weather in a city today.",
                         system_instruction=SYSTEM, max_output_tokens=256)
FORECAST = {"forecast": "snow", "celsius": -4}

Stub = Callable[[dict], StubServer]


@recorder.tool
def get_weather(city: str) -> dict[str, Any]:
    return FORECAST


def record(stub: Stub, path: Path, *, vertex: bool = False) -> list[str]:
    """Record the loop; the response ids the SDK saw."""
    server = stub(SCRIPT)
    with recorder.record(path, labels={"agent": "weather"}):
        turns = function_loop(server.url, API_KEY, PROMPT, CONFIG,
                              lambda call: get_weather(**(call.args or {})), vertex=vertex)
    return [str(response.response_id) for [response] in turns]


def attributes(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_a_gemini_run_exports_as_genai_spans(stub: Stub, tmp_path: Path) -> None:
    path = tmp_path / "gemini.jsonl"
    ids = record(stub, path)
    spans = otel.to_spans(recorder.load(path), content=True)
    assert [s.name for s in spans] == ["invoke_agent weather", f"chat {MODEL}",
                                       "execute_tool get_weather", f"chat {MODEL}"]
    _, chat1, tool, chat2 = spans

    a = attributes(chat1)
    assert {k: a[k] for k in ("gen_ai.operation.name", "gen_ai.provider.name",
                              "gen_ai.request.model", "gen_ai.response.model",
                              "gen_ai.response.id", "gen_ai.response.finish_reasons",
                              "gen_ai.request.max_tokens")} == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "gcp.gemini",
        "gen_ai.request.model": MODEL, "gen_ai.response.model": MODEL,
        "gen_ai.response.id": ids[0], "gen_ai.response.finish_reasons": ("STOP",),
        "gen_ai.request.max_tokens": 256}
    # every input token counts, the cache reads among them and apart
    assert a["gen_ai.usage.input_tokens"] == 140 and a["gen_ai.usage.output_tokens"] == 12
    assert a["gen_ai.usage.cache_read.input_tokens"] == 100
    assert json.loads(a["gen_ai.system_instructions"]) == [{"type": "text", "content": SYSTEM}]
    assert json.loads(a["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": PROMPT}]}]
    assert json.loads(a["gen_ai.output.messages"]) == [{
        "role": "assistant", "finish_reason": "STOP", "parts": [
            {"type": "text", "content": "Let me look."},
            {"type": "tool_call", "id": "get_weather", "name": "get_weather",
             "arguments": {"city": "Oslo"}}]}]

    # the function's response in the next call's input, answering the call by its id
    history = json.loads(attributes(chat2)["gen_ai.input.messages"])
    assert [m["role"] for m in history] == ["user", "assistant", "user"]
    assert history[-1]["parts"] == [{"type": "tool_call_response", "id": "get_weather",
                                     "response": FORECAST}]
    assert attributes(chat2)["gen_ai.response.id"] == ids[1]

    # the tool span carries the id of the call the reply made
    a = attributes(tool)
    assert (a["gen_ai.tool.name"], a["gen_ai.tool.call.id"]) == ("get_weather", "get_weather")
    assert json.loads(a["gen_ai.tool.call.arguments"]) == {"city": "Oslo"}
    assert json.loads(a["gen_ai.tool.call.result"]) == FORECAST

    # deja export writes the same spans
    out = tmp_path / "gemini.otlp.json"
    result = CliRunner().invoke(cli_main, ["export", str(path), "--format", "otlp-json",
                                           "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    chats = [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]
             if s["name"].startswith("chat ")]
    assert len(chats) == 2 and all(
        {"key": "gen_ai.provider.name", "value": {"stringValue": "gcp.gemini"}}
        in s["attributes"] for s in chats)


def test_a_vertex_ai_run_is_named_vertex_ai(stub: Stub, tmp_path: Path) -> None:
    path = tmp_path / "vertex.jsonl"
    record(stub, path, vertex=True)
    [chat, *_] = [s for s in otel.to_spans(recorder.load(path)) if s.name.startswith("chat ")]
    assert attributes(chat)["gen_ai.provider.name"] == "gcp.vertex_ai"
    assert attributes(chat)["gen_ai.request.model"] == MODEL


@pytest.mark.parametrize(("url", "name"), [
    ("https://generativelanguage.googleapis.com/v1beta/models/m:generateContent",
     "gcp.gemini"),
    ("https://us-central1-aiplatform.googleapis.com/v1/projects/p/locations/us-central1/"
     "publishers/google/models/m:streamGenerateContent?alt=sse", "gcp.vertex_ai"),
    ("https://aiplatform.googleapis.com/v1/publishers/google/models/m:generateContent",
     "gcp.vertex_ai"),
    ("http://127.0.0.1:8080/gateway/m:generateContent", "gcp.gen_ai"),
])
def test_google_endpoints_by_the_conventions_names(url: str, name: str) -> None:
    assert provider_name("gemini", url) == name
    assert provider_name("anthropic", url) == "anthropic"
    assert provider_name("bedrock", url) == "aws.bedrock"
