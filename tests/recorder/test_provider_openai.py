"""The OpenAI provider on bodies the openai SDK really exchanged with the stub server, and
the stub speaking OpenAI: Chat Completions and Responses, JSON and both SSE formats, tool
calls, cached tokens, errors with retry headers, and its answer choice on OpenAI
conversations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

import recorder
from recorder import providers
from recorder.cassette import load
from recorder.providers.openai import OpenAIFormat, normalized_usage
from recorder.testing.match import conversation, last_user_text, position

MODEL = "gpt-4.1"
API_KEY = "sk-openai-test-SECRET-9d2e"
USAGE = {"input_tokens": 120, "output_tokens": 9, "cache_read_input_tokens": 300}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object",
                                     "properties": {"word": {"type": "string"}}}}}]
R_TOOLS = [{"type": "function", "name": "lookup",
            "parameters": TOOLS[0]["function"]["parameters"]}]
TOOL_TURN = {"text": "Looking it up.", "tool_use": {"name": "lookup", "input": {"word": "deja"}},
             "usage": USAGE}
SEAM = providers.get("openai")


def client(url: str, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=max_retries)


def _model_lines(path: Path) -> list[Any]:
    return [o for o in load(path) if o["kind"] == "model"]


def _text(obs: dict[str, Any]) -> str:
    return obs["response"]["body"]


# ------------------------------------------------------------------------ the seam


def test_both_endpoints_are_openai_calls_at_any_host() -> None:
    for url in ("https://api.openai.com/v1/chat/completions", "http://localhost:8000/v1/responses",
                "https://gateway.example/openai/v1/chat/completions/"):
        found = providers.for_url("POST", url)
        assert found is not None and isinstance(found.format, OpenAIFormat), url
    assert providers.for_url("GET", "https://api.openai.com/v1/responses") is None
    assert providers.for_url("POST", "https://api.openai.com/v1/embeddings") is None
    assert SEAM.is_volatile_header("X-Stainless-Retry-Count")
    assert SEAM.is_volatile_header("idempotency-key")
    assert not SEAM.is_volatile_header("openai-organization")


def test_max_tokens_by_api() -> None:
    assert SEAM.request_max_tokens({"messages": [], "max_completion_tokens": 50}) == 50
    assert SEAM.request_max_tokens({"messages": [], "max_tokens": 40}) == 40
    assert SEAM.request_max_tokens({"input": "x", "max_output_tokens": 30}) == 30
    assert SEAM.request_max_tokens({"input": "x"}) is None
    assert SEAM.with_max_tokens({"messages": [], "max_tokens": 900}, 64) == \
        {"messages": [], "max_tokens": 64}
    assert SEAM.with_max_tokens({"input": "x", "max_output_tokens": 900}, 64) == \
        {"input": "x", "max_output_tokens": 64}


def test_usage_is_normalised_to_deja_names() -> None:
    chat = {"prompt_tokens": 420, "completion_tokens": 9, "total_tokens": 429,
            "prompt_tokens_details": {"cached_tokens": 300}}
    responses = {"input_tokens": 420, "output_tokens": 9,
                 "input_tokens_details": {"cached_tokens": 300}}
    assert normalized_usage(chat) == normalized_usage(responses) == USAGE
    assert normalized_usage({"prompt_tokens": 7, "completion_tokens": 3}) == \
        {"input_tokens": 7, "output_tokens": 3}
    assert normalized_usage({"prompt_tokens": "7", "completion_tokens": True}) == {}
    summary = SEAM.summarize(429, [], b'{"error": {"message": "slow", "type": "requests", '
                                      b'"code": "rate_limit_exceeded"}}')
    assert summary == {"error": {"type": "requests", "message": "slow"}}


# ---------------------------------------------------- recorded bodies, read by the seam


def _record_all(stub: Any, path: Path) -> dict[str, Any]:
    server = stub({"default": TOOL_TURN})
    with recorder.record(path), client(server.url) as c:
        msgs: list[Any] = [{"role": "user", "content": "hi"}]
        out = {"chat": c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)}
        with c.chat.completions.stream(model=MODEL, messages=msgs, tools=TOOLS,
                                       stream_options={"include_usage": True}) as s:
            out["chat_stream"] = s.get_final_completion()
        with c.chat.completions.stream(model=MODEL, messages=msgs, tools=TOOLS) as s:
            out["chat_stream_no_usage"] = s.get_final_completion()
        out["response"] = c.responses.create(model=MODEL, input="hi", tools=R_TOOLS)
        with c.responses.stream(model=MODEL, input="hi", tools=R_TOOLS) as s:
            out["response_stream"] = s.get_final_response()
    server.stop()
    return {k: v.model_dump(mode="json") for k, v in out.items()}


def _same_message(assembled: dict[str, Any], sdk: dict[str, Any]) -> None:
    """What the SDK's own object says, the assembled message says too."""
    if "choices" in sdk:
        got, want = assembled["choices"][0], sdk["choices"][0]
        assert got["finish_reason"] == want["finish_reason"]
        assert got["message"]["content"] == want["message"]["content"]
        assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
                for c in got["message"]["tool_calls"]] == \
            [(c["id"], c["function"]["name"], c["function"]["arguments"])
             for c in want["message"]["tool_calls"]]
    else:
        assert [(o["type"], o.get("call_id"), o.get("arguments")) for o in assembled["output"]] \
            == [(o["type"], o.get("call_id"), o.get("arguments")) for o in sdk["output"]]
        assert assembled["output"][0]["content"][0]["text"] == \
            sdk["output"][0]["content"][0]["text"]
        assert assembled["status"] == sdk["status"]
    assert assembled["id"] == sdk["id"] and assembled["model"] == sdk["model"]
    assert normalized_usage(assembled["usage"]) == normalized_usage(sdk["usage"])


