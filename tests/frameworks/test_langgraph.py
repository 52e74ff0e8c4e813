"""An agent on LangGraph with langchain-anthropic (a ``StateGraph`` of a model node and a
``ToolNode``), unmodified, under ``deja record`` and ``deja replay``
(agents/langgraph_agent.py); and with its tool under ``@recorder.tool``, whose calls are
then tool steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from framework_helpers import (
    SCRIPT,
    TOOL_RESULT,
    Runs,
    assert_changed_prompt_diverges,
    assert_recorded_and_replayed,
    assert_tool_steps,
    bodies,
    load_agent,
    record_and_replay_in_process,
    run_cli,
)

from recorder.testing.server import StubServer

AGENT = "langgraph_agent.py"
API_KEY = "sk-ant-test-SECRET-langgraph-5e0f"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return run_cli(AGENT, tmp_path_factory.mktemp("langgraph"), "ANTHROPIC_BASE_URL",
                   ANTHROPIC_API_KEY=API_KEY)


def test_langgraph_records_and_replays_bit_for_bit(runs: Runs) -> None:
    assert_recorded_and_replayed(runs, "anthropic", API_KEY)
    first, second = bodies(runs.plain)
    assert [t["name"] for t in first["tools"]] == ["lookup"]  # bound by bind_tools
    # the graph's state is the conversation: the second call resends it with the result
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    result = second["messages"][2]["content"][0]
    assert (result["type"], result["content"]) == ("tool_result", TOOL_RESULT)


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
