"""OpenAI Responses requests stored as deltas, as Messages and Chat Completions requests are.

A Responses tool loop sends every ``input`` item so far each turn. Recorded through the
openai SDK against the stub, each request after the first is stored as its base line, the
number of items it keeps and the items it adds (``{"base", "keep", "input"}``), JSON and
streamed alike; every request decodes to the bytes' meaning the server received, with the
fingerprint the live request had, and the loop replays identically. An ``input`` that is
a string is stored whole, and so is a request whose first item is not a recent request's;
one that edits an item further on keeps the items before the edit. A changed delta breaks
the signature chain. The cassette grows linearly: bytes per turn at 800 turns are those
at 50 (whole requests: 16 times as many). A cassette recorded before Responses requests
were delta-encoded (every request whole, ``tests/golden/v2_responses_agent.jsonl``) still
loads, verifies and replays.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

import recorder
import replayer
from recorder import providers
from recorder.capture.exchange import HttpRequest, HttpResponse
from recorder.capture.session import Timing
from recorder.cassette import CassetteWriter, load
from recorder.cassette.keys import Keyring
from recorder.errors import SignatureError
from recorder.testing.server import StubServer

sys.path.insert(0, str(Path(__file__).parents[1] / "golden"))  # its recorded agent
import responses_agent

MODEL = "gpt-4.1"
KEY = b"test-key-0123456789abcdef"  # the DEJA_KEY that conftest sets for every test
CLOSED_PORT_URL = "http://127.0.0.1:9"  # nothing listens there: a replay must not need it
GOLDEN = Path(__file__).parents[1] / "golden"  # tests/golden/make_golden.py writes it
GOLDEN_KEY = "golden-key-deja-v1"
TOOLS = [{"type": "function", "name": "lookup", "description": "Look a word up.",
          "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                         "required": ["word"]}}]
# Every turn calls the tool: the loop ends when the agent has made its calls.
SCRIPT = {"select": "conversation",
          "default": {"text": "Looking up.", "tool_use": {"name": "lookup",
                                                          "input": {"word": "deja"}}}}

Stub = Callable[[dict], StubServer]


def tool_loop(url: str, turns: int, *, stream: bool) -> list[Any]:
    """``turns`` Responses calls, each with every item so far: the reply's output items
    as the SDK gives them back (``input += response.output``) and a
    ``function_call_output`` for each call. Returns the SDK's responses, dumped."""
    finals: list[Any] = []
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0) as c:
        items: list[Any] = [{"role": "user", "content": "What does 'deja' mean?"}]
        for turn in range(turns):
            if stream:
                with c.responses.stream(model=MODEL, input=items, tools=TOOLS) as s:
                    reply = s.get_final_response()
            else:
                reply = c.responses.create(model=MODEL, input=items, tools=TOOLS)
            finals.append(reply.model_dump())
            items += reply.output
            items += [{"type": "function_call_output", "call_id": o.call_id,
                       "output": f"turn {turn}: deja is French for 'already'"}
                      for o in reply.output if o.type == "function_call"]
    return finals


def calls(cassette: Any) -> list[Any]:
    """The model lines of a loaded cassette, restored."""
    return [o for o in cassette if o["kind"] == "model"]


def model_lines(path: Path) -> list[dict[str, Any]]:
    """The model lines as they are on disk (compact, requests stored as deltas)."""
    return [line for line in map(json.loads, path.read_bytes().splitlines()[1:])
            if line.get("kind") == "model"]


def test_the_provider_says_which_field_holds_the_conversation() -> None:
    assert providers.history_field({"model": MODEL, "messages": []}) == "messages"
    assert providers.history_field({"model": MODEL, "input": []}) == "input"
    assert providers.history_field({"model": MODEL, "input": "hi"}) is None  # no list
    assert providers.history_field({"model": MODEL, "prompt": "hi"}) is None
    assert providers.history_field("not a JSON object") is None
    assert providers.get("openai").history_field({"messages": [], "input": []}) == "messages"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_a_responses_tool_loop_is_stored_as_deltas_and_replays(stub: Stub, tmp_path: Path,
                                                               stream: bool) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "loop.jsonl"
    with recorder.record(path):
        recorded = tool_loop(server.url, 5, stream=stream)
    server.stop()
    received = [r["body"] for r in server.requests]
    assert len(received) == 5

    lines = model_lines(path)
    assert "body" in lines[0]["request"]
    for turn, line in enumerate(lines[1:], start=1):
        stored, before = line["request"], received[turn - 1]["input"]
        assert set(stored) - {"reply", "shape"} == {"base", "keep", "input"}, stored
        assert stored["base"] == lines[turn - 1]["seq"]
        assert stored["keep"] == len(before)  # the conversation grew from the last request
        assert stored["input"] == received[turn]["input"][len(before) + 2:]  # after the reply
        assert [i.get("type") for i in stored["input"]] == \
            ["function_call_output"]

    cassette = load(path, keyring=Keyring.of(KEY), require_signature=True)
    openai_provider = providers.get("openai")
    for line, body in zip(calls(cassette), received, strict=True):
        assert cassette.request_of(line["seq"]) == body
        assert line["fp"] == openai_provider.fingerprint("POST", line["url"], body)
        assert line["stream"] is stream

    with replayer.replay(path) as run:
        replayed = tool_loop(CLOSED_PORT_URL, 5, stream=stream)
    assert run.result is not None and run.result.identical, run.result.report()
    assert replayed == recorded