def test_the_seam_reads_recorded_json_and_both_stream_formats(stub: Any,
                                                              tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    sdk = _record_all(stub, path)
    lines = _model_lines(path)
    assert [providers.for_line(o) for o in lines] == [SEAM] * 5
    assert [SEAM.is_stream(o["response"]["headers"]) for o in lines] == \
        [False, True, True, False, True]
    # a streamed call records its usage: the include_usage chunk, response.completed
    assert [o["usage"] for o in lines] == [USAGE, USAGE, None, USAGE, USAGE]
    assert [o["stop_reason"] for o in lines] == ["tool_calls"] * 3 + ["completed"] * 2
    for obs, key in zip(lines, sdk, strict=True):
        message = SEAM.message(obs["response"]["headers"], _text(obs))
        _same_message(message, sdk[key])
        assert obs["message_id"] == sdk[key]["id"]
        assert SEAM.stop_reason(message) == obs["stop_reason"]


def test_a_synthesised_stream_is_the_message_again(stub: Any, tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    _record_all(stub, path)
    for obs in _model_lines(path):
        message = SEAM.message(obs["response"]["headers"], _text(obs))
        text = SEAM.synthesize(message)
        assert SEAM.assemble(text) == message
        headers = [("content-type", "text/event-stream")]
        summary = SEAM.summarize(200, headers, text)
        assert summary["usage"] == (obs["usage"] or {})
        assert summary["stop_reason"] == obs["stop_reason"]
        assert summary["message_id"] == obs["message_id"]


def test_a_stream_cut_by_an_error_still_says_what_it_said(stub: Any, tmp_path: Path) -> None:
    server = stub({"default": {**TOOL_TURN, "sse_error": {"after_events": 3,
                                                          "message": "went away"}}})
    path = tmp_path / "cut.jsonl"
    with recorder.record(path), client(server.url) as c:
        with pytest.raises(openai.APIError, match="went away"), c.chat.completions.stream(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]) as s:
            s.get_final_completion()
        with c.responses.create(model=MODEL, input="hi", stream=True) as events:
            kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"] and kinds[-1] == "error"
    chat, response = _model_lines(path)
    assert chat["api_error"] == {"type": "server_error", "message": "went away"}
    assert response["api_error"] == {"type": "server_error", "message": "went away"}
    assert SEAM.assemble(_text(chat))["error"]["message"] == "went away"
    assert SEAM.assemble(_text(response))["error"]["message"] == "went away"


# ------------------------------------------------------------- the stub speaks OpenAI


def test_errors_carry_openai_bodies_and_retry_headers(stub: Any) -> None:
    server = stub({"select": "conversation", "turns": [
        {"error": {"status": 429, "retry_after": 0}, "then": [{"text": "second try"}]}]})
    with client(server.url, max_retries=2) as c:
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert raw.parse().choices[0].message.content == "second try"
        assert raw.retries_taken == 1  # the SDK waited as told (0 s) and retried
    with client(server.url, max_retries=0) as c, pytest.raises(openai.RateLimitError) as info:
        c.responses.create(model=MODEL, input="hi")
    assert info.value.body == {"message": "Rate limit reached for requests. Please try again "
                                          "later.", "type": "requests", "param": None,
                               "code": "rate_limit_exceeded"}
    assert info.value.response.headers["retry-after"] == "0"
    assert info.value.response.headers["retry-after-ms"] == "0"
    assert info.value.response.headers["x-request-id"].startswith("req_")
    with client(server.url) as c, pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="", messages=[])


