"""The stub server's Claude on Amazon Bedrock (``/model/{id}/invoke`` and
``/invoke-with-response-stream``), driven by the real ``anthropic.AnthropicBedrock`` client,
which signs with botocore's SigV4 and reads the event stream with botocore's decoder.
"""

from __future__ import annotations

import base64
import http.client
import json
from collections.abc import Callable, Iterator
from email.message import Message
from typing import NamedTuple

import anthropic
import pytest
from botocore.eventstream import EventStreamBuffer

from recorder.providers._eventstream import restream, text_view
from recorder.testing.server import StubServer

MODEL = "anthropic.claude-stub-v1:0"
USER = [{"role": "user", "content": "hi"}]
CREDENTIALS = {"aws_access_key": "AKIDEXAMPLE",
               "aws_secret_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
               "aws_region": "us-east-1"}
TOOL = {"name": "search", "input": {"q": "stub", "limit": 3}}
SCRIPT = {"select": "conversation",
          "turns": [{"text": "Let me look that up for you.", "tool_use": TOOL},
                    {"text": "Found it: three results."}]}
AFTER_TOOL = [*USER,
              {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", **TOOL}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                            "content": "3 hits"}]}]


@pytest.fixture
def bedrock(stub: Callable[[dict], StubServer]) -> Iterator[Callable[..., tuple]]:
    """A stub server for a script, and a Bedrock client of it (closed when the test ends)."""
    clients: list[anthropic.AnthropicBedrock] = []

    def make(script: dict, **options: object) -> tuple[StubServer, anthropic.AnthropicBedrock]:
        server = stub(script)
        given = {**CREDENTIALS, "max_retries": 0, **options}
        client = anthropic.AnthropicBedrock(base_url=server.url, **given)  # type: ignore[arg-type]
        clients.append(client)
        return server, client

    yield make
    for client in clients:
        client.close()


class Answer(NamedTuple):
    status: int
    headers: Message  # looked up by name in any case
    body: bytes


def post(server: StubServer, path: str, body: object, **headers: str) -> Answer:
    """A raw request to the stub (its whole answer read, the connection closed)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"content-type": "application/json", **headers})
        response = conn.getresponse()
        return Answer(response.status, response.headers, response.read())
    finally:
        conn.close()


def frames_of(raw: bytes) -> list:
    buffer = EventStreamBuffer()
    buffer.add_data(raw)
    return list(buffer)


BODY = {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 64, "messages": USER}
SIGNED = {"authorization": "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20250101/us-east-1/"
                           "bedrock/aws4_request, SignedHeaders=host, Signature=00"}


# ----------------------------------------------------------------------- answers


def test_create_answers_text_and_tool_use_with_the_paths_model(bedrock) -> None:
    server, client = bedrock(SCRIPT)
    first = client.messages.create(model=MODEL, max_tokens=64, messages=USER)
    assert first.model == MODEL
    assert [b.type for b in first.content] == ["text", "tool_use"]
    assert first.content[0].text == "Let me look that up for you."
    assert (first.content[1].name, first.content[1].input) == (TOOL["name"], TOOL["input"])
    assert first.stop_reason == "tool_use"
    second = client.messages.create(model=MODEL, max_tokens=64, messages=AFTER_TOOL)
    assert second.content[0].text == "Found it: three results."
    assert second.stop_reason == "end_turn"
    assert [r["path"] for r in server.received()] == [f"/model/{MODEL}/invoke"] * 2


def test_the_request_received_is_signed_and_has_no_model(bedrock) -> None:
    server, client = bedrock(SCRIPT)
    client.messages.create(model=MODEL, max_tokens=64, messages=USER)
    (request,) = server.received()
    headers = request["headers"]
    assert headers["authorization"].startswith(
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
    assert "/us-east-1/bedrock/aws4_request" in headers["authorization"]
    assert len(headers["x-amz-date"]) == 16 and headers["x-amz-date"].endswith("Z")
    body = request["body"]
    assert "anthropic_version" in body and "model" not in body and "stream" not in body


def test_stream_delivers_the_scripted_turn(bedrock) -> None:
    server, client = bedrock(SCRIPT)
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) > 1 and "".join(texts) == "Let me look that up for you."
    assert final.model == MODEL
    assert final.content[1].type == "tool_use"
    assert (final.content[1].name, final.content[1].input) == (TOOL["name"], TOOL["input"])
    assert final.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL, max_tokens=64, messages=AFTER_TOOL) as stream:
        assert stream.get_final_message().content[0].text == "Found it: three results."
    assert server.received()[0]["path"] == f"/model/{MODEL}/invoke-with-response-stream"


def test_stream_and_create_of_one_turn_agree(bedrock) -> None:
    _, client = bedrock({"default": {"thinking": "Hmm.", "text": "Same either way.",
                                     "usage": {"input_tokens": 11, "output_tokens": 6}}})
    made = client.messages.create(model=MODEL, max_tokens=64, messages=USER)
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
        streamed = stream.get_final_message()
    drop = {"id", "content"}
    assert made.model_dump(exclude=drop) == streamed.model_dump(exclude=drop)
    assert [b.model_dump(exclude={"signature"}) for b in made.content] == \
        [b.model_dump(exclude={"signature"}) for b in streamed.content]


@pytest.mark.asyncio
async def test_the_async_client_creates_and_streams(stub) -> None:
    server = stub(SCRIPT)
    async with anthropic.AsyncAnthropicBedrock(base_url=server.url, max_retries=0,
                                               **CREDENTIALS) as client:
        made = await client.messages.create(model=MODEL, max_tokens=64, messages=AFTER_TOOL)
        async with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
            final = await stream.get_final_message()
    assert made.content[0].text == "Found it: three results."
    assert final.content[1].input == TOOL["input"]
    assert server.received()[0]["headers"]["authorization"].startswith("AWS4-HMAC-SHA256 ")


def test_a_bedrock_api_key_is_accepted() -> None:
    server = StubServer(SCRIPT)
    with server, anthropic.AnthropicBedrock(api_key="ABSK-test", aws_region="us-east-1",
                                            base_url=server.url, max_retries=0) as client:
        made = client.messages.create(model=MODEL, max_tokens=64, messages=USER)
    assert made.content[0].text == "Let me look that up for you."
    assert server.received()[0]["headers"]["authorization"] == "Bearer ABSK-test"


def test_a_rule_on_stream_holds_on_the_streaming_path(bedrock) -> None:
    _, client = bedrock({"rules": [{"when": {"stream": True, "endpoint": "/v1/messages"},
                                    "text": "streamed"}],
                         "default": {"text": "whole"}})
    assert client.messages.create(model=MODEL, max_tokens=8, messages=USER).content[0].text \
        == "whole"
    with client.messages.stream(model=MODEL, max_tokens=8, messages=USER) as stream:
        assert stream.get_final_message().content[0].text == "streamed"


# ----------------------------------------------------------------------- the wire


def test_the_stream_is_event_stream_frames_ending_with_invocation_metrics(stub) -> None:
    server = stub({"default": {"text": "one two three four five six seven",
                               "usage": {"input_tokens": 21, "output_tokens": 9}}})
    response = post(server, f"/model/{MODEL}/invoke-with-response-stream", BODY, **SIGNED)
    raw = response.body
    assert response.status == 200
    assert response.headers["content-type"] == "application/vnd.amazon.eventstream"
    assert response.headers["x-amzn-RequestId"]
    frames = frames_of(raw)
    assert all(f.headers == {":event-type": "chunk", ":content-type": "application/json",
                             ":message-type": "event"} for f in frames)
    parts = [json.loads(f.payload) for f in frames]
    assert all(set(p) == {"bytes", "p"} for p in parts)
    events = [json.loads(base64.b64decode(p["bytes"])) for p in parts]
    assert [e["type"] for e in events][:2] == ["message_start", "ping"]
    assert events[-1]["type"] == "message_stop"
    metrics = events[-1]["amazon-bedrock-invocationMetrics"]
    assert (metrics["inputTokenCount"], metrics["outputTokenCount"]) == (21, 9)
    assert metrics["invocationLatency"] >= metrics["firstByteLatency"] >= 1
    edited = text_view(raw).replace("three", "3")
    assert restream(raw, edited) != raw and text_view(restream(raw, edited)) == edited


def test_invoke_answers_with_bedrocks_headers(stub) -> None:
    server = stub({"default": {"text": "ok", "usage": {"input_tokens": 5, "output_tokens": 1}}})
    response = post(server, f"/model/{MODEL.replace(':', '%3A')}/invoke", BODY, **SIGNED)
    message = json.loads(response.body)
    assert response.status == 200 and message["model"] == MODEL
    assert response.headers["X-Amzn-Bedrock-Input-Token-Count"] == "5"
    assert response.headers["X-Amzn-Bedrock-Output-Token-Count"] == "1"


def test_a_request_without_authorization_is_refused(stub) -> None:
    server = stub(SCRIPT)
    for headers in ({}, {"authorization": "Basic abc"}):
        response = post(server, f"/model/{MODEL}/invoke", BODY, **headers)
        assert response.status == 403
        assert json.loads(response.body) == {"message": "Missing Authentication Token"}
        assert response.headers["x-amzn-ErrorType"].startswith(
            "MissingAuthenticationTokenException:")
    assert len(server.received()) == 2 and server.served == 0


@pytest.mark.parametrize(("body", "complaint"), [
    ({**BODY, "model": MODEL}, "extraneous key [model]"),
    ({k: v for k, v in BODY.items() if k != "anthropic_version"},
     "required key [anthropic_version]"),
])
def test_a_malformed_body_gets_bedrocks_validation_error(stub, body, complaint) -> None:
    server = stub(SCRIPT)
    response = post(server, f"/model/{MODEL}/invoke", body, **SIGNED)
    assert response.status == 400
    assert complaint in json.loads(response.body)["message"]
    assert response.headers["x-amzn-ErrorType"].startswith("ValidationException:")


# ----------------------------------------------------------------------- errors


def test_a_scripted_429_is_the_sdks_rate_limit_error(bedrock) -> None:
    server, client = bedrock({"turns": [{"error": {"status": 429, "message": "Slow down."}}]})
    with pytest.raises(anthropic.RateLimitError) as info:
        client.messages.create(model=MODEL, max_tokens=64, messages=USER)
    response = info.value.response
    assert response.json() == {"message": "Slow down."}
    assert response.headers["x-amzn-ErrorType"] == \
        "ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/"
    assert server.served == 1


def test_a_scripted_error_retried_by_the_sdk_then_answers(bedrock) -> None:
    _, client = bedrock({"select": "conversation", "turns": [
        {"error": {"status": 503, "retry_after": 0.001}, "then": [{"text": "back"}]}]},
        max_retries=1)
    assert client.messages.create(model=MODEL, max_tokens=8, messages=USER).content[0].text \
        == "back"


def test_a_stream_cut_by_an_error_ends_with_an_exception_frame(bedrock) -> None:
    server, client = bedrock({"default": {"text": "a b c d e f g h", "sse_error": {
        "type": "rate_limit_error", "message": "Too many tokens.", "after_events": 4}}})
    with pytest.raises(anthropic.APIStatusError) as info, \
            client.messages.stream(model=MODEL, max_tokens=8, messages=USER) as stream:
        for _ in stream:
            pass
    assert info.value.body == {"type": "error", "error": {"type": "throttlingException",
                                                          "message": "Too many tokens."}}
    raw = post(server, f"/model/{MODEL}/invoke-with-response-stream", BODY, **SIGNED).body
    last = frames_of(raw)[-1]
    assert last.headers[":message-type"] == "exception"
    assert last.headers[":exception-type"] == "throttlingException"
    assert len(frames_of(raw)) == 5


def test_an_exhausted_script_is_a_500_not_retried(bedrock) -> None:
    _, client = bedrock({"turns": []}, max_retries=2)
    with pytest.raises(anthropic.InternalServerError) as info:
        client.messages.create(model=MODEL, max_tokens=8, messages=USER)
    assert "stub script exhausted" in info.value.response.json()["message"]
