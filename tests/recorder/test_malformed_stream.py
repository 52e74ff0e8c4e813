"""A streamed reply whose events are not what its format sends, recorded and replayed.

An upstream (or a cassette) may send any events. The recorder reads a streamed reply's
message to store the next request, which resends it, as a reference; a reply it cannot
assemble (a block index that is a list, a delta that is a number, a block without an
index, a tool input nested deeper than Python reads) is no reference, and the next
request is stored whole. Recording does not fail, no line is lost, and the cassette
verifies and replays like any other; a reader of the message (the viewer, an edit) says
it cannot read it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MODEL

import recorder
import replayer
from recorder import providers
from recorder.cassette import load
from recorder.cassette.rows import run_totals
from replayer import edit
from viewer import content

START = ("message_start", {"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
    "usage": {"input_tokens": 5, "output_tokens": 1}}})
END = [("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                          "usage": {"output_tokens": 3}}),
       ("message_stop", {"type": "message_stop"})]
USER = {"role": "user", "content": "hi"}
SAID = {"role": "assistant", "content": [{"type": "text", "text": ""}]}
MORE = {"role": "user", "content": "more"}
BROKEN = {
    "an index that is a list": [("content_block_start", {
        "type": "content_block_start", "index": [0],
        "content_block": {"type": "text", "text": ""}})],
    "a delta that is a list": [("content_block_delta", {
        "type": "content_block_delta", "index": 0, "delta": [1, 2]})],
    "a text that is a number": [
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": 7}})],
    "a block without an index": [("content_block_start", {
        "type": "content_block_start", "content_block": {"type": "text", "text": ""}})],
    "a tool input nested deeper than Python reads": [
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "find", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "input_json_delta", "partial_json": "[" * 100_000 + "]" * 100_000}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0})],
}


def _stream(events: list[tuple[str, Any]]) -> bytes:
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n"
                   for name, data in [START, *events, *END]).encode()


def _agent(url: str) -> list[bytes]:
    """Two calls of one conversation, the second resending the first's reply."""
    with httpx.Client() as client:
        return [client.post(url, json={"model": MODEL, "max_tokens": 5, "stream": True,
                                       "messages": messages}).content
                for messages in ([USER], [USER, SAID, MORE])]


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_reply_its_format_cannot_assemble_is_recorded_and_replayed(
        broken: str, serve: Callable[..., Any], tmp_path: Path) -> None:
    body = _stream(BROKEN[broken])
    upstream = serve(body, content_type="text/event-stream")
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        assert _agent(upstream.url) == [body, body]
    upstream.stop()
    cassette = load(path, require_signature=True)
    lines = list(cassette.observations)
    assert [line["kind"] for line in lines] == ["model", "model"]
    assert cassette.end is not None and cassette.end["status"] == "completed"
    assert cassette.replies.get(0) is None  # no reply read: the request resending it
    stored = json.loads(path.read_text().splitlines()[2])["request"]
    assert "reply" not in stored and stored["messages"][0] == SAID  # holds it itself
    assert cassette.requests[1]["messages"] == [USER, SAID, MORE]
    assert run_totals(cassette)["all"]["input_tokens"] == 10
    with replayer.replay(path) as replay:
        assert _agent(upstream.url) == [body, body]
    assert replay.result is not None and replay.result.identical
    # every reader of the message says it cannot read it, none fails
    with pytest.raises(ValueError, match="not the ones its format sends"):
        providers.for_line(lines[0]).message(lines[0]["response"]["headers"], body)
    assert set(content.response_message(lines[0]) or {}) == {"error"}
    with pytest.raises(edit.EditError, match="cannot be read as a message"):
        edit.view(lines[0])
