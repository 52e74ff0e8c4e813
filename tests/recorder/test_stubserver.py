"""Tests for recorder.testing.server, driven by the real anthropic SDK over real sockets."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest
from click.testing import CliRunner

import recorder
from deja.cli import main as cli
from recorder.cassette import load
from recorder.testing.server import StubScriptError, StubServer, load_script

ROOT = Path(__file__).resolve().parents[2]
# Not a model name the SDK knows (it warns about deprecated ones, and warnings are errors).
MODEL = "claude-stub-test"
USER = [{"role": "user", "content": "hi"}]


def _create(client: anthropic.Anthropic, **kwargs: object) -> anthropic.types.Message:
    params: dict = {"model": MODEL, "max_tokens": 64, "messages": USER}
    params.update(kwargs)
    return client.messages.create(**params)


@pytest.fixture
def make_server() -> Iterator:
    servers: list[StubServer] = []

    def make(script: dict) -> StubServer:
        server = StubServer(script).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def make_client() -> Iterator:
    clients: list[anthropic.Anthropic] = []

    def make(server: StubServer, max_retries: int = 0) -> anthropic.Anthropic:
        client = anthropic.Anthropic(
            base_url=server.url, api_key="sk-test", max_retries=max_retries
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def _raw(
    server: StubServer, method: str, path: str, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# Plain replies
# --------------------------------------------------------------------------------------------


def test_plain_text_reply(make_server, make_client) -> None:
    server = make_server(
        {"turns": [{"text": "Hello!", "usage": {"input_tokens": 12, "output_tokens": 3}}]}
    )
    client = make_client(server)
    msg = _create(client)
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
    status, headers, raw = _raw(server, "POST", "/v1/messages", body)
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
    msg = _create(client)
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    tool = msg.content[1]
    assert isinstance(tool, anthropic.types.ToolUseBlock)
    assert tool.id == "toolu_given"
    assert tool.name == "search"
    assert tool.input == {"query": "x"}
    assert msg.stop_reason == "tool_use"

    msg = _create(client)
    assert [(b.name, b.input) for b in msg.content] == [("a", {}), ("b", {"k": 1})]
    ids = [b.id for b in msg.content]
    assert all(i.startswith("toolu_") and len(i) == 30 for i in ids)
    assert ids[0] != ids[1]


def test_thinking_block_and_stop_reason_override(make_server, make_client) -> None:
    server = make_server(
        {"turns": [{"thinking": "deep thought", "text": "42", "stop_reason": "max_tokens"}]}
    )
    msg = _create(make_client(server))
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "deep thought"
    assert msg.content[0].signature
    assert msg.stop_reason == "max_tokens"


def test_ids_differ_between_calls(make_server, make_client) -> None:
    server = make_server({"default": {"text": "same", "tool_use": {"name": "t", "input": {}}}})
    client = make_client(server)
    first, second = _create(client), _create(client)
    assert first.id != second.id
    assert first.content[1].id != second.content[1].id
    assert first.content[0].text == second.content[0].text == "same"


def test_echo_placeholder(make_server, make_client) -> None:
    server = make_server({"default": {"text": "you said: {echo}"}})
    client = make_client(server)
    assert _create(client).content[0].text == "you said: hi"
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
    assert _create(client, messages=messages).content[0].text == "you said: result\nmore"


# --------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------


def test_create_stream_events(make_server, make_client) -> None:
    text = "The quick brown fox jumps over the lazy dog again and again."
    server = make_server(
        {"turns": [{"text": text, "tool_use": {"name": "search", "input": {"query": "fox"}}}]}
    )
    client = make_client(server)
    events = list(_create(client, stream=True))
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
    stream = _create(client, stream=True)
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
    msg = _create(make_client(server, max_retries=2))
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
        _create(client)
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
        _create(retrying)
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
    assert _create(make_client(server)).content[0].text == "first"


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
        for event in _create(client, stream=True):
            seen.append(event.type)
    # message_start, (ping: skipped by the SDK), content_block_start, one text delta
    assert seen == ["message_start", "content_block_start", "content_block_delta"]
    assert info.value.body["error"] == {"type": "overloaded_error", "message": "Overloaded"}

    with pytest.raises(anthropic.APIError):
        with client.messages.stream(model=MODEL, max_tokens=8, messages=USER) as stream:
            stream.get_final_message()

    # Without streaming the same turn is a plain 529.
    with pytest.raises(anthropic.APIStatusError) as info:
        _create(client)
    assert info.value.status_code == 529
    assert info.value.body["error"]["type"] == "overloaded_error"


def test_drop_before_headers(make_server, make_client) -> None:
    server = make_server({"turns": [{"drop": "before_headers"}, {"text": "after drop"}]})
    client = make_client(server, max_retries=0)
    with pytest.raises(anthropic.APIConnectionError):
        _create(client)
    assert _create(client).content[0].text == "after drop"
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
        _create(client)
    seen = []
    with pytest.raises((anthropic.APIError, httpx2.TransportError)):
        for event in _create(client, stream=True):
            seen.append(event.type)
    assert seen == ["message_start"]


def test_default_turn_and_exhausted_script(make_server, make_client) -> None:
    server = make_server({"turns": [{"text": "scripted"}], "default": {"text": "fallback"}})
    client = make_client(server)
    assert [_create(client).content[0].text for _ in range(3)] == [
        "scripted",
        "fallback",
        "fallback",
    ]
    assert server.served == 3

    server = make_server({"turns": [{"text": "only"}]})
    client = make_client(server, max_retries=2)
    assert _create(client).content[0].text == "only"
    with pytest.raises(anthropic.InternalServerError) as info:
        _create(client)
    assert info.value.status_code == 500
    assert info.value.body["error"]["type"] == "api_error"
    assert info.value.body["error"]["message"].startswith("stub script exhausted: ")
    assert server.served == 1
    assert len(server.requests) == 2  # not retried


def test_load_resets_pointer(make_server, make_client) -> None:
    server = make_server({"turns": [{"text": "one"}]})
    client = make_client(server)
    assert _create(client).content[0].text == "one"
    server.load({"turns": [{"text": "two"}, {"text": "three"}]})
    assert server.served == 0
    assert _create(client).content[0].text == "two"
    assert server.served == 1


def test_control_endpoints(make_server, make_client) -> None:
    server = make_server({"turns": [{"text": "one"}]})
    client = make_client(server)
    _create(client)
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
    assert _create(client).content[0].text == "reloaded"


def test_concurrent_requests_consume_each_turn_once(make_server) -> None:
    n = 40
    server = make_server({"turns": [{"text": f"turn-{i}"} for i in range(n)]})
    texts: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0) as client:
            for _ in range(n // 8):
                text = _create(client).content[0].text
                with lock:
                    texts.append(text)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(texts) == sorted(f"turn-{i}" for i in range(n))
    assert server.served == n


# --------------------------------------------------------------------------------------------
# Conversation selection
# --------------------------------------------------------------------------------------------


def _conversation(position: int, tag: str = "") -> list[dict]:
    """Messages of a conversation after ``position`` assistant replies, ending with the user."""
    messages: list[dict] = [{"role": "user", "content": f"start{tag}"}]
    for i in range(position):
        messages.append({"role": "assistant", "content": f"reply {i}"})
        messages.append({"role": "user", "content": f"next {i}{tag}"})
    return messages


def _ask(client: anthropic.Anthropic, position: int, tag: str = "") -> str:
    return _create(client, messages=_conversation(position, tag)).content[0].text


def test_conversation_select_serves_by_position(make_server, make_client) -> None:
    script = {
        "select": "conversation",
        "turns": [{"text": "t0"}, {"text": "t1"}, {"text": "t2"}],
        "default": {"text": "fallback"},
    }
    server = make_server(script)
    a, b = make_client(server), make_client(server)
    # A later position first: nothing is consumed, so earlier positions are unaffected.
    assert _ask(a, 2, "a") == "t2"
    # Two clients interleaving the same positions get the same turns.
    assert [_ask(a, 0, "a"), _ask(b, 0, "b"), _ask(a, 1, "a"), _ask(b, 1, "b")] == [
        "t0",
        "t0",
        "t1",
        "t1",
    ]
    # Repeats (a resumed or replaying client) get the same turn again, streaming or not.
    assert [_ask(b, 1, "b") for _ in range(3)] == ["t1"] * 3
    with b.messages.stream(model=MODEL, max_tokens=8, messages=_conversation(0, "b")) as stream:
        assert stream.get_final_message().content[0].text == "t0"
    # A trailing assistant prefill counts as a position too.
    assert _create(a, messages=_conversation(1)[:2]).content[0].text == "t1"
    assert _ask(a, 3) == _ask(b, 9) == "fallback"
    assert server.served == 12

    # Without a default, a request past the end gets the exhausted 500, not retried.
    server.load({"select": "conversation", "turns": [{"text": "only"}]})
    retrying = make_client(server, max_retries=2)
    with pytest.raises(anthropic.InternalServerError) as info:
        _ask(retrying, 1)
    assert info.value.body["error"]["message"].startswith("stub script exhausted")
    assert _ask(retrying, 0) == "only"
    assert server.served == 1


def test_conversation_threads_at_the_same_positions(make_server) -> None:
    server = make_server(
        {"select": "conversation", "turns": [{"text": f"turn-{i}"} for i in range(4)]}
    )
    answers: list[tuple[int, str]] = []
    lock = threading.Lock()

    def worker(tag: str) -> None:
        with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0) as client:
            for position in range(4):
                text = _ask(client, position, tag)
                with lock:
                    answers.append((position, text))

    threads = [threading.Thread(target=worker, args=(str(i),)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 24
    assert all(text == f"turn-{position}" for position, text in answers)


def _attempt(number: int) -> dict:
    """The header the SDK sends on its ``number``-th retry, for a repeat made by hand."""
    return {"extra_headers": {"x-stainless-retry-count": str(number)}}


def test_conversation_failure_turns_follow_the_attempt(make_server, make_client) -> None:
    overloaded = {"status": 529, "retry_after": 0.001}
    script = {
        "select": "conversation",
        "turns": [
            {
                "error": overloaded,
                "then": [
                    {"drop": "before_headers"},
                    {"text": "partial", "sse_error": {"type": "overloaded_error"}},
                    {"text": "recovered"},
                ],
            },
            {"error": {"status": 500, "message": "boom"}},
        ],
        "default": {"text": "fallback"},
    }
    server = make_server(script)
    client = make_client(server)  # no retries: each attempt below is made by hand
    for _ in range(2):  # nothing is remembered: the same attempts get the same answers again
        with pytest.raises(anthropic.APIStatusError) as info:
            _create(client, messages=_conversation(0), **_attempt(0))
        assert info.value.status_code == 529
        with pytest.raises(anthropic.APIConnectionError):
            _create(client, messages=_conversation(0), **_attempt(1))
        with pytest.raises(anthropic.APIStatusError) as info:
            _create(client, messages=_conversation(0), **_attempt(2))  # sse_error, as JSON
        assert info.value.status_code == 529
        # The first entry that is not a failure answers every later attempt.
        assert [_create(client, messages=_conversation(0), **_attempt(n)).content[0].text
                for n in (3, 4, 9)] == ["recovered"] * 3
    # No "then": the failure answers attempt 0, later attempts get the default.
    with pytest.raises(anthropic.InternalServerError) as info:
        _ask(client, 1)
    assert info.value.body["error"]["message"] == "boom"
    assert _create(client, messages=_conversation(1), **_attempt(1)).content[0].text == "fallback"

    # The SDK's own retries walk the chain; a second run gets the same: failure, then ok.
    server.load(
        {"select": "conversation", "turns": [{"error": overloaded, "then": [{"text": "ok"}]}]}
    )
    before = len(server.requests)
    retrying = make_client(server, max_retries=2)
    assert [_ask(retrying, 0), _ask(retrying, 0)] == ["ok", "ok"]
    assert len(server.requests) - before == 4
    sent = [r["headers"]["x-stainless-retry-count"] for r in server.requests[before:]]
    assert sent == ["0", "1", "0", "1"]
    assert server.served == 4

    # Nothing left for the attempt and no default: the exhausted 500.
    server.load({"select": "conversation", "turns": [{"drop": "before_headers"}]})
    with pytest.raises(anthropic.APIConnectionError):
        _ask(client, 0)
    with pytest.raises(anthropic.InternalServerError) as info:
        _create(client, messages=_conversation(0), **_attempt(1))
    assert info.value.body["error"]["message"].startswith("stub script exhausted")


# --------------------------------------------------------------------------------------------
# Rules: answers chosen by what the request says
# --------------------------------------------------------------------------------------------


def _after_tool(result: str, is_error: bool | None = None, first: str = "task A") -> list[dict]:
    """A conversation after one tool call, ending with its result."""
    block: dict = {"type": "tool_result", "tool_use_id": "toolu_1", "content": result}
    if is_error is not None:
        block["is_error"] = is_error
    return [
        {"role": "user", "content": first},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}]},
        {"role": "user", "content": [block]},
    ]


def test_rules_answer_by_the_request_before_turns(make_server, make_client) -> None:
    server = make_server(
        {
            "select": "conversation",
            "rules": [
                {"when": {"tool_result_is_error": False}, "text": "good result"},
                {"when": {"tool_result_contains": "timeout"}, "text": "timed out"},
                {"when": {"position": 0, "first_user": "task B"}, "text": "B starts"},
                {"when": {"last_user_contains": "please"}, "text": "polite"},
                {"when": {"position": 1, "last_user": "exactly this"}, "text": "exact"},
            ],
            "turns": [{"text": "t0"}, {"text": "t1"}],
        }
    )
    client = make_client(server)

    def ask(messages: list[dict]) -> str:
        return _create(client, messages=messages).content[0].text

    assert ask([{"role": "user", "content": "task A"}]) == "t0"
    assert ask([{"role": "user", "content": "task B"}]) == "B starts"
    assert ask([{"role": "user", "content": "task B, please"}]) == "polite"  # not equal
    assert ask(_after_tool('{"hits": 1}', is_error=False)) == "good result"
    assert ask(_after_tool('{"hits": 1}')) == "good result"  # no is_error: not an error
    assert ask(_after_tool("search timeout", is_error=True)) == "timed out"
    assert ask(_after_tool("search failed", is_error=True)) == "t1"  # no rule: the turn
    # Several results: "is_error false" needs all of them to be fine.
    mixed = _after_tool("fine", is_error=False)
    mixed[-1]["content"].append(
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "broken", "is_error": True}
    )
    assert ask(mixed) == "t1"
    mixed[-1]["content"][1]["content"] = [{"type": "text", "text": "a timeout"}]
    assert ask(mixed) == "timed out"  # a result's text blocks count
    exact = [*_after_tool("x")[:2], {"role": "user", "content": "exactly this"}]
    assert ask(exact) == "exact"
    exact[-1]["content"] = "exactly this!"
    assert ask(exact) == "t1"
    assert server.served == 11


def test_rules_keep_the_sequence_pointer_and_walk_their_retries(make_server, make_client) -> None:
    server = make_server(
        {
            "rules": [
                {"when": {"last_user_contains": "ping"}, "text": "pong"},
                {
                    "when": {"last_user_contains": "busy"},
                    "error": {"status": 429, "retry_after": 0.001},
                    "then": [{"text": "after the 429"}],
                },
            ],
            "turns": [{"text": "a"}, {"text": "b"}],
        }
    )
    client = make_client(server)

    def ask(text: str, retrying: anthropic.Anthropic = client) -> str:
        return _create(retrying, messages=[{"role": "user", "content": text}]).content[0].text

    assert [ask("x"), ask("ping"), ask("ping"), ask("x")] == ["a", "pong", "pong", "b"]
    retrying = make_client(server, max_retries=2)
    assert [ask("busy", retrying), ask("busy", retrying)] == ["after the 429"] * 2
    with pytest.raises(anthropic.InternalServerError) as info:
        ask("x")  # the sequence is used up
    assert "position 0" in info.value.body["error"]["message"]


# --------------------------------------------------------------------------------------------
# Replies as recorded: message, sse, error headers
# --------------------------------------------------------------------------------------------

RECORDED = {
    "id": "msg_recorded_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-recorded",
    "content": [
        {"type": "text", "text": "as recorded, Grüße"},
        {"type": "tool_use", "id": "toolu_recorded_01", "name": "search", "input": {"q": "x"}},
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {"input_tokens": 7, "output_tokens": 5},
}


def _stream_raw(server: StubServer, messages: list[dict] = USER) -> tuple[int, str, str]:
    body = json.dumps({"model": MODEL, "max_tokens": 5, "messages": messages, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("POST", "/v1/messages", body=body,
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type") or "", resp.read().decode()
    finally:
        conn.close()


def test_message_turn_is_sent_as_recorded(make_server, make_client) -> None:
    server = make_server({"select": "conversation", "turns": [{"message": RECORDED}]})
    body = json.dumps({"model": MODEL, "max_tokens": 5, "messages": USER}).encode()
    status, _, raw = _raw(server, "POST", "/v1/messages", body)
    assert status == 200 and json.loads(raw) == RECORDED
    # Streamed, it arrives through the SDK's event parser as the same message.
    client = make_client(server)
    with client.messages.stream(model=MODEL, max_tokens=5, messages=USER) as stream:
        final = stream.get_final_message()
    assert final.id == "msg_recorded_01" and final.model == "claude-recorded"
    assert [b.model_dump(exclude_none=True) for b in final.content] == RECORDED["content"]
    assert final.usage.output_tokens == 5


def test_sse_turn_is_sent_verbatim(make_server, make_client) -> None:
    from recorder.sse import synthesize

    raw_stream = synthesize(RECORDED)
    broken = raw_stream.split("event: message_delta")[0] + (
        'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
        '"message":"Overloaded mid-stream"}}\n\n'
    )
    server = make_server(
        {"select": "conversation", "turns": [{"sse": raw_stream}, {"sse": broken}]}
    )
    status, ctype, text = _stream_raw(server)
    assert status == 200 and ctype.startswith("text/event-stream")
    assert text == raw_stream  # byte for byte, event by event
    client = make_client(server)
    # Asked without streaming, the stream is assembled into its message.
    message = _create(client)
    assert message.id == "msg_recorded_01"
    assert [b.model_dump(exclude_none=True) for b in message.content] == RECORDED["content"]
    # A recorded stream that failed fails the same way: verbatim, or as a 529 for JSON.
    later = [*USER, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    assert _stream_raw(server, later)[2] == broken
    with pytest.raises(anthropic.APIStatusError) as info:
        _create(client, messages=later)
    assert info.value.status_code == 529
    assert info.value.body["error"]["message"] == "Overloaded mid-stream"


def test_error_headers_are_sent_as_given(make_server, make_client) -> None:
    server = make_server(
        {
            "turns": [
                {
                    "error": {
                        "status": 429,
                        "type": "rate_limit_error",
                        "message": "slow down",
                        "retry_after": 5,
                        "headers": {
                            "Retry-After": "0",
                            "x-should-retry": "true",
                            "anthropic-ratelimit-requests-remaining": "0",
                        },
                    }
                }
            ]
        }
    )
    with pytest.raises(anthropic.RateLimitError) as info:
        _create(make_client(server))
    headers = info.value.response.headers
    assert headers["retry-after"] == "0"  # the given header wins over retry_after
    assert headers.get_list("retry-after") == ["0"]
    assert headers["retry-after-ms"] == "5000"
    assert headers["x-should-retry"] == "true"
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert info.value.body["error"] == {"type": "rate_limit_error", "message": "slow down"}


def test_the_retry_spiral_script_answers_a_good_result_with_the_fix(
    make_server, make_client
) -> None:
    script = json.loads((ROOT / "examples" / "retry_spiral.stub.json").read_text())
    server = make_server(script)
    client = make_client(server)
    task = [{"role": "user", "content": "Refactor the session refresh in the auth module."}]
    for _ in range(2):  # a second run gets the same answers: nothing is used up
        first = _create(client, messages=task)
        assert first.stop_reason == "tool_use" and first.content[1].id == "toolu_spiral_1"
        asked = [*task, {"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in first.content]}]

        def after(result: str, is_error: bool, asked: list[dict] = asked) -> Any:
            return _create(client, messages=[*asked, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_spiral_1", "content": result,
                 "is_error": is_error}]}])

        retry = after("search failed: malformed response (Unterminated string)", True)
        assert retry.stop_reason == "tool_use"
        assert retry.content[0].text == "The search failed; retrying."
        fixed = after('[{"path": "auth/session.py", "snippet": "def refresh_token(self): ..."}]',
                      False)
        assert fixed.stop_reason == "end_turn"
        assert fixed.content[0].text.startswith("Fixed: refresh_token now ")


# --------------------------------------------------------------------------------------------
# Script validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "needles"),
    [
        ({"turns": [{"text": "ok"}, {"text": 5}]}, ["turn 1", "text"]),
        ({"turns": [{"text": "ok"}, {}, {"tool_use": {"input": {}}}]}, ["turn 2", "tool_use.name"]),
        (
            {"turns": [{"tool_use": [{"name": "a"}, {"name": "b", "input": []}]}]},
            ["turn 0", "tool_use[1].input"],
        ),
        ({"turns": [{"error": {"status": 200}}]}, ["turn 0", "error.status"]),
        ({"turns": [{"text": "a"}, {"drop": "never"}]}, ["turn 1", "drop"]),
        ({"turns": [{"delay_ms": -1}]}, ["turn 0", "delay_ms"]),
        ({"turns": [{"usage": {"input_tokens": "many"}}]}, ["turn 0", "usage.input_tokens"]),
        ({"turns": [{"txt": "typo"}]}, ["turn 0", "txt"]),
        (
            {"turns": [{"error": {"status": 500}, "drop": "before_headers"}]},
            ["turn 0", "error", "drop"],
        ),
        ({"turns": [{"sse_error": {"after_events": -2}}]}, ["turn 0", "sse_error.after_events"]),
        ({"turns": "nope"}, ["turns"]),
        ({"turns": [], "default": {"text": 1}}, ["default", "text"]),
        ({"turns": [], "extra": 1}, ["extra"]),
        ({"select": "random", "turns": []}, ["select", "'random'", "conversation"]),
        ({"select": None}, ["select", "None"]),
        ({"turns": [{"drop": "after_headers", "then": []}]}, ["turn 0", "then", "conversation"]),
        (
            {"select": "conversation", "turns": [{"text": "a", "then": [{"text": "b"}]}]},
            ["turn 0", "then", "error"],
        ),
        (
            {"select": "conversation", "turns": [{"drop": "before_headers", "then": {}}]},
            ["turn 0", "then", "list"],
        ),
        (
            {
                "select": "conversation",
                "turns": [{"text": "a"}, {"error": {"status": 529}, "then": [{"text": 1}]}],
            },
            ["turn 1: then[0]", "text"],
        ),
        (
            {
                "select": "conversation",
                "turns": [{"drop": "before_headers", "then": [{"drop": "x", "then": []}]}],
            },
            ["turn 0: then[0]", "drop"],
        ),
        (
            {
                "select": "conversation",
                "turns": [
                    {"drop": "before_headers", "then": [{"drop": "after_headers", "then": []}]}
                ],
            },
            ["turn 0: then[0]", "nested"],
        ),
        (
            {"select": "conversation", "default": {"drop": "before_headers", "then": []}},
            ["default", "then"],
        ),
        ({"rules": {}}, ["rules", "list"]),
        ({"rules": [{"text": "no when"}]}, ["rule 0", "when"]),
        ({"rules": [{"when": {"positon": 1}, "text": "a"}]}, ["rule 0", "positon"]),
        ({"rules": [{"when": {"position": -1}}]}, ["rule 0", "when.position"]),
        ({"rules": [{"when": {"tool_result_is_error": "no"}}]}, ["rule 0", "is_error"]),
        ({"rules": [{"when": {"first_user": 3}}]}, ["rule 0", "when.first_user"]),
        ({"rules": [{"when": {}, "text": "a", "then": [{"text": "b"}]}]}, ["rule 0", "then"]),
        (
            {"rules": [{"when": {}}, {"when": {}, "drop": "before_headers",
                                      "then": [{"when": {}, "text": "b"}]}]},
            ["rule 1: then[0]", "when"],
        ),
        ({"turns": [{"when": {}, "text": "a"}]}, ["turn 0", "when"]),
        ({"turns": [{"message": {"content": "x"}}]}, ["turn 0", "message", "content"]),
        ({"turns": [{"message": {"content": [{"text": "x"}]}}]}, ["turn 0", "content[0]"]),
        ({"turns": [{"message": RECORDED, "text": "x"}]}, ["turn 0", "'message'", "'text'"]),
        ({"turns": [{"sse": "data: x"}]}, ["turn 0", "sse"]),
        ({"turns": [{"sse": "event: a\n\n", "sse_error": {}}]}, ["turn 0", "sse_error"]),
        ({"turns": [{"sse": "event: a\n\n", "message": RECORDED}]}, ["turn 0", "combined"]),
        (
            {"turns": [{"error": {"status": 529, "headers": {"content-length": "1"}}}]},
            ["turn 0", "content-length"],
        ),
        (
            {"turns": [{"error": {"status": 529, "headers": {"bad name": "1"}}}]},
            ["turn 0", "bad name"],
        ),
        (
            {"turns": [{"error": {"status": 529, "headers": {"retry-after": 1}}}]},
            ["turn 0", "retry-after"],
        ),
        (
            {"turns": [{"error": {"status": 529, "headers": {"x-a": "1\r\nx-b: 2"}}}]},
            ["turn 0", "x-a"],
        ),
    ],
)
def test_load_script_errors_name_the_turn(script: dict, needles: list[str]) -> None:
    with pytest.raises(StubScriptError) as info:
        load_script(script)
    assert isinstance(info.value, ValueError)
    for needle in needles:
        assert needle in str(info.value)


def test_load_script_from_file_and_text(tmp_path: Path) -> None:
    script = {"model": MODEL, "turns": [{"text": "from file"}], "_note": "ignored"}
    path = tmp_path / "script.json"
    path.write_text(json.dumps(script))
    assert load_script(path)["turns"] == [{"text": "from file"}]
    assert load_script(str(path))["model"] == MODEL
    assert load_script(json.dumps(script))["turns"][0]["text"] == "from file"
    assert load_script({"default": {"text": "x"}})["turns"] == []
    with pytest.raises(StubScriptError, match="cannot read"):
        load_script(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    with pytest.raises(StubScriptError, match="invalid JSON"):
        load_script(bad)
    with pytest.raises(StubScriptError):
        StubServer({"turns": [{"drop": 1}]})
    loaded = load_script({"select": "conversation", "turns": [{"drop": "after_headers"}]})
    assert loaded["select"] == "conversation" and "select" not in load_script(script)


def test_select_validated_over_http(make_server, make_client) -> None:
    server = make_server({"turns": [{"text": "one"}]})
    with httpx2.Client(base_url=server.url) as http:
        bad = http.post("/_stub/script", json={"select": "sticky", "turns": []})
        assert bad.status_code == 400
        assert "'select'" in bad.json()["error"]["message"]
        good = http.post("/_stub/script", json={"select": "conversation", "turns": [{"text": "c"}]})
        assert good.status_code == 200
    client = make_client(server)
    assert [_create(client).content[0].text for _ in range(2)] == ["c", "c"]


# --------------------------------------------------------------------------------------------
# Lifecycle
# --------------------------------------------------------------------------------------------


def test_stop_closes_everything() -> None:
    server = StubServer({"default": {"text": "ok"}}).start()
    port = server.port
    assert server.url == f"http://127.0.0.1:{port}"
    with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0) as client:
        assert _create(client).content[0].text == "ok"  # leaves a keep-alive connection open
        # A second keep-alive connection, idle after one request.
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
        idle.sendall(b"GET /_stub/health HTTP/1.1\r\nHost: x\r\n\r\n")
        response = b""
        while not response.endswith(b'"served":1}'):
            response += idle.recv(4096)
        server.stop()
        server.stop()  # idempotent
        assert idle.recv(1) == b""  # closed by the server
        idle.close()
        with pytest.raises(anthropic.APIConnectionError):
            _create(client)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


# --------------------------------------------------------------------------------------------
# deja stub --from CASSETTE, and the README's fork, through the real CLI
# --------------------------------------------------------------------------------------------

SPIRAL_STUB = ROOT / "examples" / "retry_spiral.stub.json"
# The README's fork edit ("Fork a step"), word for word.
README_FIX = ('result={"results": [{"path": "auth/session.py", '
              '"snippet": "def refresh_token(self): ..."}]}')
RETRY_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry")
# The streaming example's model, overloaded once before its first answer.
OVERLOADED_STREAM = {
    "select": "conversation",
    "turns": [
        {
            "error": {"status": 529, "retry_after": 0.01},
            "then": [
                {
                    "text": "Let me check the weather in Lyon first.",
                    "tool_use": {"id": "toolu_weather_1", "name": "get_weather",
                                 "input": {"city": "Lyon"}},
                }
            ],
        },
        {"text": "It is overcast and 14 °C in Lyon. Rain is likely later: take the umbrella."},
    ],
}


def deja(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed CLI, run as a user runs it, from the repository root."""
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=ROOT, timeout=120)