def test_a_string_input_and_a_continued_response_are_stored_whole(stub: Stub,
                                                                  tmp_path: Path) -> None:
    """A string ``input`` is no list of items; a call continued by
    ``previous_response_id`` sends only its new items, which start no recent request."""
    server = stub(SCRIPT)
    path = tmp_path / "strings.jsonl"

    def agent(url: str) -> list[Any]:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0) as c:
            first = c.responses.create(model=MODEL, input="What does 'deja' mean?",
                                       tools=TOOLS)
            again = c.responses.create(model=MODEL, input="What does 'deja' mean?",
                                       tools=TOOLS, max_output_tokens=64)
            call = next(o for o in first.output if o.type == "function_call")
            continued = c.responses.create(
                model=MODEL, previous_response_id=first.id, tools=TOOLS,
                input=[{"type": "function_call_output", "call_id": call.call_id,
                        "output": "French for 'already'"}])
            return [r.model_dump() for r in (first, again, continued)]

    with recorder.record(path):
        recorded = agent(server.url)
    server.stop()
    stored = [line["request"] for line in model_lines(path)]
    assert [set(s) for s in stored] == [{"body"}] * 3
    assert [s["body"] for s in stored] == [r["body"] for r in server.requests]
    with replayer.replay(path) as run:
        assert agent(CLOSED_PORT_URL) == recorded
    assert run.result is not None and run.result.identical


