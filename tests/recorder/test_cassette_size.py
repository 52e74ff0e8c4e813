"""What a cassette stores once: an answer the agent sends back, and the response headers.

An agent sends each answer back in its next request as its SDK returned it: the anthropic
SDK's ``msg.content`` (its blocks in the SDK's field order, not the API's), the openai
SDK's chat message or Responses output items, google-genai's content. The cassette refers
to the answer (``reply``) with the key order it was sent in (``shape``, once a run), and
stores every response's headers as the edits of an earlier line's (the few that change
every call). These tests record real SDKs against the stub server and hold what comes back
out to the bytes the server received, and a replay with the server gone to the recording.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

import recorder
import replayer
from recorder.cassette import _delta, _headers, _shape, load
from recorder.cassette.keys import Keyring
from recorder.errors import UnsupportedFormat
from recorder.testing.server import StubServer
from tests.tamper import join, resign

KEY = b"test-key-0123456789abcdef"  # the DEJA_KEY that conftest sets for every test
CLOSED_PORT_URL = "http://127.0.0.1:9"  # nothing listens there: a replay must not need it
MODEL = "claude-stub-test"
TURNS = 5
TOOLS: list[Any] = [{"name": "search", "description": "Search.",
                     "input_schema": {"type": "object",
                                      "properties": {"query": {"type": "string"},
                                                     "limit": {"type": "integer"}}}}]
CHAT_TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "search", "parameters": TOOLS[0]["input_schema"]}}]


def script(turns: int = TURNS) -> dict[str, Any]:
    """Text + tool_use answers with the stub's random tool-use ids; each answer's text is
    its own (``answer-<k>-only-once``), so a file that holds it twice shows."""
    out: list[dict[str, Any]] = [
        {"text": f"answer-{k}-only-once",
         "tool_use": {"name": "search", "input": {"query": f"q{k}", "limit": k}}}
        for k in range(turns - 1)]
    return {"select": "conversation", "turns": [*out, {"text": "done-only-once"}]}


def messages_agent(url: str, *, stream: bool = False) -> list[str]:
    """The agent loop most code is: each answer goes back as ``msg.content``."""
    texts = []
    with anthropic.Anthropic(base_url=url, api_key="sk-test", max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": "find it"}]
        while True:
            if stream:
                with client.messages.stream(model=MODEL, max_tokens=64, tools=TOOLS,
                                            messages=messages) as events:
                    msg = events.get_final_message()
            else:
                msg = client.messages.create(model=MODEL, max_tokens=64, tools=TOOLS,
                                             messages=messages)
            texts.append(msg.content[0].text)
            messages.append({"role": "assistant", "content": msg.content})
            uses = [b for b in msg.content if b.type == "tool_use"]
            if not uses:
                return texts
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": f"result of {u.id}"}
                for u in uses]})


def chat_agent(url: str) -> list[str]:
    """The same loop in Chat Completions: each answer goes back as the SDK's message."""
    texts = []
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": "find it"}]
        while True:
            message = client.chat.completions.create(
                model="gpt-4.1", messages=messages, tools=CHAT_TOOLS).choices[0].message
            texts.append(message.content or "")
            messages.append(message)
            if not message.tool_calls:
                return texts
            messages += [{"role": "tool", "tool_call_id": call.id, "content": "result"}
                         for call in message.tool_calls]


def text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def model_lines(path: Path) -> list[dict[str, Any]]:
    return [line for line in map(json.loads, path.read_bytes().splitlines()[1:])
            if line.get("kind") == "model"]


def assert_rebuilt_exactly(path: Path, server: StubServer) -> None:
    """Every request the reader rebuilds has the JSON text the server received: the same
    keys in the same order, the same values of the same types."""
    cassette = load(path, keyring=Keyring.of(KEY), require_signature=True)
    received = [r["body"] for r in server.received()]
    steps = [o for o in cassette if o["kind"] == "model"]
    assert len(steps) == len(received)
    for step, body in zip(steps, received, strict=True):
        assert text(cassette.request_of(step["seq"])) == text(body), step["seq"]


def assert_answers_are_references(path: Path) -> None:
    """(a) every request after the first refers to the answer before it instead of
    storing it, and no answer's text is in the file twice."""
    lines = model_lines(path)
    for before, line in itertools.pairwise(lines):
        stored = line["request"]
        assert stored["reply"] == before["seq"], stored
        added = stored[_delta.history_of(stored)]
        assert all(item.get("role") != "assistant" for item in added), added
    data = path.read_bytes()
    for k in range(TURNS - 1):
        assert data.count(f"answer-{k}-only-once".encode()) == 1
    assert data.count(b"done-only-once") == 1


