"""Claude on Amazon Bedrock: the Messages format over another carriage, proved end to end.

The real ``anthropic.AnthropicBedrock`` client signs each request with botocore's SigV4 and
reads streams in AWS's binary event-stream framing; the stub answers Bedrock's endpoints
offline (signature not checked). A tool loop is recorded, JSON and streamed, and replayed
bit for bit with no server and no AWS credentials; a fork edits a streamed call and the SDK
reads the frames deja writes; two runs diff as the same; a secret streamed in pieces is
taken out of the frames, which stay valid; the cost is Anthropic's price of the model the
URL names.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import pytest
from botocore.eventstream import EventStreamBuffer
from click.testing import CliRunner

import recorder
import replayer
from deja.cli import main as cli
from recorder import providers
from recorder.canonical import decode_body
from recorder.cassette import load
from recorder.providers.anthropic import MessagesFormat
from recorder.providers.bedrock import BedrockCarriage, model_of_url
from recorder.providers.pricing import PriceTable
from recorder.testing.server import StubServer
from replayer import diff

MODEL = "us.anthropic.claude-sonnet-4-20250514-v1:0"
REGION = "us-east-1"
CREDENTIALS = {"aws_access_key": "AKIDEXAMPLE",
               "aws_secret_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}
CLOSED_PORT_URL = "http://127.0.0.1:9"  # nothing listens there: a replay must not need it
USAGE = {"input_tokens": 120, "output_tokens": 9, "cache_creation_input_tokens": 0,
         "cache_read_input_tokens": 300}
# Bedrock bills Claude Sonnet 4 at Anthropic's rates: $3 in, $15 out, $0.30 a cached token
COST = round((120 * 3 + 9 * 15 + 300 * 0.3) / 1_000_000, 8)
TOOLS = [{"name": "get_weather", "description": "The weather in a city today.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Let me look.", "tool_use": {"name": "get_weather", "input": {"city": "Paris"}},
     "usage": USAGE},
    {"text": "It is sunny in Paris today, 21 degrees.", "usage": USAGE}]}
SEAM = providers.get("bedrock")

Stub = Callable[[dict], StubServer]


def client(url: str, **auth: Any) -> anthropic.AnthropicBedrock:
    return anthropic.AnthropicBedrock(base_url=url, aws_region=REGION, max_retries=0, **auth)


def weather(city: str) -> str:
    return json.dumps({"city": city, "forecast": "sunny", "celsius": 21})


def agent(url: str, *, stream: bool = False, city: str = "Paris",
          **auth: Any) -> list[dict[str, Any]]:
    """A tool loop: ask, run the tools the model asks for, until it answers."""
    messages: list[Any] = [{"role": "user", "content": f"What is the weather in {city}?"}]
    out = []
    with client(url, **auth) as c:
        while True:
            if stream:
                with c.messages.stream(model=MODEL, max_tokens=256, tools=TOOLS,
                                       messages=messages) as s:
                    reply = s.get_final_message()
            else:
                reply = c.messages.create(model=MODEL, max_tokens=256, tools=TOOLS,
                                          messages=messages)
            out.append(reply.model_dump(mode="json"))
            calls = [b for b in reply.content if b.type == "tool_use"]
            if not calls:
                return out
            messages += [{"role": "assistant", "content": reply.content},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": b.id,
                              "content": weather(**b.input)} for b in calls]}]


def model_lines(path: Path) -> list[Any]:
    return [o for o in load(path) if o["kind"] == "model"]


def body_of(obs: dict[str, Any]) -> bytes:
    return decode_body(obs["response"]["body"], obs["response"].get("encoding"))


def frames(body: bytes) -> list[Any]:
    buffer = EventStreamBuffer()  # botocore's decoder checks every CRC
    buffer.add_data(body)
    return list(buffer)


# ------------------------------------------------------------------------ the seam


def test_bedrock_is_the_messages_format_over_its_own_carriage() -> None:
    assert isinstance(SEAM.format, MessagesFormat)
    assert type(SEAM.format) is type(providers.get("anthropic").format)
    assert isinstance(SEAM.carriage, BedrockCarriage)
    host = f"https://bedrock-runtime.{REGION}.amazonaws.com"
    quoted = f"{host}/model/us.anthropic.claude-sonnet-4-20250514-v1%3A0/invoke"
    for url in (f"{host}/model/{MODEL}/invoke", quoted,
                f"{host}/model/{MODEL}/invoke-with-response-stream",
                f"{host}/model/arn:aws:bedrock:us-east-1:1:inference-profile%2Fx/invoke"):
        assert providers.model_provider("POST", url) == "bedrock", url
    assert model_of_url(quoted) == MODEL
    # another family's invoke speaks another format: plain HTTP
    assert providers.model_provider("POST", f"{host}/model/meta.llama3-70b-v1:0/invoke") is None
    assert providers.model_provider("GET", f"{host}/model/{MODEL}/invoke") is None
    assert SEAM.request_model({"anthropic_version": "x"}, f"{host}/model/{MODEL}/invoke") == MODEL
    assert SEAM.request_streams({}, f"{host}/model/{MODEL}/invoke-with-response-stream")
    assert not SEAM.request_streams({"stream": True}, f"{host}/model/{MODEL}/invoke")
    for header in ("Authorization", "X-Amz-Date", "x-amz-security-token",
                   "x-amz-content-sha256", "amz-sdk-invocation-id"):
        assert SEAM.is_volatile_header(header), header
    assert not providers.get("anthropic").is_volatile_header("x-amz-date")
    prices = PriceTable()
    assert SEAM.cost(MODEL, USAGE, prices) == COST
    assert SEAM.cost("anthropic.claude-3-5-haiku-20241022-v1:0", {"input_tokens": 10**6},
                     prices) == 0.8
    assert SEAM.cost(MODEL, USAGE, PriceTable({MODEL: [1.0, 1.0, 1.0, 1.0]})) == \
        round(429 / 1_000_000, 8)  # an override keyed by the Bedrock id wins


# ---------------------------------------------------- recorded and replayed, bit for bit


@pytest.mark.parametrize("stream", [False, True], ids=["json", "event-stream"])
def test_a_tool_loop_replays_bit_for_bit_without_aws(stub: Stub, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      stream: bool) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "loop.jsonl"
    with recorder.record(path) as run:
        recorded = agent(server.url, stream=stream, **CREDENTIALS)
    assert run.totals["model_calls"] == 2 and run.totals["input_tokens"] == 240
    assert recorded[-1]["content"][0]["text"] == "It is sunny in Paris today, 21 degrees."
    sent = server.requests[0]
    assert sent["headers"]["authorization"].startswith("AWS4-HMAC-SHA256")

    lines = model_lines(path)
    assert [o["provider"] for o in lines] == ["bedrock", "bedrock"]
    assert [o["stream"] for o in lines] == [stream, stream]
    assert [o["model"] for o in lines] == [MODEL, MODEL]
    assert [o["usage"] for o in lines] == [USAGE, USAGE]
    assert [o["stop_reason"] for o in lines] == ["tool_use", "end_turn"]
    assert [o["cost_usd"] for o in lines] == [COST, COST]
    assert [o["message_id"] for o in lines] == [r["id"] for r in recorded]
    stored = {name.lower() for o in lines for name, _ in o["request_headers"]}
    assert not stored & {"authorization", "x-amz-date", "x-amz-content-sha256"}, stored
    if stream:
        assert lines[0]["response"]["encoding"] == "base64"  # binary frames, stored exactly
        assert all(f.headers[":event-type"] == "chunk" for f in frames(body_of(lines[0])))
    message = SEAM.message(lines[0]["response"]["headers"], body_of(lines[0]))
    assert message["content"][1]["input"] == {"city": "Paris"}

    # No server, no AWS credentials: the replay's placeholder Bedrock key starts the client
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_PROFILE", "AWS_BEARER_TOKEN_BEDROCK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    served = len(server.requests)
    with replayer.replay(path) as replay:
        assert agent(CLOSED_PORT_URL, stream=stream) == recorded
    assert replay.result is not None and replay.result.identical, replay.result.report()
    assert len(server.requests) == served

    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        agent(CLOSED_PORT_URL, stream=stream, city="Rome")
    assert info.value.step == 0 and "Rome" in info.value.diff


def test_two_runs_are_the_same_and_show_reads_them(stub: Stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path in (a, b):  # new ids, signatures and padding in every run
        with recorder.record(path):
            agent(server.url, stream=True, **CREDENTIALS)
    assert diff.compare(load(a), load(b)).same
    shown = CliRunner().invoke(cli, ["show", str(a), "--json"])
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    assert data["run"]["cost_usd"] == round(2 * COST, 8)
    assert [s["input_tokens"] for s in data["steps"] if s.get("input_tokens")] == [120, 120]


# ---------------------------------------------------------------- forks and secrets


def test_a_fork_serves_an_edited_stream_as_frames_the_sdk_reads(stub: Stub,
                                                                tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "parent.jsonl"
    with recorder.record(path):
        agent(server.url, stream=True, **CREDENTIALS)
    out = tmp_path / "fork.jsonl"
    with replayer.fork(path, at=0, out=out, sets=["/content/1/input/city=Rome"]):
        forked = agent(server.url, stream=True, **CREDENTIALS)
    assert forked[0]["content"][1]["input"] == {"city": "Rome"}
    result = server.requests[-1]["body"]["messages"][-1]["content"][0]
    assert json.loads(result["content"])["city"] == "Rome"  # the agent ran on the edit
    [edited] = [o for o in model_lines(out) if o.get("edited")]
    assert frames(body_of(edited))  # valid frames, every CRC right
    assert edited["usage"] == USAGE and edited["cost_usd"] == COST
    with replayer.replay(out) as again:
        assert agent(CLOSED_PORT_URL, stream=True, **CREDENTIALS) == forked
    assert again.result is not None and again.result.identical, again.result.report()


def _sse(pieces: list[str]) -> str:
    """A Messages event stream whose one text block arrives in ``pieces``."""
    events = [{"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
        "stop_reason": None, "usage": {"input_tokens": 5, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text",
                                                                     "text": ""}}]
    events += [{"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": p}} for p in pieces]
    events += [{"type": "content_block_stop", "index": 0},
               {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 9}},
               {"type": "message_stop"}]
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)


def test_a_secret_streamed_in_pieces_is_taken_out_of_the_frames(stub: Stub,
                                                                tmp_path: Path) -> None:
    secret = "ghp_" + "a1B2c3D4e5" * 4
    pieces = ["Your token is ", secret[:9], secret[9:25], secret[25:] + " ok."]
    server = stub({"default": {"sse": _sse(pieces)}})
    ask = [{"role": "user", "content": "token?"}]
    path = tmp_path / "secret.jsonl"
    with recorder.record(path), client(server.url, **CREDENTIALS) as c, \
            c.messages.stream(model=MODEL, max_tokens=64, messages=ask) as s:
        said = s.get_final_message().content[0].text
    assert said == f"Your token is {secret} ok."  # the agent got it
    (obs,) = model_lines(path)
    body = body_of(obs)
    decoded = SEAM.carriage.text(body)  # the events inside the frames
    assert secret[:9] not in decoded and secret[9:25] not in decoded, decoded
    assert len(frames(body)) == 9  # every frame kept, every CRC right for botocore
    text = SEAM.assemble(body)["content"][0]["text"]
    assert secret not in text and text.startswith("Your token is ") and text.endswith(" ok.")
    with replayer.replay(path) as replay, client(CLOSED_PORT_URL, **CREDENTIALS) as c, \
            c.messages.stream(model=MODEL, max_tokens=64, messages=ask) as s:
        assert s.get_final_message().content[0].text == text  # what the cassette says
    assert replay.result is not None and replay.result.identical


def test_a_stub_made_from_a_bedrock_run_answers_it_again(stub: Stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        recorded = agent(server.url, stream=True, **CREDENTIALS)
    script = tmp_path / "script.json"
    made = CliRunner().invoke(cli, ["stub", "--from", str(path), "-o", str(script)])
    assert made.exit_code == 0, made.output
    again = stub(json.loads(script.read_text()))  # the binary stream served as recorded
    answered = agent(again.url, stream=True, **CREDENTIALS)
    assert [m["content"] for m in answered] == [m["content"] for m in recorded]
    assert [m["stop_reason"] for m in answered] == ["tool_use", "end_turn"]
