"""An agent on Pydantic AI (an Anthropic model, one plain tool), unmodified, under
``deja record`` and ``deja replay`` (agents/pydantic_ai_agent.py) and under
``@pytest.mark.deja``; and with its tool under ``@recorder.tool``, whose calls are then
tool steps."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pydantic_ai.models.anthropic  # noqa: F401  imported once, not by each pytester run
import pytest
from framework_helpers import (
    AGENTS,
    ANSWER,
    CHANGED,
    OFFLINE,
    SCRIPT,
    Runs,
    assert_changed_prompt_diverges,
    assert_recorded_and_replayed,
    assert_tool_steps,
    bodies,
    load_agent,
    own_loop,
    record_and_replay_in_process,
    run_cli,
    steps,
)

from recorder.testing.server import StubServer

AGENT = "pydantic_ai_agent.py"
API_KEY = "sk-ant-test-SECRET-pydantic-8a1c"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return run_cli(AGENT, tmp_path_factory.mktemp("pydantic-ai"), "ANTHROPIC_BASE_URL",
                   ANTHROPIC_API_KEY=API_KEY)


def test_pydantic_ai_records_and_replays_bit_for_bit(runs: Runs) -> None:
    assert_recorded_and_replayed(runs, "anthropic", API_KEY)
    first, second = bodies(runs.plain)
    assert first["system"][-1] == {"type": "text", "text": "Answer in one sentence."}
    assert first["stream"] is True  # run_sync streams the reply: a stream replayed
    assert [o["stream"] for o in steps(runs.plain)] == [True, True]
    # a stateless loop: the second call resends the conversation with the tool's result
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][2]["content"][0]["type"] == "tool_result"


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


def inner(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    with own_loop():
        return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


def test_a_marked_test_of_the_agent_records_replays_and_diverges(
        pytester: pytest.Pytester, stub: Callable[[dict], StubServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``@pytest.mark.deja`` on a test that runs the agent: ``--deja-record`` records it
    against the stub, a run with the stub gone replays it, and a changed question fails
    the test with deja's report. (In process: the framework is imported once.)"""
    pytester.makepyfile(agent=(AGENTS / AGENT).read_text())
    pytester.makepyfile(test_agent=f"""
        import pytest
        import agent

        @pytest.mark.deja("cassettes/agent.jsonl")
        def test_agent(capsys):
            agent.main()
            assert capsys.readouterr().out == {ANSWER + chr(10)!r}
    """)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    cassette = pytester.path / "cassettes" / "agent.jsonl"
    server = stub(SCRIPT)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    inner(pytester, "--deja-record").assert_outcomes(passed=1)
    server.stop()
    lines = [json.loads(line) for line in cassette.read_text().splitlines()]
    assert [o.get("kind") for o in lines[1:]] == ["model", "model", "end"]
    assert lines[0]["argv"] == ["python", "-m", "pytest", "test_agent.py::test_agent"]

    monkeypatch.setenv("ANTHROPIC_BASE_URL", OFFLINE)
    inner(pytester).assert_outcomes(passed=1)
    monkeypatch.setenv("AGENT_PROMPT", CHANGED)
    result = inner(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*replay of r_*DIVERGED*",
                                 "*divergence: step 0 (model)*"])
    assert CHANGED in result.stdout.str()