def assert_headers_stored_once(path: Path) -> None:
    """(b) a response header that repeats is on disk once: later lines hold edits."""
    lines = model_lines(path)
    assert all(isinstance(pair, list) for pair in lines[0]["response"]["headers"])
    for line in lines[1:]:
        headers = line["response"]["headers"]
        assert _headers.is_edits(headers), headers
        names = [step[0] for step in headers if isinstance(step, list)]
        assert "server" not in names and "content-type" not in names
    assert path.read_bytes().count(b"deja-stub/1.0") == 1


# ---------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_an_answer_resent_as_the_sdk_returned_it_is_a_reference_and_replays_bit_for_bit(
        stub: Any, tmp_path: Path, stream: bool) -> None:
    server = stub(script())
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        recorded = messages_agent(server.url, stream=stream)
    server.stop()

    header = json.loads(path.read_bytes().splitlines()[0])
    assert header["features"] == ["reply_shapes", "header_edits", "tool_calls"]
    lines = model_lines(path)
    assert isinstance(lines[1]["request"]["shape"], list)  # learned once...
    assert all(line["request"]["shape"] == lines[1]["seq"] for line in lines[2:])  # ...used
    assert_answers_are_references(path)
    assert_headers_stored_once(path)
    assert_rebuilt_exactly(path, server)

    with replayer.replay(path, require_signature=True) as run:
        replayed = messages_agent(CLOSED_PORT_URL, stream=stream)
    assert run.result is not None and run.result.identical, run.result.report()
    assert replayed == recorded


def test_a_chat_completions_message_resent_by_the_sdk_is_a_reference(
        stub: Any, tmp_path: Path) -> None:
    server = stub(script())
    path = tmp_path / "chat.jsonl"
    with recorder.record(path):
        recorded = chat_agent(server.url)
    server.stop()

    assert_answers_are_references(path)
    assert_headers_stored_once(path)
    assert_rebuilt_exactly(path, server)
    with replayer.replay(path, require_signature=True) as run:
        assert chat_agent(CLOSED_PORT_URL) == recorded
    assert run.result is not None and run.result.identical, run.result.report()


def test_an_answer_sent_back_changed_is_stored_as_sent(stub: Any, tmp_path: Path) -> None:
    """An agent that edits the answer before it sends it back (here: it drops the text)
    sends something else: that is stored, never a reference that would rebuild the
    answer."""
    server = stub(script(3))
    path = tmp_path / "edited.jsonl"
    with recorder.record(path), anthropic.Anthropic(base_url=server.url, api_key="sk-test",
                                                     max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": "find it"}]
        for _ in range(3):
            msg = client.messages.create(model=MODEL, max_tokens=64, tools=TOOLS,
                                         messages=messages)
            uses = [b for b in msg.content if b.type == "tool_use"]
            messages.append({"role": "assistant", "content": uses or msg.content})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": "r"} for u in uses]
                or "go on"})
    server.stop()
    for line in model_lines(path)[1:]:
        assert "reply" not in line["request"]
        assert line["request"]["messages"][0]["role"] == "assistant"
    assert_rebuilt_exactly(path, server)


