"""The ledger server over Streamable HTTP, a real process on 127.0.0.1: the agent's
``ClientSession`` over ``streamable_http_client`` is recorded as MCP lines (its JSON-RPC ids
and ``mcp-session-id`` nowhere, its POSTs, stream and DELETE no ``http`` steps of their
own) and replayed with the server stopped."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from mcp_helpers import (  # noqa: F401  (fixtures)
    Ledger,
    http_ledger_fixture,
    ledger_fixture,
    load_agent,
    steps,
    stop,
)

import recorder
import replayer


def test_recorded_over_http_and_replayed_with_the_server_stopped(
        ledger: Ledger, http_ledger: subprocess.Popen, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    agent = load_agent("sdk_agent")
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        agent.main()
    recorded = capsys.readouterr().out
    assert "refund: refunded 40.00 EUR on A-1\n" in recorded
    assert ledger.rows() == [("A-1", 40.0)]
    lines = steps(path)
    assert [o["kind"] for o in lines] == ["mcp"] * 4 + ["tool"] * 2  # no http step
    url = lines[0]["mcp"]["server"]["url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/mcp")
    assert {o["mcp"]["server"]["name"] for o in lines} == {"ledger"}
    assert [n["method"] for n in lines[-1]["mcp"]["notifications"]] == [
        "notifications/progress", "notifications/message", "notifications/progress"]
    text = path.read_text().lower()
    assert "mcp-session-id" not in text and '"id"' not in text

    stop(http_ledger)  # nothing listens at the URL any more
    with replayer.replay(path) as run:
        agent.main()
    assert capsys.readouterr().out == recorded
    assert run.result is not None and run.result.identical, run.result.report()
    assert ledger.rows() == [("A-1", 40.0)]
