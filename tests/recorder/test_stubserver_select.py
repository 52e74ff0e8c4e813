"""The stub server's answers chosen by the request: conversation turns, rules, retries, and
replies sent as recorded (``message``, ``sse``, error headers).
"""

from __future__ import annotations

import http.client
import json
import threading
from typing import Any

import anthropic
import pytest
import stub_helpers
from stub_helpers import MODEL, RECORDED, ROOT, USER, create, raw_request

from recorder.testing.server import StubServer

# Fixtures shared by the test_stubserver files.
make_client = stub_helpers.make_client
make_server = stub_helpers.make_server


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
    return create(client, messages=_conversation(position, tag)).content[0].text


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
    assert create(a, messages=_conversation(1)[:2]).content[0].text == "t1"
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
            create(client, messages=_conversation(0), **_attempt(0))
        assert info.value.status_code == 529
        with pytest.raises(anthropic.APIConnectionError):
            create(client, messages=_conversation(0), **_attempt(1))
        with pytest.raises(anthropic.APIStatusError) as info:
            create(client, messages=_conversation(0), **_attempt(2))  # sse_error, as JSON
        assert info.value.status_code == 529
        # The first entry that is not a failure answers every later attempt.
        assert [create(client, messages=_conversation(0), **_attempt(n)).content[0].text
                for n in (3, 4, 9)] == ["recovered"] * 3
    # No "then": the failure answers attempt 0, later attempts get the default.
    with pytest.raises(anthropic.InternalServerError) as info:
        _ask(client, 1)
    assert info.value.body["error"]["message"] == "boom"
    assert create(client, messages=_conversation(1), **_attempt(1)).content[0].text == "fallback"

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
        create(client, messages=_conversation(0), **_attempt(1))
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
        return create(client, messages=messages).content[0].text

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
        return create(retrying, messages=[{"role": "user", "content": text}]).content[0].text

    assert [ask("x"), ask("ping"), ask("ping"), ask("x")] == ["a", "pong", "pong", "b"]
    retrying = make_client(server, max_retries=2)
    assert [ask("busy", retrying), ask("busy", retrying)] == ["after the 429"] * 2
    with pytest.raises(anthropic.InternalServerError) as info:
        ask("x")  # the sequence is used up
    assert "position 0" in info.value.body["error"]["message"]


# --------------------------------------------------------------------------------------------
# Replies as recorded: message, sse, error headers
# --------------------------------------------------------------------------------------------

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
    status, _, raw = raw_request(server, "POST", "/v1/messages", body)
    assert status == 200 and json.loads(raw) == RECORDED
    # Streamed, it arrives through the SDK's event parser as the same message.
    client = make_client(server)
    with client.messages.stream(model=MODEL, max_tokens=5, messages=USER) as stream:
        final = stream.get_final_message()
    assert final.id == "msg_recorded_01" and final.model == "claude-recorded"
    assert [b.model_dump(exclude_none=True) for b in final.content] == RECORDED["content"]
    assert final.usage.output_tokens == 5


def test_sse_turn_is_sent_verbatim(make_server, make_client) -> None:
    from recorder.providers._anthropic_sse import synthesize

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
    message = create(client)
    assert message.id == "msg_recorded_01"
    assert [b.model_dump(exclude_none=True) for b in message.content] == RECORDED["content"]
    # A recorded stream that failed fails the same way: verbatim, or as a 529 for JSON.
    later = [*USER, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    assert _stream_raw(server, later)[2] == broken
    with pytest.raises(anthropic.APIStatusError) as info:
        create(client, messages=later)
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
        create(make_client(server))
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
        first = create(client, messages=task)
        assert first.stop_reason == "tool_use" and first.content[1].id == "toolu_spiral_1"
        asked = [*task, {"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in first.content]}]

        def after(result: str, is_error: bool, asked: list[dict] = asked) -> Any:
            return create(client, messages=[*asked, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_spiral_1", "content": result,
                 "is_error": is_error}]}])

        retry = after("search failed: malformed response (Unterminated string)", True)
        assert retry.stop_reason == "tool_use"
        assert retry.content[0].text == "The search failed; retrying."
        fixed = after('[{"path": "auth/session.py", "snippet": "def refresh_token(self): ..."}]',
                      False)
        assert fixed.stop_reason == "end_turn"
        assert fixed.content[0].text.startswith("Fixed: refresh_token now ")