def test_a_request_that_edits_earlier_items_keeps_only_what_precedes_the_edit(
        tmp_path: Path) -> None:
    user = {"role": "user", "content": "What does 'deja' mean?"}
    call = {"type": "function_call", "call_id": "call_1", "name": "lookup",
            "arguments": '{"word":"deja"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "already"}
    answer = {"role": "assistant", "content": "It means 'already'."}
    first = {"model": MODEL, "input": [user, call, output], "tools": TOOLS}
    grown = {"model": MODEL, "input": [user, call, output, answer], "tools": TOOLS}
    edited = {"model": MODEL, "input": [user, call, {**output, "output": "EDITED"}, answer],
              "tools": TOOLS}
    new_first = {"model": MODEL, "input": [{**user, "content": "Another task"}, call],
                 "tools": TOOLS}
    as_string = {"model": MODEL, "input": "What does 'deja' mean?", "tools": TOOLS}
    chat = {"model": MODEL, "messages": [user, call]}  # another field: never its base
    bodies = [first, grown, edited, new_first, as_string, chat]

    path = tmp_path / "edits.jsonl"
    writer = CassetteWriter(path, {}, KEY)
    for body in bodies:
        writer.append({"kind": "model", "url": "http://api.test/v1/responses"},
                      request_body=body, has_request=True)
    writer.close({"status": "completed"})

    stored = [line["request"] for line in model_lines(path)]
    assert stored[0] == {"body": first}
    assert stored[1] == {"base": 0, "keep": 3, "input": [answer]}
    assert stored[2] == {"base": 1, "keep": 2,  # the edited item and all after it
                         "input": [{**output, "output": "EDITED"}, answer]}
    assert stored[3:] == [{"body": new_first}, {"body": as_string}, {"body": chat}]
    cassette = load(path, keyring=Keyring.of(KEY), require_signature=True)
    assert [cassette.request_of(s) for s in range(len(bodies))] == bodies


def test_a_changed_delta_breaks_the_signature_chain(stub: Stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "loop.jsonl"
    with recorder.record(path):
        tool_loop(server.url, 3, stream=False)
    raw = path.read_bytes().splitlines(keepends=True)
    [index] = [i for i, line in enumerate(raw) if b'"keep":4,' in line]
    raw[index] = raw[index].replace(b'"keep":4,', b'"keep":3,')  # drop an item of history
    path.write_bytes(b"".join(raw))
    with pytest.raises(SignatureError, match=f"seq {index - 1}"):
        load(path, keyring=Keyring.of(KEY), require_signature=True)
    with pytest.raises(SignatureError), replayer.replay(path):
        pass


# ---------------------------------------------------------------------------- growth


def _template(stub: Stub) -> tuple[list[tuple[str, str]], bytes]:
    """The headers and body of one real Responses reply of the stub, with a tool call."""
    server = stub(SCRIPT)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0) as c:
        raw = c.responses.with_raw_response.create(model=MODEL, input="hi", tools=TOOLS)
        return list(raw.http_response.headers.items()), raw.http_response.content


def _record_turns(path: Path, turns: int, template: tuple[list[tuple[str, str]], bytes]
                  ) -> None:
    """A Responses tool loop of ``turns`` calls, fed to a recording session as the proxy
    feeds it (``begin_http``, then ``end_http`` with the exchange): the real path of a
    request to its line, without ``turns`` round trips through an SDK. Each request is the
    one before with the turn's items added (the assistant's text, its call, the call's
    output), written as the SDK writes JSON."""
    headers, body = template
    reply_id = json.loads(body)["id"].encode()
    url = "http://api.test/v1/responses"
    tools = json.dumps(TOOLS, separators=(",", ":")).encode()
    items = [b'{"role":"user","content":"What does deja mean?"}']
    session = recorder.RecordSession(path, budgets=recorder.Budgets()).start(intercept=False)
    for turn in range(turns):
        sent = b'{"model":"%s","input":[%s],"tools":%s}' % (MODEL.encode(), b",".join(items),
                                                            tools)
        request = HttpRequest("POST", url, [("content-type", "application/json")], sent)
        session.begin_http(request)
        response = HttpResponse(200, headers, body.replace(reply_id, b"resp_%06d" % turn))
        session.end_http(request, response, Timing(time.time(), 1.0))
        items += [b'{"role":"assistant","content":"Looking up."}',
                  b'{"type":"function_call","call_id":"call_%06d","name":"lookup",'
                  b'"arguments":"{\\"word\\":\\"deja\\"}"}' % turn,
                  b'{"type":"function_call_output","call_id":"call_%06d","output":"turn %d: '
                  b'French for already"}' % (turn, turn)]
    session.close("completed")


def test_a_responses_cassette_grows_linearly(stub: Stub, tmp_path: Path) -> None:
    template = _template(stub)
    per_turn: dict[int, float] = {}
    for turns in (50, 200, 800):
        path = tmp_path / f"grow-{turns}.jsonl"
        _record_turns(path, turns, template)
        per_turn[turns] = path.stat().st_size / turns
        stored = [line["request"] for line in model_lines(path)]
        assert "body" in stored[0] and all(set(s) == {"base", "keep", "input"}
                                           for s in stored[1:])
    assert per_turn[800] <= 1.3 * per_turn[50], per_turn
    assert per_turn[200] <= 1.3 * per_turn[50], per_turn
    # the requests come back whole (the 800-turn file is not loaded: a load hashes every
    # Responses request whole for its fingerprint, seconds at that length)
    cassette = load(tmp_path / "grow-200.jsonl", keyring=Keyring.of(KEY),
                    require_signature=True)
    last = calls(cassette)[-1]
    assert len(cassette.request_of(last["seq"])["input"]) == 1 + 3 * 199


# ---------------------------------------------------------------------------- golden


def test_a_cassette_recorded_before_responses_deltas_loads_and_replays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``v2_responses_agent.jsonl`` stores every Responses request whole: it loads,
    verifies and replays as it did, and a changed prompt still diverges at its first call."""
    path = GOLDEN / "v2_responses_agent.jsonl"
    cassette = load(path, keyring=Keyring.of(GOLDEN_KEY), require_signature=True,
                    allow_incomplete=False)
    assert cassette.verified
    assert [o["kind"] for o in cassette] == ["model", "tool", "model", "tool", "model"]
    assert [set(line["request"]) for line in model_lines(path)] == [{"body"}] * 3
    assert [o["stream"] for o in calls(cassette)] == [False, True, False]
    assert len(cassette.request_of(4)["input"]) == 7

    monkeypatch.setenv("DEJA_KEY", GOLDEN_KEY)
    with replayer.replay(path, require_signature=True) as run:
        assert responses_agent.agent(CLOSED_PORT_URL) == responses_agent.ANSWER
    assert run.result is not None and run.result.identical and run.result.verified
    assert run.result.steps_served == run.result.steps_recorded == 5
    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        responses_agent.agent_changed_prompt(CLOSED_PORT_URL)
    assert info.value.step == 0 and "Rome" in info.value.diff
