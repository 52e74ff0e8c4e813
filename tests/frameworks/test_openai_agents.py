"""An agent on the OpenAI Agents SDK (an ``Agent`` with a ``@function_tool``, run on the
SDK's default, the Responses API), unmodified, under ``deja record`` and ``deja replay``
(agents/openai_agents_agent.py); with its tool under ``@recorder.tool``, whose calls are
then tool steps; and what its tracing, on by default, does to a replay."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

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
    output,
    record_and_replay_in_process,
    run_cli,
    steps,
)

from recorder.testing.server import StubServer

AGENT = "openai_agents_agent.py"
API_KEY = "sk-openai-test-SECRET-agents-71c4"
NO_TRACING = {"OPENAI_AGENTS_DISABLE_TRACING": "1"}  # the SDK's own switch
TRACE_INGEST = "https://api.openai.com/v1/traces/ingest"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return run_cli(AGENT, tmp_path_factory.mktemp("openai-agents"), "OPENAI_BASE_URL", "/v1",
                   OPENAI_API_KEY=API_KEY, **NO_TRACING,
                   replays={"traced": {"OPENAI_AGENTS_DISABLE_TRACING": "0"}})


def test_the_agents_sdk_records_and_replays_bit_for_bit(runs: Runs) -> None:
    assert_recorded_and_replayed(runs, "openai", API_KEY)
    assert [urlsplit(o["url"]).path for o in steps(runs.plain)] == ["/v1/responses"] * 2
    first, second = bodies(runs.plain)
    assert first["instructions"] == "Answer in one sentence."
    assert [t["name"] for t in first["tools"]] == ["lookup"]
    # the SDK resends the items so far (no previous_response_id) with the tool's output
    assert "previous_response_id" not in second
    output_item = second["input"][-1]
    assert (output_item["type"], output_item["output"]) == ("function_call_output",
                                                            TOOL_RESULT)


def test_a_changed_prompt_diverges(runs: Runs) -> None:
    assert_changed_prompt_diverges(runs)


def test_with_tracing_on_the_trace_upload_is_a_call_the_replay_refuses(runs: Runs) -> None:
    """Tracing is on by default: at exit the SDK posts its spans to OpenAI's trace
    endpoint, a call of its own (not to the base URL) whose body holds random trace and
    span ids and wall-clock times, so no recording of it could replay. The replay does
    not let it out: it is reported as a divergence after the last recorded step."""
    proc = runs.replayed["traced"]
    assert proc.returncode == 1, output(proc)
    assert f"the agent sent a http request (POST {TRACE_INGEST})" in proc.stdout, output(proc)
    assert '"id": "trace_' in proc.stdout and '"started_at": "' in proc.stdout
    assert "2/2 served" in proc.stdout  # the model calls replayed as recorded


def test_a_tool_under_recorder_tool_is_a_tool_step(
        runs: Runs, stub: Callable[[dict], StubServer], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    server = stub(SCRIPT)
    agent = load_agent(AGENT, monkeypatch, OPENAI_BASE_URL=f"{server.url}/v1",
                       OPENAI_API_KEY=API_KEY, **NO_TRACING)
    path = tmp_path / "decorated.jsonl"
    record_and_replay_in_process(agent, path, server, capsys)
    assert_tool_steps(path, runs.plain)
    assert json.loads(bodies(path)[1]["input"][-2]["arguments"]) == {"word": "deja"}
