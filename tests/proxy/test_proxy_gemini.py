"""Google Gemini through ``deja proxy``: an unmodified google-genai agent pointed at a real
proxy process, which forwards to the stub server, records its function-calling loop
(JSON and streamed) and replays it offline, identical."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from google import genai
from google.genai import types
from proxy_helpers import ProxyProcess, cassettes

from recorder.cassette import load
from recorder.testing.server import StubServer

MODEL = "gemini-2.5-flash"
API_KEY = "AIzaSyD-deja-proxy-SECRET-0123456789ab"
USAGE = {"input_tokens": 50, "output_tokens": 9, "cache_read_input_tokens": 20}
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Let me look.", "tool_use": {"name": "lookup", "input": {"word": "deja"}},
     "usage": USAGE},
    {"text": "It means already.", "usage": USAGE}]}
CONFIG = types.GenerateContentConfig(
    tools=[types.Tool(function_declarations=[types.FunctionDeclaration(
        name="lookup", description="Look a word up.",
        parameters=types.Schema(type=types.Type.OBJECT,
                                properties={"word": types.Schema(type=types.Type.STRING)}))])],
    automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))

Proxy = Callable[..., ProxyProcess]
Stub = Callable[[dict], StubServer]


def loop(url: str, stream: bool) -> list[Any]:
    """Ask, answer each function call, until the model answers in text; every response
    (every chunk, streamed) as the SDK gave it."""
    out: list[Any] = []
    contents: list[Any] = ["What does 'deja' mean?"]
    with genai.Client(api_key=API_KEY, http_options=types.HttpOptions(base_url=url)) as c:
        while True:
            if stream:
                chunks = list(c.models.generate_content_stream(model=MODEL, contents=contents,
                                                               config=CONFIG))
            else:
                chunks = [c.models.generate_content(model=MODEL, contents=contents,
                                                    config=CONFIG)]
            out += [ch.model_dump(mode="json", exclude_none=True,
                                  exclude={"sdk_http_response"}) for ch in chunks]
            calls = [call for ch in chunks for call in ch.function_calls or []]
            if not calls:
                return out
            contents.append(types.Content(role="model", parts=[
                part for ch in chunks for part in ch.candidates[0].content.parts]))
            contents.append(types.Content(role="user", parts=[
                types.Part.from_function_response(name=call.name or "",
                                                  response={"meaning": "already"})
                for call in calls]))


def test_a_gemini_loop_is_recorded_and_replayed_through_the_proxy(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    upstream = stub(SCRIPT)
    directory = tmp_path / "runs"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    recorded = {stream: loop(recording.url, stream=stream) for stream in (False, True)}
    status, log = recording.stop()
    assert status == 0, log
    upstream.stop()
    assert upstream.requests[0]["headers"]["x-goog-api-key"] == API_KEY

    # one run per conversation, as for any provider: the JSON loop and the streamed one
    paths = cassettes(directory)
    assert len(paths) == 2, paths
    by_kind = {}
    for path in paths:
        assert API_KEY.encode() not in path.read_bytes()
        models = [o for o in load(path) if o["kind"] == "model"]
        assert [o["provider"] for o in models] == ["gemini"] * 2
        assert all(o["usage"] == USAGE and o["stop_reason"] == "STOP" for o in models)
        endpoints = {o["url"].rpartition(":")[2] for o in models}
        assert len(endpoints) == 1, endpoints
        by_kind[endpoints.pop()] = path
    assert set(by_kind) == {"generateContent", "streamGenerateContent?alt=sse"}

    for stream, endpoint in ((False, "generateContent"),
                             (True, "streamGenerateContent?alt=sse")):
        replaying = proxy("--replay", str(by_kind[endpoint]))
        replayed = loop(replaying.url, stream=stream)
        status, log = replaying.stop()
        assert status == 0, log
        assert ": identical" in log and "steps:      3/3 served" in log, log  # 2 calls, a tool
        assert replayed == recorded[stream]
