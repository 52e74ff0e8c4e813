"""An agent on the official MCP SDK (``ClientSession`` over ``stdio_client``), unmodified:
recorded with its server running as a real process, replayed bit for bit with the server's
command gone, and a call the recording does not hold reported as a divergence naming the
server, the tool and the arguments; the guards see an MCP tool call as a tool call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp_helpers import Ledger, ledger_fixture, load_agent, steps  # noqa: F401  (a fixture)
from tamper import ATTACKER_KEY, resign

import recorder
import replayer
from recorder.cassette import load
from recorder.errors import CorruptCassette, Divergence, LoopDetected

SERVER = {"transport": "stdio", "command": ["ledger-server"], "name": "ledger",
          "version": "1.4.2"}
OUTPUT = """tools: lookup, refund, summarize, confirm
policy: Refunds up to 50 EUR need no approval.
prompt: Write a short apology for order A-1.
lookup: order A-1: 40.00 EUR paid, 0.00 EUR refunded
refund: refunded 40.00 EUR on A-1
progress: [(0.5, 1.0, 'writing the ledger'), (1.0, 1.0, 'done')]
"""


def record(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    with recorder.record(path):
        load_agent("sdk_agent").main()
    return capsys.readouterr().out


def test_the_exchanges_are_lines_and_replay_without_the_server(
        ledger: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.jsonl"
    assert record(path, capsys) == OUTPUT
    assert ledger.rows() == [("A-1", 40.0)]
    lines = steps(path)
    assert [(o["kind"], o.get("name") or o.get("event") or o["mcp"]["method"])
            for o in lines] == [
        ("mcp", "initialize"), ("mcp", "tools/list"), ("mcp", "resources/read"),
        ("mcp", "prompts/get"), ("tool", "lookup"), ("control", "sending"),
        ("tool", "refund")]
    # the destructive refund was announced, on disk, before it went to the server
    assert lines[5]["detail"] == {"tool": "refund", "fp": lines[6]["fp"], "server": "ledger"}
    lines = [o for o in lines if o["kind"] != "control"]
    assert all(o["mcp"]["server"] == SERVER for o in lines[1:])
    assert lines[0]["result"]["serverInfo"] == {"name": "ledger", "version": "1.4.2"}
    lookup, refund = lines[4], lines[5]
    assert (lookup["args"], lookup["result"]["content"][0]["text"]) == (
        {"order": "A-1"}, "order A-1: 40.00 EUR paid, 0.00 EUR refunded")
    assert "destructive" not in lookup["mcp"] and refund["mcp"]["destructive"] is True
    # the server's notifications, in the order they came, the progress token left out
    assert refund["mcp"]["notifications"] == [
        {"method": "notifications/progress",
         "params": {"progress": 0.5, "total": 1.0, "message": "writing the ledger"}},
        {"method": "notifications/message",
         "params": {"level": "info", "data": "refunding 40.00 EUR on A-1"}},
        {"method": "notifications/progress",
         "params": {"progress": 1.0, "total": 1.0, "message": "done"}}]
    text = path.read_text()
    assert '"id"' not in text and "progressToken" not in text and "_meta" not in text
    assert load(path).end["totals"]["tool_calls"] == 2

    ledger.remove()  # nothing can start the server now
    with replayer.replay(path) as run:
        load_agent("sdk_agent").main()
    assert capsys.readouterr().out == OUTPUT  # the progress callback too
    assert run.result is not None and run.result.identical, run.result.report()
    assert run.result.steps_served == 7  # the sending line among them
    assert ledger.rows() == [("A-1", 40.0)]  # no refund ran again


@pytest.mark.parametrize(("env", "change", "shown"), [
    ({"LEDGER_ORDER": "B-2"}, "changed_request", "prompts/get"),
    ({"LEDGER_TOOL": "refund"}, "different_arguments", "refund"),
])
def test_a_call_the_recording_does_not_hold_diverges(
        ledger: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], change: str, shown: str) -> None:
    path = tmp_path / "run.jsonl"
    record(path, capsys)
    ledger.remove()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with replayer.replay(path, raise_on_divergence=False) as run, \
            pytest.raises(BaseExceptionGroup) as caught:
        load_agent("sdk_agent").main()
    assert caught.group_contains(Divergence)
    assert run.result is not None
    divergence = run.result.divergence
    assert divergence is not None and divergence.category == change
    assert "server ledger" in divergence.reason and shown in divergence.reason
    assert divergence.actual["server"] == "ledger"


def test_a_connection_the_recording_does_not_hold_is_an_extra_call(
        ledger: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The agent run twice against a recording of one run: the second connection's
    handshake is an extra call, its server named by its command (the name comes with the
    handshake), and the server is still not started."""
    path = tmp_path / "run.jsonl"
    record(path, capsys)
    ledger.remove()
    with replayer.replay(path, raise_on_divergence=False) as run, \
            pytest.raises(BaseExceptionGroup) as caught:
        agent = load_agent("sdk_agent")
        agent.main()
        agent.main()  # the same calls again: the recording holds them once
    assert caught.group_contains(Divergence)
    divergence = run.result.divergence if run.result else None
    assert divergence is not None and divergence.category == "extra_call"
    assert divergence.step is None and "no more mcp calls" in divergence.reason
    assert divergence.actual["server"] == "ledger-server"
    assert divergence.actual["method"] == "initialize"


