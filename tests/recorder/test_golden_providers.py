"""The golden cassettes of the providers read through another format or carriage than
Anthropic's own: Gemini (``v2_gemini_agent.jsonl``) and Claude on Amazon Bedrock
(``v2_bedrock_agent.jsonl``), as the first deja that read them wrote them. Each must keep
loading, verifying and replaying offline in every later deja, and a changed prompt must
still diverge at its first call (``tests/golden/make_golden.py`` made them; never remake
one to fix a test)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import recorder
import replayer
from recorder.cassette import load
from recorder.cassette.keys import Keyring

GOLDEN = Path(__file__).parents[1] / "golden"
GOLDEN_KEY = "golden-key-deja-v1"
CLOSED_PORT_URL = "http://127.0.0.1:9"  # nothing listens there: a replay must not need it

sys.path.insert(0, str(GOLDEN))  # the agents the cassettes were recorded with
import bedrock_agent  # noqa: E402
import gemini_agent  # noqa: E402

CASES = {"v2_gemini_agent.jsonl": (gemini_agent, "gemini"),
         "v2_bedrock_agent.jsonl": (bedrock_agent, "bedrock")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_golden_cassette_loads_verifies_and_replays_offline(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    agent, provider = CASES[name]
    path = GOLDEN / name
    cassette = load(path, keyring=Keyring.of(GOLDEN_KEY), require_signature=True,
                    allow_incomplete=False)
    assert cassette.verified
    assert [o["kind"] for o in cassette] == ["model", "tool", "model", "tool", "model"]
    models = [o for o in cassette if o["kind"] == "model"]
    assert [o["provider"] for o in models] == [provider] * 3
    assert [o["stream"] for o in models] == [False, True, False]
    raw = [json.loads(line) for line in path.read_bytes().splitlines()]
    stored = [line["request"] for line in raw if line.get("kind") == "model"]
    assert all("base" in request for request in stored[1:]), stored  # stored as deltas

    monkeypatch.setenv("DEJA_KEY", GOLDEN_KEY)
    with replayer.replay(path, require_signature=True) as run:
        assert agent.agent(CLOSED_PORT_URL) == agent.ANSWER
    assert run.result is not None and run.result.identical and run.result.verified
    assert run.result.steps_served == run.result.steps_recorded == 5
    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        agent.agent_changed_prompt(CLOSED_PORT_URL)
    assert info.value.step == 0 and "Rome" in info.value.diff