def test_a_cassette_naming_a_feature_this_deja_does_not_read_is_refused(
        stub: Any, tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        messages_agent(stub(script(2)).url)
    docs = [json.loads(line) for line in path.read_bytes().splitlines()]
    docs[0]["features"] = [*docs[0]["features"], "from_the_future"]
    future = tmp_path / "future.jsonl"
    future.write_bytes(join(resign(docs, KEY)))
    with pytest.raises(UnsupportedFormat, match="from_the_future"):
        load(future, keyring=Keyring.of(KEY), require_signature=True)


# ---------------------------------------------------------------------------- storage forms


def test_a_shape_says_the_key_order_and_the_nulls_an_sdk_sends() -> None:
    answer = [{"role": "assistant", "content": [
        {"type": "text", "text": "hi"},
        {"type": "tool_use", "id": "t1", "name": "s", "input": {"b": 1, "a": 2}}]}]
    sent = [{"role": "assistant", "content": [
        {"citations": None, "text": "hi", "type": "text"},
        {"id": "t1", "input": {"b": 1, "a": 2}, "name": "s", "type": "tool_use"}]}]
    shape = _shape.learn(answer, sent)
    assert shape is not None
    assert _shape.fits(answer, _shape.merged(None, shape), text(sent))
    stored = _shape.stored(_shape.merged(None, shape))
    assert [["type", "text"], ["citations", "text", "type"]] in stored
    assert all(pair[0] != pair[1] for pair in stored)  # objects sent as they are: not stored


@pytest.mark.parametrize("sent", [
    [{"role": "assistant", "content": [{"text": "hi!", "type": "text"}]}],  # another value
    [{"role": "assistant", "content": [{"text": "hi", "type": "text", "x": 1}]}],  # a field
    [{"role": "assistant", "content": [{"text": "hi", "type": "text"},
                                       {"type": "text", "text": "hi"}]}],  # one more block
])
def test_a_shape_is_only_a_key_order_never_another_value(sent: Any) -> None:
    answer = [{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]
    shape = _shape.learn(answer, sent)
    assert shape is None or not _shape.fits(answer, shape, text(sent))


def test_two_orders_for_the_same_keys_are_no_shape() -> None:
    answer = [{"a": {"x": 1, "y": 2}, "b": {"x": 1, "y": 2}}]
    sent = [{"a": {"y": 2, "x": 1}, "b": {"x": 1, "y": 2}}]
    assert _shape.learn(answer, sent) is None


def test_the_encoder_refers_to_the_shape_it_stored_and_learns_more_when_it_must() -> None:
    encoder = _delta.DeltaEncoder()
    tool = {"type": "tool_use", "id": "t", "name": "s", "input": {}}
    answers = [[{"role": "assistant", "content": [{"type": "text", "text": f"a{k}"}]}]
               for k in range(3)]
    answers[2][0]["content"].append(tool)
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    shapes: dict[int, Any] = {}
    bodies: dict[int, Any] = {}
    for seq, answer in enumerate(answers):
        stored = encoder.encode(seq, body)
        rebuilt = _delta.decode(json.loads(text(stored)), bodies, dict(enumerate(answers)),
                                shapes=shapes, seq=seq)
        assert text(rebuilt) == text(body)
        bodies[seq] = rebuilt
        encoder.written(seq, body, answer)
        resent = [{"content": [{k: b[k] for k in sorted(b)} for b in answer[0]["content"]],
                   "role": "assistant"}]
        body = {**body, "messages": [*body["messages"], *resent,
                                     {"role": "user", "content": f"go {seq}"}]}
    final = encoder.encode(3, body)
    assert isinstance(final["shape"], list)  # the tool_use block is new: learned, inline
    assert encoder.encode(3, body)["reply"] == 2


def test_without_shapes_only_an_exact_resend_is_a_reference() -> None:
    encoder = _delta.DeltaEncoder(shapes=False)
    answer = [{"role": "assistant", "content": [{"type": "text", "text": "a"}]}]
    first = {"messages": [{"role": "user", "content": "q"}]}
    encoder.encode(0, first)
    encoder.written(0, first, answer)
    reordered = {"content": [{"text": "a", "type": "text"}], "role": "assistant"}
    assert "reply" not in encoder.encode(1, {"messages": [*first["messages"], reordered]})
    assert encoder.encode(1, {"messages": [*first["messages"], *answer]})["reply"] == 0


@pytest.mark.parametrize("base, headers", [
    ([["a", "1"], ["b", "2"], ["c", "3"]], [["a", "1"], ["b", "9"], ["c", "3"]]),
    ([["a", "1"], ["b", "2"], ["c", "3"]], [["a", "1"], ["c", "3"]]),  # one left out
    ([["a", "1"], ["b", "2"]], [["a", "1"], ["x", "0"], ["b", "2"], ["y", "1"]]),  # new ones
    ([["a", "1"], ["b", "2"], ["c", "3"]], [["a", "1"]]),  # the last ones left out
    ([["s", "1"], ["s", "2"], ["t", "3"]], [["s", "2"], ["t", "4"], ["s", "1"]]),  # repeats
    ([], [["a", "1"]]),
    ([["a", "1"]], []),
    ([["a", "1"], ["b", "2"]], [["a", "1"], ["b", "2"]]),  # the same: [0]
])
def test_header_edits_make_exactly_the_headers_received(base: Any, headers: Any) -> None:
    script = _headers.edits(base, headers)
    assert _headers.is_edits(script)
    assert _headers.applied(base, script) == headers
    if base == headers:
        assert script == [0]


def test_header_edits_store_only_what_changed() -> None:
    base = [["server", "s"], ["date", "d1"], ["content-type", "application/json"],
            ["request-id", "req_1"], ["content-length", "400"]]
    now = [*base[:3], ["request-id", "req_2"], ["content-length", "401"]]
    assert _headers.edits(base, now) == [3, "req_2", "401"]