@contextlib.contextmanager
def cli_stub(tmp_path: Path, *args: str) -> Iterator[str]:
    """``deja stub ARGS --port 0`` in its own process; yields its base URL."""
    ready = tmp_path / f"stub-{len(list(tmp_path.glob('stub-*')))}.url"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deja", "stub", *args, "--port", "0", "--ready-file", str(ready)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, f"deja stub exited: {proc.communicate()[1]}"
            assert time.monotonic() < deadline, "deja stub did not start within 60 s"
            time.sleep(0.05)
        yield ready.read_text()
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "serving" in stderr, stderr


def _record(out: Path, url: str, agent: str, *flags: str) -> subprocess.CompletedProcess:
    return deja("record", *flags, "-o", str(out), "--", "python", f"examples/{agent}",
                env={"ANTHROPIC_BASE_URL": url})


def _responses(path: Path) -> list[tuple[int, dict, str]]:
    """What each model call of a run received: status, retry headers, and a 200's body."""
    out = []
    for obs in load(path).observations:
        if obs["kind"] == "model":
            response = obs["response"]
            headers = {k.lower(): v for k, v in response["headers"]}
            retry = {name: headers[name] for name in RETRY_HEADERS if name in headers}
            out.append((response["status"], retry,
                        response["body"] if response["status"] == 200 else ""))
    return out