def test_rules_read_openai_conversations(stub: Any) -> None:
    server = stub({"select": "conversation",
                   "rules": [{"when": {"tool_result_contains": "French"}, "text": "got it"},
                             {"when": {"last_user": "ping"}, "text": "pong"}],
                   "turns": [TOOL_TURN, {"text": "turn 1"}, {"text": "turn 2"}]})
    with client(server.url) as c:
        first = c.chat.completions.create(model=MODEL, messages=[
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
        call = first.choices[0].message.tool_calls[0]
        history = [{"role": "user", "content": "hi"},
                   first.choices[0].message.model_dump(exclude_none=True)]
        answer = c.chat.completions.create(model=MODEL, messages=[
            *history, {"role": "tool", "tool_call_id": call.id, "content": "French word"}])
        assert answer.choices[0].message.content == "got it"
        other = c.chat.completions.create(model=MODEL, messages=[
            *history, {"role": "tool", "tool_call_id": call.id, "content": "no idea"}])
        assert other.choices[0].message.content == "turn 1"
        assert c.responses.create(model=MODEL, input="ping").output_text == "pong"
        r0 = c.responses.create(model=MODEL, input=[{"role": "user", "content": "hi"}])
        fc = r0.output[1]
        out = {"type": "function_call_output", "call_id": fc.call_id, "output": "French"}
        items = [{"role": "user", "content": "hi"},
                 *[o.model_dump(exclude_none=True) for o in r0.output], out]
        assert c.responses.create(model=MODEL, input=items).output_text == "got it"
        # continued on the server side: the position comes from the previous response
        r1 = c.responses.create(model=MODEL, previous_response_id=r0.id,
                                input=[{**out, "output": "no idea"}])
        assert r1.output_text == "turn 1"
        r2 = c.responses.create(model=MODEL, previous_response_id=r1.id, input="and?")
        assert r2.output_text == "turn 2"


def test_conversations_in_either_format_read_alike() -> None:
    anthropic_body = {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "done"}]}]}
    chat_body = {"messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "done"}]}
    responses_body = {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "t1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "t1", "output": "done"}]}
    assert conversation(anthropic_body) == anthropic_body["messages"]
    for body in (anthropic_body, chat_body, responses_body):
        assert position(body) == 1
        assert last_user_text(body) == "done"
        assert [m["role"] for m in conversation(body)] == ["user", "assistant", "user"]
    assert position({"input": "hi", "previous_response_id": "resp_3_abc"}) == 4
    assert position({"input": "hi", "previous_response_id": "resp_abc"}) == 0


def test_a_recorded_anthropic_message_turn_answers_in_openai_format(stub: Any) -> None:
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
               "content": [{"type": "text", "text": "recorded"},
                           {"type": "tool_use", "id": "toolu_1", "name": "lookup",
                            "input": {"word": "x"}}],
               "stop_reason": "tool_use", "usage": USAGE}
    server = stub({"default": {"message": message}})
    with client(server.url) as c:
        chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}])
        with c.responses.stream(model=MODEL, input="q") as s:
            response = s.get_final_response()
    assert chat.choices[0].message.content == "recorded"
    assert chat.choices[0].message.tool_calls[0].id == "toolu_1"
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == {"word": "x"}
    assert chat.usage is not None and chat.usage.prompt_tokens == 420
    assert response.output_text == "recorded" and response.output[1].call_id == "toolu_1"
