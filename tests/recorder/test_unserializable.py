"""Values deja cannot store surface as ``UnserializableValue``, where and as themselves.

A tool result with a cycle, a lone surrogate, nesting too deep or non-string keys is
refused naming the tool and the step; the refusal is written as the tool's error, so an
agent that catches it records a run whose replay raises the same error at the same step.
A model request whose body has no JSON a cassette can hold (NaN, a number too large for a
float, a lone surrogate escape, nesting deeper than json reads) is refused before it is
sent, from inside the SDK's HTTP path, without being wrapped in ``APIConnectionError`` or
retried; a replay refuses it at the same point. Real SDK, real stub server, real files.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest
from conftest import API_KEY, MODEL

import recorder
import replayer
from recorder.canonical import canonical
from recorder.cassette import load
from recorder.errors import UnserializableValue
from recorder.values import MAX_DEPTH, encode


def _cycle() -> list[Any]:
    items: list[Any] = [1]
    items.append(items)
    return items


def _deep(n: int) -> list[Any]:
    root: list[Any] = []
    node = root
    for _ in range(n):
        node.append([])
        node = node[0]
    return root


BAD = {
    "cycle": (_cycle, "contains itself"),
    "lone_surrogate": (lambda: {"text": "caf\udce9"}, "lone surrogate"),
    "deep": (lambda: _deep(5000), f"more than {MAX_DEPTH} levels"),
    "int_keys": (lambda: {"scores": {1: "a"}}, "keys must be strings"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_encode_names_where_a_value_cannot_be_stored(case: str) -> None:
    make, reason = BAD[case]
    with pytest.raises(UnserializableValue, match=reason) as info:
        encode(make(), where="result of tool 'fetch'")
    assert str(info.value).startswith("result of tool 'fetch'")
    str(info.value).encode("utf-8")  # the message itself can be written


def test_the_writer_refuses_what_has_no_canonical_form() -> None:
    for value in (float("nan"), "\ud800", _cycle(), object()):
        with pytest.raises(UnserializableValue):
            canonical({"v": value})


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_refused_tool_result_is_recorded_and_replays_identical(case: str,
                                                                 tmp_path: Path) -> None:
    make, reason = BAD[case]

    @recorder.tool
    def fetch(page: int) -> Any:
        return make()

    @recorder.tool
    def fine(page: int) -> int:
        return page

    def agent() -> list[str]:
        seen = [str(fine(1))]
        try:
            fetch(2)
        except UnserializableValue as exc:
            seen.append(f"refused: {exc}")
        seen.append(str(fine(3)))
        return seen

    path = tmp_path / f"{case}.jsonl"
    with recorder.record(path):
        recorded = agent()
    assert recorded[0] == "1" and recorded[2] == "3"
    assert reason in recorded[1] and "tool 'fetch' (step 1)" in recorded[1]
    cassette = load(path)
    line = cassette.observations[1]
    assert line["name"] == "fetch" and "result" not in line
    assert line["error"]["type"] == "UnserializableValue"
    assert line["error"]["module"] == "recorder.errors"
    assert cassette.end is not None and cassette.end["totals"]["errors"] == 1

    with replayer.replay(path) as run:
        replayed = agent()
    assert replayed == recorded  # the same error, at the same step
    assert run.result is not None and run.result.identical


REFUSED_BODIES = {  # what a model request's body holds that a cassette cannot hold as JSON
    "nan": (b'{"score":NaN}', "NaN or Infinity"),
    "overflow": (b'{"score":1e999}', "NaN or Infinity"),  # read as an infinity
    "lone_surrogate": (b'{"note":"caf\\udce9"}', "lone surrogate"),
    # deeper than the json module reads, not than orjson does (1,024 levels)
    "deep": (b"[" * 1_000 + b"]" * 1_000, "nested too deeply"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
@pytest.mark.parametrize("case", sorted(REFUSED_BODIES))
def test_a_model_request_cassettes_cannot_hold_is_refused_as_itself_and_never_sent(
        stub, tmp_path: Path, case: str, stream: bool) -> None:
    """Streamed or not, the request is read before it is sent, and refused there."""
    server = stub({"turns": [{"text": "never"}]})
    url = server.url
    metadata, why = REFUSED_BODIES[case]
    body = (b'{"model":"' + MODEL.encode() + b'","max_tokens":8,"metadata":' + metadata
            + b',"messages":[{"role":"user","content":"hi"}]'
            + (b',"stream":true}' if stream else b"}"))

    def agent() -> str:
        client = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=2)
        with client:
            try:
                client.post("/v1/messages", cast_to=httpx2.Response, content=body,
                            options={"headers": {"content-type": "application/json"}})
            except UnserializableValue as exc:
                assert not isinstance(exc, anthropic.APIConnectionError)
                return f"refused: {exc}"
        return "sent"

    path = tmp_path / "nan.jsonl"
    started = time.monotonic()
    with recorder.record(path):
        recorded = agent()
    assert time.monotonic() - started < 2  # no retry, no backoff
    assert recorded.startswith("refused: model request POST ")
    assert why in recorded
    assert server.requests == []  # refused before anything was sent
    assert load(path).observations == ()
    server.stop()
    with replayer.replay(path) as run:
        assert agent() == recorded
    assert run.result is not None and run.result.identical


def test_a_model_response_holding_nan_is_stored_as_text_and_replays_byte_identical(
        serve: Any, tmp_path: Path) -> None:
    """A JSON body with NaN has no canonical form: the model line keeps its exact text."""
    payload = b'{"id":"msg_1","type":"message","content":[],"score":NaN}'
    served = serve(payload)
    url = served.url
    request = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    path = tmp_path / "nan-response.jsonl"
    with recorder.record(path):
        live = httpx2.post(url, json=request, timeout=5).content
    served.stop()
    assert live == payload
    (line,) = load(path).observations
    assert line["kind"] == "model" and line["response"]["body"] == payload.decode()
    assert b"body_json" not in path.read_bytes()
    with replayer.replay(path) as run:
        assert httpx2.post(url, json=request, timeout=5).content == payload
    assert run.result is not None and run.result.identical