def test_stub_from_a_cassette_serves_what_the_run_received(tmp_path: Path) -> None:
    parent = tmp_path / "spiral.jsonl"
    with StubServer(SPIRAL_STUB) as server:
        first = _record(parent, server.url, "retry_spiral.py", "--no-loop-guard")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "turn 5: end_turn: The search tool keeps returning malformed data" in first.stdout

    again = [tmp_path / "again-1.jsonl", tmp_path / "again-2.jsonl"]
    with cli_stub(tmp_path, "--from", str(parent)) as url:  # served, no file written
        for run in again:  # a second run gets the same answers: no state is used up
            proc = _record(run, url, "retry_spiral.py", "--no-loop-guard")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert proc.stdout == first.stdout
    assert not list(tmp_path.glob("*.json"))
    for run in again:
        assert _responses(run) == _responses(parent)  # bodies as recorded, ids included
        diff = deja("diff", str(parent), str(run))
        assert diff.returncode == 0, diff.stdout + diff.stderr  # the same run, step by step


def test_stub_from_a_cassette_writes_a_script_that_replays_retries_and_streams(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "stream.jsonl"
    with StubServer(OVERLOADED_STREAM) as server:
        first = _record(parent, server.url, "streaming_agent.py")
    assert first.returncode == 0, first.stdout + first.stderr
    recorded = _responses(parent)
    assert [status for status, _, _ in recorded] == [529, 200, 200]  # the SDK retried once
    assert recorded[0][1] == {"retry-after": "0.01", "retry-after-ms": "10"}

    script = tmp_path / "stream.stub.json"
    made = CliRunner().invoke(cli, ["stub", "--from", str(parent), "-o", str(script)])
    assert made.exit_code == 0, made.output
    assert f"wrote {script}" in made.output and "3 model calls" in made.output
    rules = json.loads(script.read_text())["rules"]
    assert [r["when"]["position"] for r in rules] == [0, 1]
    assert {r["when"]["first_user"] for r in rules} == {"Should I take an umbrella in Lyon today?"}
    assert rules[0]["error"]["status"] == 529 and rules[0]["_seq"] == [0, 1]
    assert rules[0]["error"]["headers"] == {"retry-after": "0.01", "retry-after-ms": "10"}
    assert rules[0]["then"][0]["sse"] == recorded[1][2]

    again = tmp_path / "again.jsonl"
    with cli_stub(tmp_path, "--script", str(script)) as url:
        proc = _record(again, url, "streaming_agent.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == first.stdout
    # The same 529 with its retry headers, then the same event streams byte for byte.
    assert _responses(again) == recorded
    diff = json.loads(deja("diff", str(parent), str(again), "--json").stdout)
    assert diff["same_prefix"] == 2  # the 529 and its retry
    for step in diff["steps"]:  # only the weather's clock differs, and what carries it
        if step["kind_a"] == "model":
            assert all(c["path"].startswith("/request/") for c in step["changes"]), step


def test_stub_from_refuses_what_it_cannot_serve(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    script = tmp_path / "s.json"
    script.write_text('{"turns": []}')
    for args in ([], ["--script", str(script), "--from", str(script)],
                 ["--script", str(script), "-o", str(tmp_path / "x.json")]):
        bad = runner.invoke(cli, ["stub", *args])
        assert bad.exit_code == 2, bad.output
        assert "--from CASSETTE" in bad.output
    missing = runner.invoke(cli, ["stub", "--from", str(tmp_path / "none.jsonl")])
    assert missing.exit_code == 2 and "no cassette at" in missing.output

    no_model = tmp_path / "effects.jsonl"
    with recorder.record(no_model):
        recorder.value("seed", lambda: 42)
    empty = runner.invoke(cli, ["stub", "--from", str(no_model), "-o", str(script)])
    assert empty.exit_code == 2, empty.output
    assert "holds no Anthropic Messages call" in empty.output
    assert script.read_text() == '{"turns": []}'  # nothing written

    parent = tmp_path / "spiral.jsonl"
    with StubServer(SPIRAL_STUB) as server:
        assert _record(parent, server.url, "retry_spiral.py").returncode == 3  # loop guard
    monkeypatch.setenv("DEJA_KEY", "")
    monkeypatch.setenv("DEJA_HOME", str(tmp_path / "no-keys"))
    refused = runner.invoke(cli, ["stub", "--from", str(parent), "-o", str(script)])
    assert refused.exit_code == 2 and "UnverifiedCassette" in refused.output
    allowed = runner.invoke(cli, ["stub", "--from", str(parent), "-o", str(script),
                                  "--allow-unverified"])
    assert allowed.exit_code == 0, allowed.output
    assert "NOT VERIFIED" in allowed.output
    assert len(json.loads(script.read_text())["rules"]) == 3


def test_the_readme_fork_ends_fixed_against_the_bundled_stub(tmp_path: Path) -> None:
    """README "Fork a step": fixing the search result at step 1 ends the run with the fix."""
    parent = tmp_path / "retry_spiral.jsonl"
    fixed = tmp_path / "demo" / "fixed.jsonl"
    with cli_stub(tmp_path, "--script", "examples/retry_spiral.stub.json") as url:
        spiral = _record(parent, url, "retry_spiral.py")
        assert spiral.returncode == 3, spiral.stdout + spiral.stderr  # the loop guard stops it
        assert "stopped by the harness" in spiral.stdout
        forked = deja("fork", str(parent), "--at", "1", "-o", str(fixed), "--set", README_FIX,
                      env={"ANTHROPIC_BASE_URL": url})
        assert forked.returncode == 0, forked.stdout + forked.stderr
        # Runs after it against the same server get the same answers.
        again = _record(tmp_path / "again.jsonl", url, "retry_spiral.py")
        assert again.returncode == 3 and again.stdout.splitlines()[:-1] == \
            spiral.stdout.splitlines()[:-1]
        refork = deja("fork", str(parent), "--at", "1", "-o", str(tmp_path / "fixed-2.jsonl"),
                      "--set", README_FIX, env={"ANTHROPIC_BASE_URL": url})
        assert refork.returncode == 0 and refork.stdout == forked.stdout
    assert '-> [{"path": "auth/session.py", "snippet": "def refresh_token' in forked.stdout
    assert "turn 2: end_turn: Fixed: refresh_token now " in forked.stdout
    assert "search failed" not in forked.stdout
    lines = [json.loads(line) for line in fixed.read_text().splitlines()]
    assert lines[-1]["status"] == "completed" and lines[-1]["exit_code"] == 0
    final = [o for o in load(fixed).observations if o["kind"] == "model"][-1]
    answer = json.loads(final["response"]["body"])
    assert answer["stop_reason"] == "end_turn"
    assert answer["content"][0]["text"].startswith("Fixed: refresh_token now ")
    # The stub is gone; the fixed run replays on its own.
    replayed = deja("replay", str(fixed))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "turn 2: end_turn: Fixed: refresh_token now " in replayed.stdout


def test_a_script_from_a_cassette_tells_conversations_apart(tmp_path: Path) -> None:
    """Two conversations with the same task: the same first request, then different ones."""
    from replayer.stub import script_from_cassette

    def talk(url: str, results: list[str]) -> list[str]:
        got = []
        with anthropic.Anthropic(base_url=url, api_key="sk-test", max_retries=2) as client:
            for result in results:
                task = [{"role": "user", "content": "the task"}]
                first = _create(client, messages=task)
                asked = [*task, {"role": "assistant", "content": first.content[0].text},
                         {"role": "user", "content": result}]
                got += [first.content[0].text, _create(client, messages=asked).content[0].text]
        return got

    recorded_script = {"turns": [
        {"text": "start"}, {"error": {"status": 529, "retry_after": 0.001}},
        {"text": "after x"}, {"text": "start again"}, {"text": "after y"}]}
    cassette = tmp_path / "two.jsonl"
    with StubServer(recorded_script) as server, recorder.record(cassette):
        assert talk(server.url, ["x", "y"]) == ["start", "after x", "start again", "after y"]
    made = script_from_cassette(load(cassette))
    assert made.calls == 5 and made.skipped == ()
    rules = made.script["rules"]
    assert [r["when"] for r in rules] == [
        {"position": 0, "first_user": "the task"},
        {"position": 1, "first_user": "the task", "last_user": "x"},
        {"position": 1, "first_user": "the task", "last_user": "y"},
        {"position": 1, "first_user": "the task"},
    ]
    assert rules[0]["_seq"] == [0]  # the same request sent again later: its first answer
    assert rules[1]["_seq"] == [1, 2] and rules[1]["error"]["status"] == 529
    with StubServer(made.script) as server:
        # "z" was never asked: the first request recorded at its place answers it. The 529
        # of that request is retried by the SDK, as when it was recorded.
        assert talk(server.url, ["y", "x", "z"]) == [
            "start", "after y", "start", "after x", "start", "after x"]
        assert len(server.requests) == 6 + 2