def test_deja_show_lists_the_mcp_steps(ledger: Ledger, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.jsonl"
    record(path, capsys)
    shown = subprocess.run([sys.executable, "-m", "deja", "show", "--json", str(path)],
                           capture_output=True, text=True, timeout=60, check=True)
    rows = json.loads(shown.stdout)["steps"]
    assert [(r["kind"], r["name"], r["status"]) for r in rows] == [
        ("mcp", "ledger initialize", "ok"), ("mcp", "ledger tools/list", "ok"),
        ("mcp", "ledger resources/read", "ok"), ("mcp", "ledger prompts/get", "ok"),
        ("tool", "lookup", "ok"), ("control", "sending", "ok"), ("tool", "refund", "ok")]


def test_an_mcp_field_of_the_wrong_type_is_refused_on_load(
        ledger: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The reader checks the new fields' types as it checks every other field's, in a line
    it cannot vouch for (signed with a key it does not have): one whose server is not an
    object is refused, naming it."""
    path = tmp_path / "run.jsonl"
    record(path, capsys)
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    docs[5]["mcp"]["server"] = "ledger-server"  # the lookup (docs[0] is the header)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(line + b"\n" for line in resign(docs, ATTACKER_KEY)))
    with pytest.raises(CorruptCassette, match=r"seq 4 .*'server' must be an object"):
        load(bad, allow_unverified=True)
    good = tmp_path / "good.jsonl"  # the same, untouched: loads as it is
    good.write_bytes(b"".join(line + b"\n" for line in resign(
        [json.loads(line) for line in path.read_text().splitlines()], ATTACKER_KEY)))
    assert [o["kind"] for o in load(good, allow_unverified=True)][-3:] == [
        "tool", "control", "tool"]


async def look_up_thrice() -> None:
    """The same MCP tool call three times, as an agent in a loop would make it."""
    params = StdioServerParameters(command="ledger-server",
                                   env={"LEDGER_DB": os.environ["LEDGER_DB"]})
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        for _ in range(3):
            await session.call_tool("lookup", {"order": "A-1"})


def test_the_loop_guard_sees_an_mcp_tool_call(ledger: Ledger, tmp_path: Path) -> None:
    """A tool call of an MCP server is a tool call to the guards: the third identical
    lookup is stopped before it is sent, and a replay stops at the same point."""
    path = tmp_path / "run.jsonl"
    with pytest.raises(BaseExceptionGroup) as caught, recorder.record(path):
        anyio.run(look_up_thrice)
    assert caught.group_contains(LoopDetected)
    lines = [o for o in steps(path) if o["kind"] != "mcp"]
    # not listed yet, the tool is destructive to the client: its first call is announced
    # (the client lists the tools after it, and learns it reads only)
    assert [(o["kind"], o.get("name") or o.get("event")) for o in lines] == [
        ("control", "sending"), ("tool", "lookup"), ("tool", "lookup"),
        ("control", "loop_detected")]
    ledger.remove()
    with pytest.raises(BaseExceptionGroup) as again, replayer.replay(path) as run:
        anyio.run(look_up_thrice)
    assert again.group_contains(LoopDetected)
    assert run.result is not None and run.result.identical, run.result.report()
