"""The typed accessors over deja's conversation shape (recorder.providers.conversation):
the same questions asked of an Anthropic, an OpenAI (Chat Completions and Responses) and a
Gemini call give the same answers, read through each provider's conversation."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from recorder import providers
from recorder.providers import conversation as cv
from recorder.providers.conversation import BlockKind, ToolCall, ToolResult

ANTHROPIC = {"model": "claude-sonnet-4-6", "system": "Be brief.", "max_tokens": 64,
             "messages": [
                 {"role": "user", "content": "find x"},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": "hmm", "signature": "s"},
                     {"type": "text", "text": "looking"},
                     {"type": "tool_use", "id": "toolu_1", "name": "search",
                      "input": {"q": "x"}}]},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": "toolu_1", "content": "found",
                      "is_error": True},
                     {"type": "text", "text": "go on"}]}]}
CHAT = {"model": "gpt-4.1", "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "find x"},
    {"role": "assistant", "content": "looking", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "search", "arguments": '{"q": "x"}'}}]},
    {"role": "tool", "tool_call_id": "call_1",
     "content": [{"type": "text", "text": "found"}]}]}
RESPONSES = {"model": "gpt-4.1", "instructions": "Be brief.", "input": [
    {"role": "user", "content": "find x"},
    {"type": "function_call", "call_id": "call_1", "name": "search",
     "arguments": '{"q": "x"}'},
    {"type": "function_call_output", "call_id": "call_1",
     "output": [{"type": "input_text", "text": "found"}]}]}
GEMINI = {"systemInstruction": {"parts": [{"text": "Be brief."}]}, "contents": [
    {"role": "user", "parts": [{"text": "find x"}]},
    {"role": "model", "parts": [{"text": "looking"},
                                {"functionCall": {"name": "search", "args": {"q": "x"}}}]},
    {"role": "user", "parts": [{"functionResponse": {"name": "search",
                                                     "response": {"hits": ["x.md"]}}}]},
    {"role": "model", "parts": [{"functionCall": {"name": "search", "args": {"q": "y"}}}]},
    {"role": "user", "parts": [{"functionResponse": {"name": "search",
                                                     "response": {"hits": []}}}]}]}


def read(name: str, body: dict[str, Any], message: Any = None) -> cv.Conversation:
    return providers.get(name).conversation(body, message)


def test_block_kinds() -> None:
    assert cv.kind("plain") is BlockKind.TEXT
    assert [cv.kind({"type": t}) for t in (
        "text", "thinking", "redacted_thinking", "image", "tool_use", "tool_result",
        "server_tool_use", "mcp_tool_use", "web_search_tool_result", "document")] == [
        BlockKind.TEXT, BlockKind.THINKING, BlockKind.REDACTED_THINKING, BlockKind.IMAGE,
        BlockKind.TOOL_USE, BlockKind.TOOL_RESULT, BlockKind.SERVER_TOOL_USE,
        BlockKind.SERVER_TOOL_USE, BlockKind.SERVER_TOOL_RESULT, BlockKind.OTHER]
    assert cv.kind({"no": "type"}) is BlockKind.OTHER and cv.kind(3) is BlockKind.OTHER
    assert BlockKind.TOOL_USE == "tool_use"  # the block type's very string
    assert cv.text({"type": "thinking", "thinking": "hmm"}) == "hmm"
    assert cv.text({"type": "tool_use"}) == ""
    assert cv.as_blocks(None) == [] and cv.as_blocks("hi") == [{"type": "text", "text": "hi"}]
    assert cv.as_blocks({"a": 1}) == [{"a": 1}]
    image = cv.image({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                  "data": "AAAA"}})
    assert (image.source_type, image.media_type, image.data, image.url) == \
        ("base64", "image/png", "AAAA", None)


@pytest.mark.parametrize(("name", "body", "result_content"), [
    ("anthropic", ANTHROPIC, "found"),
    ("openai", CHAT, [{"type": "text", "text": "found"}]),
    ("openai", RESPONSES, [{"type": "text", "text": "found"}]),
])
def test_every_provider_answers_alike(name: str, body: dict[str, Any],
                                      result_content: Any) -> None:
    conv = read(name, body)
    turns = cv.turns(conv)
    calls = [call for turn in turns for call in cv.tool_calls(turn)]
    assert calls == [ToolCall("toolu_1" if name == "anthropic" else "call_1", "search",
                              {"q": "x"})]
    results = [r for turn in turns for r in cv.tool_results(turn)]
    assert [(r.tool_use_id, r.content) for r in results] == [(calls[0].id, result_content)]
    assert [cv.text(b) for b in cv.system(conv) if cv.kind(b) is BlockKind.TEXT] == \
        ([] if body is CHAT else ["Be brief."])
    first_user = next(t for t in turns if cv.role(t) == "user")
    assert cv.text_of(first_user) == "find x"
    document = cv.as_request(conv)
    assert cv.request_turns(document) == turns and document["model"] == body["model"]


def test_gemini_calls_and_responses_are_tool_blocks_with_unique_ids() -> None:
    conv = read("gemini", GEMINI)
    turns = cv.turns(conv)
    assert [cv.role(t) for t in turns] == ["user", "assistant", "user", "assistant", "user"]
    assert [[cv.kind(b) for b in cv.blocks(t)] for t in turns[1:3]] == [
        [BlockKind.TEXT, BlockKind.TOOL_USE], [BlockKind.TOOL_RESULT]]
    assert cv.system(conv) == [{"type": "text", "text": "Be brief."}]
    # Gemini names a call without an id by its function: numbered, the n-th result
    # answers the n-th call
    assert cv.numbered_calls(turns) == [ToolCall("search", "search", {"q": "x"}),
                                        ToolCall("search#2", "search", {"q": "y"})]
    assert cv.numbered_results(turns) == [
        (2, ToolResult("search", "search", {"hits": ["x.md"]}, False)),
        (4, ToolResult("search#2", "search", {"hits": []}, False))]


def test_placed_results_read_and_edit_what_the_agent_sent() -> None:
    for name, body, sent in [("openai", RESPONSES, [{"type": "input_text", "text": "found"}]),
                             ("openai", CHAT, [{"type": "text", "text": "found"}]),
                             ("anthropic", ANTHROPIC, "found"),
                             ("gemini", GEMINI, {"hits": ["x.md"]})]:
        body = copy.deepcopy(body)
        provider = providers.get(name)
        placed = cv.placed_results(provider, body)
        assert placed[0].sent == sent  # as sent, not as the conversation reads it
        placed[0].slot.put("edited")  # type: ignore[union-attr]
        assert cv.placed_results(provider, body)[0].sent == "edited"


def test_a_body_alone_is_read_by_the_format_it_is_in() -> None:
    assert cv.reader_of(ANTHROPIC) is providers.get("anthropic")
    assert cv.reader_of(CHAT) is providers.get("openai")  # its role: tool message
    assert cv.reader_of(RESPONSES) is providers.get("openai")
    assert cv.reader_of(GEMINI) is providers.get("gemini")
    assert cv.reader_of({"model": "m"}) is None
    read = cv.read_history(RESPONSES["input"])
    assert read is not None and read[0] is providers.get("openai")
    read = cv.read_history(GEMINI["contents"])
    assert read is not None and read[0] is providers.get("gemini")


def test_a_reply_says_whether_the_turn_goes_on() -> None:
    anthropic, openai, gemini = (providers.get(n) for n in ("anthropic", "openai", "gemini"))
    assert cv.reply_unfinished(anthropic, {"role": "assistant", "content": [],
                                           "stop_reason": "pause_turn"})
    assert not cv.reply_unfinished(anthropic, {"role": "assistant", "stop_reason": "end_turn",
                                               "content": [{"type": "text", "text": "ok"}]})
    assert cv.reply_unfinished(openai, {"object": "response", "status": "completed", "output": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]})
    calls = {"candidates": [{"finishReason": "STOP", "content": {"role": "model", "parts": [
        {"functionCall": {"name": "f", "args": {}}}]}}]}
    assert gemini.stop_reason(calls) == "STOP" and cv.reply_unfinished(gemini, calls)
    text = {"candidates": [{"finishReason": "STOP", "content": {"role": "model",
                                                                "parts": [{"text": "ok"}]}}]}
    assert not cv.reply_unfinished(gemini, text)
    assert cv.stop_unfinished("tool_use") and cv.stop_unfinished("tool_calls")
    assert not cv.stop_unfinished("STOP") and not cv.stop_unfinished("end_turn")


def test_tool_use_ids_made_stable_for_a_comparison() -> None:
    ids: dict[str, str] = {}
    conv = read("anthropic", ANTHROPIC)
    stable = cv.stable_ids(cv.as_request(conv), ids)
    turns = cv.request_turns(stable)
    assert cv.tool_calls(turns[1])[0].id == "tool_use#0"
    assert cv.tool_results(turns[2])[0].tool_use_id == "tool_use#0"
    assert cv.tool_names(cv.as_request(conv)) == {"toolu_1": "search"}
    assert cv.stable_ids({"previous_response_id": "resp_9"}, ids) == \
        {"previous_response_id": "response#1"}
