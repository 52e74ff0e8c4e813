"""OpenAI Responses requests in a cassette: what is stored whole, and a cassette of before.

An ``input`` that is a string is stored whole, and so is a request continued by
``previous_response_id`` (its items start no recent request). A cassette recorded when
every Responses request was stored whole (``tests/golden/v2_responses_agent.jsonl``)
loads, verifies and replays, and a changed prompt diverges at its first call.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

import recorder
import replayer
from recorder.cassette import load
from recorder.cassette.keys import Keyring
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


def calls(cassette: Any) -> list[Any]:
    """The model lines of a loaded cassette, restored."""
    return [o for o in cassette if o["kind"] == "model"]


def model_lines(path: Path) -> list[dict[str, Any]]:
    """The model lines as they are on disk (compact, requests stored as deltas)."""
    return [line for line in map(json.loads, path.read_bytes().splitlines()[1:])
            if line.get("kind") == "model"]


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
