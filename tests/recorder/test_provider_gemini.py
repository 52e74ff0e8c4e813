"""The Gemini provider on bodies the google-genai SDK really exchanged with the stub server,
and the stub speaking Gemini: a function-calling loop recorded and replayed bit for bit,
JSON and streamed, a changed prompt that diverges, cost and tokens as ``deja show`` sees
them, requests stored as deltas, and the API key kept out of the cassette."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from google import genai
from google.genai import errors, types

import recorder
import replayer
from deja.cli import main as cli
from recorder import providers
from recorder.cassette import load
from recorder.providers.gemini import GeminiFormat, model_of_url, normalized_usage
from recorder.providers.pricing import PriceTable
from recorder.testing.match import conversation, last_user_text, position
from recorder.testing.server import StubServer
from replayer import diff
from viewer import content

MODEL = "gemini-2.5-flash"
API_KEY = "AIzaSyD-deja-test-SECRET-0123456789abc"  # a Google API key's shape: 39 characters
CLOSED_PORT_URL = "http://127.0.0.1:9"  # nothing listens there: a replay must not need it
USAGE = {"input_tokens": 120, "output_tokens": 9, "cache_read_input_tokens": 300}
# gemini-2.5-flash: $0.30 in, $2.50 out, $0.03 a cached token
COST = round((120 * 0.30 + 9 * 2.50 + 300 * 0.03) / 1_000_000, 8)
SEAM = providers.get("gemini")
WEATHER = types.Tool(function_declarations=[types.FunctionDeclaration(
    name="get_weather", description="The weather in a city today.",
    parameters=types.Schema(type=types.Type.OBJECT,
                            properties={"city": types.Schema(type=types.Type.STRING)}))])
CONFIG = types.GenerateContentConfig(
    tools=[WEATHER], system_instruction="Answer in one sentence.", max_output_tokens=256,
    automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Let me look.", "tool_use": {"name": "get_weather", "input": {"city": "Paris"}},
     "usage": USAGE},
    {"text": "It is sunny in Paris today, 21 degrees.", "usage": USAGE}]}

Stub = Callable[[dict], StubServer]


def client(url: str) -> genai.Client:
    return genai.Client(api_key=API_KEY, http_options=types.HttpOptions(base_url=url))


def get_weather(city: str) -> dict[str, Any]:
    return {"city": city, "forecast": "sunny", "celsius": 21}


@recorder.tool
def weather_tool(city: str) -> dict[str, Any]:
    """get_weather as a deja tool: its result is a step of the run."""
    return get_weather(city)


def agent(url: str, city: str = "Paris",
          function: Callable[..., dict[str, Any]] = get_weather) -> list[Any]:
    """A function-calling loop by hand: ask, run each function the model calls, send its
    response back, until the model answers in text."""
    out: list[Any] = []
    contents: list[Any] = [types.Content(role="user", parts=[
        types.Part(text=f"What is the weather in {city}?")])]
    with client(url) as c:
        while True:
            response = c.models.generate_content(model=MODEL, contents=contents, config=CONFIG)
            out.append(response.model_dump(mode="json", exclude_none=True,
                                           exclude={"sdk_http_response"}))
            calls = response.function_calls or []
            if not calls:
                return out
            contents.append(response.candidates[0].content)
            contents.append(types.Content(role="user", parts=[
                types.Part.from_function_response(name=call.name or "",
                                                  response=function(**(call.args or {})))
                for call in calls]))


def streaming_agent(url: str) -> list[Any]:
    """The same loop through a chat streamed chunk by chunk (the SDK keeps each chunk's
    content in the history it sends)."""
    out: list[Any] = []
    with client(url) as c:
        chat = c.chats.create(model=MODEL, config=CONFIG)
        message: Any = "What is the weather in Paris?"
        while True:
            calls = []
            for chunk in chat.send_message_stream(message):
                out.append(chunk.model_dump(mode="json", exclude_none=True,
                                            exclude={"sdk_http_response"}))
                calls += chunk.function_calls or []
            if not calls:
                return out
            message = [types.Part.from_function_response(
                name=call.name or "", response=get_weather(**(call.args or {})))
                for call in calls]


def model_lines(path: Path) -> list[Any]:
    return [o for o in load(path) if o["kind"] == "model"]


def raw_model_lines(path: Path) -> list[dict[str, Any]]:
    """The model lines as they are on disk (compact, requests stored as deltas)."""
    return [line for line in map(json.loads, path.read_bytes().splitlines()[1:])
            if line.get("kind") == "model"]


def message_of(obs: dict[str, Any]) -> Any:
    return SEAM.message(obs["response"]["headers"], obs["response"]["body"])


# ------------------------------------------------------------------------ the seam


def test_the_endpoints_are_gemini_calls_at_any_host_and_version() -> None:
    for url in ("https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash"
                ":generateContent",
                "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash"
                ":streamGenerateContent?alt=sse",
                "https://us-central1-aiplatform.googleapis.com/v1/projects/p/locations/"
                "us-central1/publishers/google/models/gemini-2.5-pro:generateContent"):
        found = providers.for_url("POST", url)
        assert found is not None and isinstance(found.format, GeminiFormat), url
    base = "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash"
    assert providers.for_url("POST", f"{base}:countTokens") is None
    assert providers.for_url("GET", f"{base}:generateContent") is None
    assert model_of_url(f"{base}:streamGenerateContent?alt=sse") == "gemini-2.5-flash"
    assert model_of_url("https://h/v1beta/tunedModels/x:generateContent") is None
    body = {"contents": [], "generationConfig": {"temperature": 0, "maxOutputTokens": 900}}
    assert SEAM.request_model(body) is None  # the body does not name it
    assert SEAM.request_model(body, f"{base}:generateContent") == "gemini-2.5-flash"
    assert SEAM.request_streams(body, f"{base}:streamGenerateContent?alt=sse")
    assert not SEAM.request_streams(body, f"{base}:generateContent")
    assert SEAM.request_max_tokens(body) == 900 and SEAM.request_max_tokens({}) is None
    assert SEAM.with_max_tokens(body, 64)["generationConfig"] == {"temperature": 0,
                                                                  "maxOutputTokens": 64}
    assert SEAM.with_max_tokens({"contents": []}, 64)["generationConfig"] == \
        {"maxOutputTokens": 64}
    assert SEAM.history_field(body) == "contents" == providers.history_field(body)
    assert SEAM.is_volatile_header("x-goog-api-client") and SEAM.is_volatile_header("Host")
    assert not SEAM.is_volatile_header("x-goog-api-key")  # stored, as [redacted]
    assert providers.placeholder_keys({})["GEMINI_API_KEY"] == providers.PLACEHOLDER_KEY
    assert "GOOGLE_API_KEY" not in providers.placeholder_keys({})  # one key, not two
    # a key the user set under either name is the one the SDK finds: none is added
    assert "GEMINI_API_KEY" not in providers.placeholder_keys({"GOOGLE_API_KEY": "k"})


def test_usage_is_normalised_to_deja_names_and_priced() -> None:
    meta = {"promptTokenCount": 420, "candidatesTokenCount": 7, "thoughtsTokenCount": 2,
            "cachedContentTokenCount": 300, "totalTokenCount": 429}
    assert normalized_usage(meta) == USAGE
    assert normalized_usage({**meta, "toolUsePromptTokenCount": 5})["input_tokens"] == 125
    assert normalized_usage({"promptTokenCount": 7}) == {"input_tokens": 7}
    assert normalized_usage({"promptTokenCount": "7", "candidatesTokenCount": True}) == {}
    assert SEAM.cost(MODEL, USAGE, PriceTable()) == COST
    assert SEAM.cost("gemini-2.5-flash-lite-preview-09-2025", USAGE, PriceTable()) == \
        round((120 * 0.10 + 9 * 0.40 + 300 * 0.01) / 1_000_000, 8)
    error = SEAM.summarize(429, [], b'{"error": {"code": 429, "message": "slow down", '
                                    b'"status": "RESOURCE_EXHAUSTED"}}')
    assert error == {"error": {"type": "RESOURCE_EXHAUSTED", "message": "slow down"}}
    assert SEAM.summarize(200, [], b"\xff") == {} and SEAM.summarize(200, [], b"[1") == {}
    blocked = {"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": meta}
    assert SEAM.stop_reason(blocked) == "SAFETY"


def test_a_stream_asked_without_sse_is_a_json_array_of_chunks() -> None:
    chunks = [{"candidates": [{"content": {"role": "model", "parts": [{"text": "Hel"}]},
                               "index": 0}], "responseId": "r1", "modelVersion": MODEL},
              {"candidates": [{"content": {"role": "model", "parts": [{"text": "lo"}]},
                               "finishReason": "STOP", "index": 0}],
               "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 2},
               "responseId": "r1", "modelVersion": MODEL}]
    body = json.dumps(chunks).encode()
    headers = [("content-type", "application/json")]
    message = SEAM.message(headers, body.decode())
    assert message["candidates"][0]["content"]["parts"] == [{"text": "Hello"}]
    assert SEAM.summarize(200, headers, body) == {
        "message_id": "r1", "model": MODEL, "stop_reason": "STOP",
        "usage": {"input_tokens": 3, "output_tokens": 2}}
    assert SEAM.summarize_parsed(200, headers, body, chunks) == SEAM.summarize(200, headers,
                                                                               body)


# ---------------------------------------------------- recorded and replayed, bit for bit


def test_a_function_calling_loop_replays_bit_for_bit(stub: Stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "loop.jsonl"
    with recorder.record(path) as run:
        recorded = agent(server.url)
    assert run.totals["model_calls"] == 2 and run.totals["input_tokens"] == 240
    assert recorded[-1]["candidates"][0]["content"]["parts"][0]["text"].startswith("It is")

    lines = model_lines(path)
    assert [o["provider"] for o in lines] == ["gemini", "gemini"]
    assert [o["usage"] for o in lines] == [USAGE, USAGE]
    assert [o["stop_reason"] for o in lines] == ["STOP", "STOP"]
    assert [o["cost_usd"] for o in lines] == [COST, COST]
    assert [o["message_id"] for o in lines] == [r["response_id"] for r in recorded]
    assert "ttft_ms" not in lines[0]
    call = message_of(lines[0])["candidates"][0]["content"]["parts"][1]
    assert call == {"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}}

    with replayer.replay(path) as replay:
        assert agent(CLOSED_PORT_URL) == recorded
    assert replay.result is not None and replay.result.identical, replay.result.report()

    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        agent(CLOSED_PORT_URL, city="Rome")
    assert info.value.step == 0 and "Rome" in info.value.diff and "Paris" in info.value.diff


def test_a_streamed_loop_replays_bit_for_bit(stub: Stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "stream.jsonl"
    with recorder.record(path):
        recorded = streaming_agent(server.url)
    assert "".join(c["candidates"][0]["content"]["parts"][0].get("text") or ""
                   for c in recorded[-3:]) == "It is sunny in Paris today, 21 degrees."
    lines = model_lines(path)
    assert [SEAM.is_stream(o["response"]["headers"]) for o in lines] == [True, True]
    assert all("ttft_ms" in o for o in lines)
    assert [o["usage"] for o in lines] == [USAGE, USAGE]  # the last chunk's counts
    assert [o["cost_usd"] for o in lines] == [COST, COST]
    first = message_of(lines[0])["candidates"][0]
    assert first["content"]["parts"] == [
        {"text": "Let me look."},  # one text from its chunks
        {"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}}]
    assert first["finishReason"] == "STOP"

    with replayer.replay(path) as replay:
        assert streaming_agent(CLOSED_PORT_URL) == recorded
    assert replay.result is not None and replay.result.identical, replay.result.report()


def test_a_synthesised_stream_is_the_response_again(stub: Stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "stream.jsonl"
    with recorder.record(path):
        streaming_agent(server.url)
        agent(server.url)
    for obs in model_lines(path):
        message = message_of(obs)
        text = SEAM.synthesize(message)
        assert SEAM.assemble(text) == message
        summary = SEAM.summarize(200, [("content-type", "text/event-stream")], text)
        assert summary["usage"] == obs["usage"] and summary["stop_reason"] == obs["stop_reason"]
        assert summary["message_id"] == obs["message_id"]


def test_a_stream_cut_by_an_error_still_says_what_it_said(stub: Stub, tmp_path: Path) -> None:
    server = stub({"default": {"text": "one two three four five six seven",
                               "sse_error": {"after_events": 1, "message": "went away"}}})
    got = []
    with client(server.url) as c, pytest.raises(errors.ServerError, match="went away"):
        for chunk in c.models.generate_content_stream(model=MODEL, contents="count"):
            got.append(chunk.text)
    assert got == ["one two three "]
    # The SDK stops reading at the error and never closes the response, so a recording
    # of it has no end (see the report of this change); read whole, it is logged:
    path = tmp_path / "cut.jsonl"
    url = f"{server.url}/v1beta/models/{MODEL}:streamGenerateContent?alt=sse"
    with recorder.record(path):
        httpx.post(url, json={"contents": [{"role": "user", "parts": [{"text": "count"}]}]})
    (obs,) = model_lines(path)
    assert obs["api_error"] == {"type": "INTERNAL", "message": "went away"}
    assert obs["usage"] == {"input_tokens": obs["usage"]["input_tokens"]}  # the prompt only
    message = SEAM.assemble(obs["response"]["body"])
    assert message["error"]["message"] == "went away"
    assert message["candidates"][0]["content"]["parts"] == [{"text": "one two three "}]


def test_a_fork_edits_a_function_call_or_a_function_response(stub: Stub,
                                                              tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "parent.jsonl"
    with recorder.record(path):
        recorded = streaming_agent(server.url)
    # the model's call, edited: served as a stream the SDK reads, then the run goes live
    out = tmp_path / "call.jsonl"
    with replayer.fork(path, at=0, out=out,
                       sets=["/candidates/0/content/parts/1/functionCall/args/city=Rome"]):
        forked = streaming_agent(server.url)
    assert forked[0]["candidates"][0]["content"]["parts"][1]["function_call"]["args"] == \
        {"city": "Rome"}
    def texts(chunks: list[Any]) -> list[Any]:
        return [c["candidates"][0]["content"]["parts"] for c in chunks]

    assert texts(forked[1:]) == texts(recorded[-3:])  # the answer, live
    sent = server.requests[-1]["body"]["contents"][-1]["parts"][0]["functionResponse"]
    assert sent["response"]["city"] == "Rome"
    [edited] = [o for o in model_lines(out) if o.get("edited")]
    assert edited["usage"] == USAGE and edited["cost_usd"] == COST
    with replayer.replay(out) as again:  # the fork replays like any run
        assert streaming_agent(CLOSED_PORT_URL) == forked
    assert again.result is not None and again.result.identical

    # the function's response, edited: the next request sends what the fork says
    path = tmp_path / "tooled.jsonl"
    with recorder.record(path):
        agent(server.url, function=weather_tool)
    [step] = [o["seq"] for o in load(path) if o["kind"] == "tool"]
    with replayer.fork(path, at=step, out=tmp_path / "result.jsonl",
                       sets=['/result={"city": "Paris", "forecast": "snow"}']):
        agent(server.url, function=weather_tool)
    sent = server.requests[-1]["body"]["contents"][-1]["parts"][0]["functionResponse"]
    assert sent["response"] == {"city": "Paris", "forecast": "snow"}


# --------------------------------------------------------- how a run reads, and its size


def test_show_and_diff_read_a_gemini_run(stub: Stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path in (a, b):  # a new responseId in every response
        with recorder.record(path):
            agent(server.url)
    assert diff.compare(load(a), load(b)).same

    shown = CliRunner().invoke(cli, ["show", str(a)])
    assert shown.exit_code == 0, shown.output
    assert "2 model calls, 0 tool calls, 240 in / 18 out tokens" in shown.output
    data = json.loads(CliRunner().invoke(cli, ["show", str(a), "--json"]).output)
    assert data["run"]["cost_usd"] == round(2 * COST, 8)
    assert [s["input_tokens"] for s in data["steps"]] == [120, 120]

    cassette = load(a)
    second = model_lines(a)[1]
    conv = content.conversation(cassette.request_of(second["seq"]), second, content.Clip())
    assert [b["text"] for b in conv["system"]] == ["Answer in one sentence."]
    assert [(m["role"], [b["type"] for b in m["blocks"]]) for m in conv["turns"]] == [
        ("user", ["text"]), ("assistant", ["text", "tool_use"]), ("user", ["tool_result"])]
    result = conv["turns"][2]["blocks"][0]
    assert result["name"] == "get_weather"
    assert conv["response"]["stop_reason"] == "STOP"
    assert conv["response"]["usage"] == USAGE


def test_requests_are_stored_as_what_they_add(stub: Stub, tmp_path: Path) -> None:
    """Each request resends the whole conversation: the cassette stores the two contents it
    adds (the model's call, the function's response), so it grows linearly."""
    turns = 8
    server = stub({"select": "conversation",
                   "rules": [{"when": {"position": turns}, "text": "Done."}],
                   "default": {"tool_use": {"name": "get_weather", "input": {"city": "Paris"}},
                               "usage": USAGE}})
    path = tmp_path / "long.jsonl"
    with recorder.record(path):
        agent(server.url)
    stored = [line["request"] for line in raw_model_lines(path)]
    assert len(stored) == turns + 1 and set(stored[0]) == {"body"}
    # the model's content is the reply it resends ("reply"), the function's response added
    assert all(s["base"] == n and s["keep"] == 1 + 2 * n and s["reply"] == n
               and len(s["contents"]) == 1 for n, s in enumerate(stored[1:]))
    sizes = [len(json.dumps(s)) for s in stored[2:]]  # the first holds its shape inline
    assert max(sizes) - min(sizes) <= 8  # the numbers in base and keep
    assert load(path).request_of(model_lines(path)[-1]["seq"]) == server.requests[-1]["body"]


# ------------------------------------------------------------------------ the API key


def test_the_api_key_never_reaches_the_cassette(stub: Stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "key.jsonl"
    url = f"{server.url}/v1beta/models/{MODEL}:generateContent?key={API_KEY}"
    body = {"contents": [{"role": "user", "parts": [{"text": "What is the weather?"}]}]}
    with recorder.record(path):
        agent(server.url)  # the SDK's x-goog-api-key header
        first = httpx.post(url, json=body).json()  # the key as a query parameter
    assert server.requests[0]["headers"]["x-goog-api-key"] == API_KEY  # it was sent
    assert API_KEY.encode() not in path.read_bytes() and b"AIza" not in path.read_bytes()
    lines = model_lines(path)
    assert ["x-goog-api-key", "[redacted]"] in lines[0]["request_headers"]
    assert "key=%5Bredacted%5D" in lines[2]["url"] or "key=[redacted]" in lines[2]["url"]
    with replayer.replay(path):
        agent(CLOSED_PORT_URL)
        replayed = httpx.post(url.replace(server.url, CLOSED_PORT_URL), json=body).json()
    assert replayed == first


def test_a_secret_streamed_in_pieces_is_taken_out_of_every_piece(stub: Stub,
                                                                 tmp_path: Path) -> None:
    secret = "ghp_" + "a1B2c3D4e5" * 4
    pieces = ["Your token is ", secret[:9], secret[9:25], secret[25:] + " ok."]
    chunks = [{"candidates": [{"content": {"role": "model", "parts": [{"text": p}]},
                               "index": 0}], "modelVersion": MODEL} for p in pieces]
    sse = "".join(f"data: {json.dumps(c)}\r\n\r\n" for c in chunks)
    server = stub({"default": {"sse": sse}})
    path = tmp_path / "piece.jsonl"
    with recorder.record(path), client(server.url) as c:
        said = "".join(ch.text or "" for ch in
                       c.models.generate_content_stream(model=MODEL, contents="token?"))
    assert said == f"Your token is {secret} ok."  # the agent got it
    raw = path.read_bytes()
    assert secret[:9].encode() not in raw and secret[9:25].encode() not in raw
    (obs,) = model_lines(path)
    text = message_of(obs)["candidates"][0]["content"]["parts"][0]["text"]
    assert secret not in text and text.startswith("Your token is ")


# ------------------------------------------------------------- the stub speaks Gemini


def test_errors_carry_google_bodies_and_retry_headers(stub: Stub) -> None:
    server = stub({"default": {"error": {"status": 429, "retry_after": 0}}})
    with client(server.url) as c, pytest.raises(errors.ClientError) as info:
        c.models.generate_content(model=MODEL, contents="hi")
    assert info.value.code == 429 and info.value.status == "RESOURCE_EXHAUSTED"
    assert info.value.response.headers["retry-after"] == "0"
    bad = httpx.post(f"{server.url}/v1beta/models/{MODEL}:generateContent", json={})
    assert bad.status_code == 400 and bad.json()["error"]["status"] == "INVALID_ARGUMENT"


def test_rules_read_gemini_conversations(stub: Stub) -> None:
    body = {"contents": [
        {"role": "user", "parts": [{"text": "hi"}]},
        {"role": "model", "parts": [{"text": "hmm", "thought": True},
                                    {"functionCall": {"name": "f", "args": {}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "f",
                                                         "response": {"out": "done"}}}]}]}
    assert position(body) == 1 and json.loads(last_user_text(body)) == {"out": "done"}
    assert [m["role"] for m in conversation(body)] == ["user", "assistant", "user"]
    server = stub({"select": "conversation",
                   "rules": [{"when": {"tool_result_contains": "sunny", "stream": True},
                              "text": "streamed"},
                             {"when": {"endpoint": ":generateContent", "position": 1},
                              "text": "plain"}],
                   "turns": [SCRIPT["turns"][0]]})
    assert agent(server.url)[-1]["candidates"][0]["content"]["parts"] == [{"text": "plain"}]
    assert streaming_agent(server.url)[-1]["candidates"][0]["content"]["parts"] == \
        [{"text": "streamed"}]


def test_a_stub_made_from_a_gemini_run_answers_it_again(stub: Stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        recorded = agent(server.url), streaming_agent(server.url)
    out = tmp_path / "script.json"
    made = CliRunner().invoke(cli, ["stub", "--from", str(path), "-o", str(out)])
    assert made.exit_code == 0, made.output
    assert "4 model calls" in made.output and "left out" not in made.output
    script = json.loads(out.read_text())
    assert {(r["when"]["endpoint"], r["when"]["stream"]) for r in script["rules"]} == {
        (":generateContent", False), (":streamGenerateContent", True)}
    again = stub(script)
    assert (agent(again.url), streaming_agent(again.url)) == recorded


def test_a_dollar_budget_prices_a_gemini_call_by_the_model_its_url_names(
        stub: Stub, tmp_path: Path) -> None:
    """Gemini names the model in the URL, not the body: the guard, the line's model and the
    stream flag read it there, so a dollar budget counts a Gemini run's spending."""
    server = stub(SCRIPT)
    path = tmp_path / "budgeted.jsonl"
    with recorder.record(path, budgets={"dollars": 1.0}):
        agent(server.url)
    lines = model_lines(path)
    assert [line["model"] for line in lines] == [MODEL, MODEL]
    assert [line["stream"] for line in lines] == [False, False]
    assert load(path).end["status"] == "completed"  # type: ignore[index]
    with pytest.raises(recorder.BudgetExhausted), \
            recorder.record(tmp_path / "spent.jsonl", budgets={"dollars": COST / 2}):
        agent(server.url)
