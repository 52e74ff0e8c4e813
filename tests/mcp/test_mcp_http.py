"""The ledger server over HTTP, a real process on 127.0.0.1, over Streamable HTTP and over
the legacy SSE transport: the agent's ``ClientSession`` over ``streamable_http_client`` or
``sse_client`` is recorded as MCP lines (its JSON-RPC ids and session id nowhere, its POSTs,
event stream and DELETE no ``http`` steps of their own) and replayed with the server
stopped."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from mcp_helpers import (  # noqa: F401  (fixtures)
    Ledger,
    http_ledger_fixture,
    ledger_fixture,
    load_agent,
    sse_ledger_fixture,
    steps,
    stop,
)

import recorder
import replayer


@pytest.mark.parametrize(("served", "transport", "path"), [
    ("http_ledger", "http", "/mcp"), ("sse_ledger", "sse", "/sse")])
def test_recorded_over_http_and_replayed_with_the_server_stopped(
        ledger: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        request: pytest.FixtureRequest, served: str, transport: str, path: str) -> None:
    server: subprocess.Popen = request.getfixturevalue(served)
    agent = load_agent("sdk_agent")
    cassette = tmp_path / "run.jsonl"
    with recorder.record(cassette):
        agent.main()
    recorded = capsys.readouterr().out
    assert "refund: refunded 40.00 EUR on A-1\n" in recorded
    assert ledger.rows() == [("A-1", 40.0)]
    lines = steps(cassette)
    # no http step; the destructive refund announced before it was sent
    assert [o["kind"] for o in lines] == ["mcp"] * 4 + ["tool", "control", "tool"]
    lines = [o for o in lines if o["kind"] != "control"]
    assert {o["mcp"]["server"]["transport"] for o in lines} == {transport}
    url = lines[0]["mcp"]["server"]["url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith(path)
    assert {o["mcp"]["server"]["name"] for o in lines} == {"ledger"}
    assert [n["method"] for n in lines[-1]["mcp"]["notifications"]] == [
        "notifications/progress", "notifications/message", "notifications/progress"]
    text = cassette.read_text().lower()
    assert "mcp-session-id" not in text and '"id"' not in text and "session_id" not in text

    stop(server)  # nothing listens at the URL any more
    with replayer.replay(cassette) as run:
        agent.main()
    assert capsys.readouterr().out == recorded
    assert run.result is not None and run.result.identical, run.result.report()
    assert ledger.rows() == [("A-1", 40.0)]
