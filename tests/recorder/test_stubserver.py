"""Tests for recorder.testing.server, driven by the real anthropic SDK over real sockets:
plain replies, streaming and errors.

Conversation selection and recorded replies are in test_stubserver_select.py, the script
format in test_stubserver_script.py, ``deja stub`` in test_stubserver_cli.py.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import anthropic
import httpx2
import pytest
import stub_helpers
from stub_helpers import MODEL, USER, create, raw_request

from recorder.testing.server import StubServer

# Fixtures shared by the test_stubserver files.
make_client = stub_helpers.make_client
make_server = stub_helpers.make_server


# --------------------------------------------------------------------------------------------
# Plain replies
# --------------------------------------------------------------------------------------------


def test_plain_text_reply(make_server, make_client) -> None:
    server = make_server(
        {"turns": [{"text": "Hello!", "usage": {"input_tokens": 12, "output_tokens": 3}}]}
    )
    client = make_client(server)
    msg = create(client)
    assert msg.type == "message"
    assert msg.role == "assistant"
    assert msg.model == MODEL
    assert msg.id.startswith("msg_") and len(msg.id) == 28
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "Hello!"
    assert msg.stop_reason == "end_turn"
    assert msg.stop_sequence is None
    assert msg.usage.input_tokens == 12
    assert msg.usage.output_tokens == 3
    assert msg.usage.cache_read_input_tokens == 0
    assert server.served == 1
    [req] = server.requests
    assert req["path"] == "/v1/messages"
    # anthropic 2.x sends the key as a bearer token; older SDKs used x-api-key.
    headers = req["headers"]
    assert "sk-test" in (headers.get("x-api-key", "") + headers.get("authorization", ""))
    assert "anthropic-version" in headers
    assert req["body"]["messages"] == USER
    assert req["body"]["max_tokens"] == 64


def test_raw_json_response_shape_and_headers(make_server) -> None:
    server = make_server({"turns": [{"text": "hello world"}]})
    body = json.dumps({"model": MODEL, "max_tokens": 5, "messages": USER}).encode()
    status, headers, raw = raw_request(server, "POST", "/v1/messages", body)
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert headers["request-id"].startswith("req_")
    assert int(headers["content-length"]) == len(raw)
    data = json.loads(raw)
    assert set(data) == {
        "id",
        "type",
        "role",
        "model",
        "content",
        "stop_reason",
        "stop_sequence",
        "usage",
    }
    assert set(data["usage"]) == {
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    }
    assert data["usage"]["input_tokens"] >= 1 and data["usage"]["output_tokens"] >= 1


def test_tool_use_reply(make_server, make_client) -> None:
    server = make_server(
        {
            "turns": [
                {
                    "text": "Let me search.",
                    "tool_use": {"name": "search", "input": {"query": "x"}, "id": "toolu_given"},
                },
                {"tool_use": [{"name": "a", "input": {}}, {"name": "b", "input": {"k": 1}}]},
            ]
        }
    )
    client = make_client(server)
    msg = create(client)
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    tool = msg.content[1]
    assert isinstance(tool, anthropic.types.ToolUseBlock)
    assert tool.id == "toolu_given"
    assert tool.name == "search"
    assert tool.input == {"query": "x"}
    assert msg.stop_reason == "tool_use"

    msg = create(client)
    assert [(b.name, b.input) for b in msg.content] == [("a", {}), ("b", {"k": 1})]
    ids = [b.id for b in msg.content]
    assert all(i.startswith("toolu_") and len(i) == 30 for i in ids)
    assert ids[0] != ids[1]


def test_thinking_block_and_stop_reason_override(make_server, make_client) -> None:
    server = make_server(
        {"turns": [{"thinking": "deep thought", "text": "42", "stop_reason": "max_tokens"}]}
    )
    msg = create(make_client(server))
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "deep thought"
    assert msg.content[0].signature
    assert msg.stop_reason == "max_tokens"


def test_ids_differ_between_calls(make_server, make_client) -> None:
    server = make_server({"default": {"text": "same", "tool_use": {"name": "t", "input": {}}}})
    client = make_client(server)
    first, second = create(client), create(client)
    assert first.id != second.id
    assert first.content[1].id != second.content[1].id
    assert first.content[0].text == second.content[0].text == "same"


def test_echo_placeholder(make_server, make_client) -> None:
    server = make_server({"default": {"text": "you said: {echo}"}})
    client = make_client(server)
    assert create(client).content[0].text == "you said: hi"
    messages = [
        {"role": "user", "content": "first"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "result"},
                {"type": "text", "text": "more"},
            ],
        },
    ]
    assert create(client, messages=messages).content[0].text == "you said: result\nmore"


# --------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------


def test_create_stream_events(make_server, make_client) -> None:
    text = "The quick brown fox jumps over the lazy dog again and again."
    server = make_server(
        {"turns": [{"text": text, "tool_use": {"name": "search", "input": {"query": "fox"}}}]}
    )
    client = make_client(server)
    events = list(create(client, stream=True))
    types = [e.type for e in events]
    assert types[0] == "message_start"
    assert types[-2:] == ["message_delta", "message_stop"]
    assert types.count("content_block_start") == 2
    assert types.count("content_block_stop") == 2
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == []
    assert start.usage.output_tokens == 1

    text_deltas = [e.delta.text for e in events if e.type == "content_block_delta" and e.index == 0]
    assert len(text_deltas) > 1
    assert "".join(text_deltas) == text
    json_deltas = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == 1
    ]
    assert 2 <= len(json_deltas) <= 3
    assert json.loads("".join(json_deltas)) == {"query": "fox"}
    assert events[-2].delta.stop_reason == "tool_use"
    assert events[-2].usage.output_tokens >= 1


def test_raw_sse_wire_format(make_server) -> None:
    server = make_server({"turns": [{"text": "one two three four five six seven"}]})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        body = json.dumps({"model": MODEL, "max_tokens": 5, "messages": USER, "stream": True})
        conn.request(
            "POST", "/v1/messages", body=body, headers={"content-type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("content-type") == "text/event-stream; charset=utf-8"
        assert resp.getheader("transfer-encoding") == "chunked"
        assert resp.getheader("request-id").startswith("req_")
        raw = resp.read().decode()
        # The connection is reusable after the chunked stream ends.
        conn.request(
            "POST", "/v1/messages", body=b"{}", headers={"content-type": "application/json"}
        )
        assert conn.getresponse().status == 400
    finally:
        conn.close()
    blocks = [b for b in raw.split("\n\n") if b]
    names = []
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        name = event_line[len("event: ") :]
        assert json.loads(data_line[len("data: ") :])["type"] == name
        names.append(name)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stream_helper_final_message_sync(make_server, make_client) -> None:
    tool_input = {"query": "weather in Paris", "limit": 5, "nested": {"a": [1, 2, 3]}}
    server = make_server(
        {
            "turns": [
                {
                    "thinking": "I should look this up.",
                    "text": "Let me check that for you.",
                    "tool_use": {"name": "search", "input": tool_input},
                }
            ]
        }
    )
    client = make_client(server)
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == "Let me check that for you."
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "I should look this up."
    assert len(final.content[0].signature) > 10
    assert final.content[1].text == "Let me check that for you."
    assert final.content[2].name == "search"
    assert final.content[2].input == tool_input
    assert final.stop_reason == "tool_use"
    assert final.id.startswith("msg_")


@pytest.mark.asyncio
async def test_stream_helper_final_message_async() -> None:
    tool_input = {"path": "/tmp/x", "flags": ["-a", "-b"]}
    script = {
        "turns": [
            {"text": "Reading the file now.", "tool_use": {"name": "read", "input": tool_input}}
        ]
    }
    with StubServer(script) as server:
        async with anthropic.AsyncAnthropic(
            base_url=server.url, api_key="sk-test", max_retries=0
        ) as client:
            async with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
                final = await stream.get_final_message()
            with pytest.raises(anthropic.InternalServerError):
                await client.messages.create(model=MODEL, max_tokens=64, messages=USER)
    assert final.content[0].text == "Reading the file now."
    assert final.content[1].input == tool_input
    assert final.stop_reason == "tool_use"


@pytest.mark.asyncio
async def test_async_create_plain() -> None:
    with StubServer({"default": {"text": "async ok"}}) as server:
        async with anthropic.AsyncAnthropic(
            base_url=server.url, api_key="sk-test", max_retries=0
        ) as client:
            a = await client.messages.create(model=MODEL, max_tokens=8, messages=USER)
            b = await client.messages.create(model=MODEL, max_tokens=8, messages=USER)
    assert a.content[0].text == b.content[0].text == "async ok"
    assert a.id != b.id
    assert server.served == 2


def test_event_delay_and_delay(make_server, make_client) -> None:
    server = make_server(
        {
            "default": {
                "text": "one two three four five six seven eight",
                "delay_ms": 60,
                "event_delay_ms": 5,
            }
        }
    )
    client = make_client(server)
    t0 = time.perf_counter()
    stream = create(client, stream=True)
    first = next(iter(stream))
    ttft = time.perf_counter() - t0
    rest = list(stream)
    total = time.perf_counter() - t0
    assert first.type == "message_start"
    assert ttft >= 0.055
    assert total - ttft >= 0.005 * (len(rest) - 1)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_overloaded_then_success_with_retries(make_server, make_client) -> None:
    server = make_server(
        {
            "turns": [
                {
                    "error": {
                        "status": 529,
                        "type": "overloaded_error",
                        "message": "Overloaded",
                        "retry_after": 0,
                    }
                },
                {"text": "recovered"},
            ]
        }
    )
    msg = create(make_client(server, max_retries=2))
    assert msg.content[0].text == "recovered"
    assert len(server.requests) == 2
    assert server.served == 2


def test_error_response_body_and_headers(make_server, make_client) -> None:
    server = make_server(
        {
            "turns": [
                {
                    "error": {
                        "status": 529,
                        "type": "overloaded_error",
                        "message": "Overloaded",
                        "retry_after": 2,
                    }
                },
                {
                    "error": {
                        "status": 429,
                        "type": "rate_limit_error",
                        "message": "slow down",
                        "should_retry": False,
                    }
                },
            ]
        }
    )
    client = make_client(server, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as info:
        create(client)
    err = info.value
    assert err.status_code == 529
    assert err.body["type"] == "error"
    assert err.body["error"] == {"type": "overloaded_error", "message": "Overloaded"}
    assert err.body["request_id"].startswith("req_")
    assert err.response.headers["request-id"] == err.body["request_id"]
    assert err.response.headers["retry-after"] == "2"
    assert err.response.headers["retry-after-ms"] == "2000"
    assert "x-should-retry" not in err.response.headers

    # x-should-retry: false stops the SDK from retrying even with retries left.
    retrying = make_client(server, max_retries=2)
    with pytest.raises(anthropic.RateLimitError) as info:
        create(retrying)
    assert info.value.response.headers["x-should-retry"] == "false"
    assert info.value.body["error"]["message"] == "slow down"
    assert len(server.requests) == 2


def test_validation_400_does_not_consume_turn(make_server, make_client) -> None:
    server = make_server({"turns": [{"text": "first"}]})
    with httpx2.Client(base_url=server.url) as http:
        for missing in ("model", "max_tokens", "messages"):
            body = {"model": MODEL, "max_tokens": 5, "messages": USER}
            del body[missing]
            resp = http.post("/v1/messages", json=body)
            assert resp.status_code == 400
            data = resp.json()
            assert data["type"] == "error"
            assert data["error"]["type"] == "invalid_request_error"
            assert missing in data["error"]["message"]
            assert resp.headers["request-id"].startswith("req_")
        resp = http.post(
            "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert resp.status_code == 400
        assert resp.json()["error"]["type"] == "invalid_request_error"
        resp = http.post("/v1/nope", json={})
        assert resp.status_code == 404
        assert resp.json()["error"]["type"] == "not_found_error"
    assert server.served == 0
    assert len(server.requests) == 4
    assert server.requests[-1]["body"] is None
    assert create(make_client(server)).content[0].text == "first"


def test_sse_error_mid_stream(make_server, make_client) -> None:
    sse_error = {"type": "overloaded_error", "message": "Overloaded", "after_events": 4}
    server = make_server(
        {
            "turns": [
                {"text": "partial answer that never finishes", "sse_error": sse_error},
                {"text": "partial", "sse_error": sse_error},
                {"text": "partial", "sse_error": sse_error},
            ]
        }
    )
    client = make_client(server)
    seen = []
    with pytest.raises(anthropic.APIStatusError) as info:
        for event in create(client, stream=True):
            seen.append(event.type)
    # message_start, (ping: skipped by the SDK), content_block_start, one text delta
    assert seen == ["message_start", "content_block_start", "content_block_delta"]
    assert info.value.body["error"] == {"type": "overloaded_error", "message": "Overloaded"}

    with pytest.raises(anthropic.APIError):
        with client.messages.stream(model=MODEL, max_tokens=8, messages=USER) as stream:
            stream.get_final_message()

    # Without streaming the same turn is a plain 529.
    with pytest.raises(anthropic.APIStatusError) as info:
        create(client)
    assert info.value.status_code == 529
    assert info.value.body["error"]["type"] == "overloaded_error"


def test_drop_before_headers(make_server, make_client) -> None:
    server = make_server({"turns": [{"drop": "before_headers"}, {"text": "after drop"}]})
    client = make_client(server, max_retries=0)
    with pytest.raises(anthropic.APIConnectionError):
        create(client)
    assert create(client).content[0].text == "after drop"
    assert len(server.requests) == 2


def test_drop_after_headers(make_server, make_client) -> None:
    server = make_server(
        {
            "turns": [
                {"text": "x", "drop": "after_headers"},
                {"text": "a b c", "drop": "after_headers"},
            ]
        }
    )
    client = make_client(server, max_retries=0)
    with pytest.raises(anthropic.APIConnectionError):
        create(client)
    seen = []
    with pytest.raises((anthropic.APIError, httpx2.TransportError)):
        for event in create(client, stream=True):
            seen.append(event.type)
    assert seen == ["message_start"]


def test_default_turn_and_exhausted_script(make_server, make_client) -> None:
    server = make_server({"turns": [{"text": "scripted"}], "default": {"text": "fallback"}})
    client = make_client(server)
    assert [create(client).content[0].text for _ in range(3)] == [
        "scripted",
        "fallback",
        "fallback",
    ]
    assert server.served == 3

    server = make_server({"turns": [{"text": "only"}]})
    client = make_client(server, max_retries=2)
    assert create(client).content[0].text == "only"
    with pytest.raises(anthropic.InternalServerError) as info:
        create(client)
    assert info.value.status_code == 500
    assert info.value.body["error"]["type"] == "api_error"
    assert info.value.body["error"]["message"].startswith("stub script exhausted: ")
    assert server.served == 1
    assert len(server.requests) == 2  # not retried


def test_load_resets_pointer(make_server, make_client) -> None:
    server = make_server({"turns": [{"text": "one"}]})
    client = make_client(server)
    assert create(client).content[0].text == "one"
    server.load({"turns": [{"text": "two"}, {"text": "three"}]})
    assert server.served == 0
    assert create(client).content[0].text == "two"
    assert server.served == 1


def test_control_endpoints(make_server, make_client) -> None:
    server = make_server({"turns": [{"text": "one"}]})
    client = make_client(server)
    create(client)
    with httpx2.Client(base_url=server.url) as http:
        assert http.get("/_stub/health").json() == {"ok": True, "served": 1}
        reqs = http.get("/_stub/requests").json()
        assert len(reqs) == 1 and reqs[0]["body"]["messages"] == USER
        assert reqs[0]["headers"]["content-type"] == "application/json"
        resp = http.post("/_stub/script", json={"turns": [{"text": "reloaded"}]})
        assert resp.status_code == 200 and resp.json()["ok"] is True
        bad = http.post("/_stub/script", json={"turns": [{"drop": "sometimes"}]})
        assert bad.status_code == 400
        assert "turn 0" in bad.json()["error"]["message"]
    assert create(client).content[0].text == "reloaded"


def test_concurrent_requests_consume_each_turn_once(make_server) -> None:
    n = 40
    server = make_server({"turns": [{"text": f"turn-{i}"} for i in range(n)]})
    texts: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0) as client:
            for _ in range(n // 8):
                text = create(client).content[0].text
                with lock:
                    texts.append(text)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(texts) == sorted(f"turn-{i}" for i in range(n))
    assert server.served == n
