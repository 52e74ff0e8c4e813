"""An agent on the anthropic SDK's tool runner (``client.beta.messages.tool_runner``),
unmodified, under ``deja record`` and ``deja replay`` (agents/tool_runner_agent.py); and
with its tool under ``@recorder.tool``, whose calls are then tool steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from framework_helpers import (
    SCRIPT,
    Runs,
    assert_changed_prompt_diverges,
    assert_recorded_and_replayed,
    assert_tool_steps,
    bodies,
    load_agent,
    record_and_replay_in_process,
    run_cli,
    steps,
)

from recorder.testing.server import StubServer

AGENT = "tool_runner_agent.py"
API_KEY = "sk-ant-test-SECRET-runner-3b7d"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return run_cli(AGENT, tmp_path_factory.mktemp("tool-runner"), "ANTHROPIC_BASE_URL",
                   ANTHROPIC_API_KEY=API_KEY)


def test_the_tool_runner_records_and_replays_bit_for_bit(runs: Runs) -> None:
    assert_recorded_and_replayed(runs, "anthropic", API_KEY)


def test_the_runner_continues_a_server_side_thread_by_the_recorded_id(runs: Runs) -> None:
    """The runner keeps the conversation on the server (the message-threads beta): its
    second request sends the tool result and the id of the first reply, which the replay
    serves as recorded, so the request made again is the same."""
    first, second = bodies(runs.plain)
    assert first["thread"] == {"type": "create"}
    assert second["thread"] == {"type": "continue",
                                "previous_message_id": steps(runs.plain)[0]["message_id"]}
    assert [m["role"] for m in second["messages"]] == ["user"]
    assert [block["type"] for block in second["messages"][0]["content"]] == ["tool_result"]


def test_a_changed_prompt_diverges(runs: Runs) -> None:
    assert_changed_prompt_diverges(runs)


def test_a_tool_under_recorder_tool_is_a_tool_step(
        runs: Runs, stub: Callable[[dict], StubServer], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    server = stub(SCRIPT)
    agent = load_agent(AGENT, monkeypatch, ANTHROPIC_BASE_URL=server.url,
                       ANTHROPIC_API_KEY=API_KEY)
    path = tmp_path / "decorated.jsonl"
    record_and_replay_in_process(agent, path, server, capsys)
    assert_tool_steps(path, runs.plain)
