"""A fork of a run whose tools come from an MCP server: the fork step's result edited like
any tool result, the recorded prefix served without the server, and in the live part the
tool policy: the refund, which the server annotated ``destructiveHint``, is served its
recorded answer (never run) unless named live, and then runs on a server started only
then, after the handshake the client was served; a tool the user names is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mcp_helpers import AGENTS, Ledger, ledger_fixture, load_agent, seq_of, steps  # noqa: F401

import recorder
import replayer
from replayer.tool_policy import ToolPolicy

EDITED = "order A-1: paid by bank transfer, see the ledger"


@pytest.fixture
def recorded(ledger: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A run of the SDK agent, its refund in the ledger."""
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        load_agent("sdk_agent").main()
    capsys.readouterr()
    assert ledger.rows() == [("A-1", 40.0)]
    return path


def fork(path: Path, out: Path, at: int, sets: list[str], **kwargs: object) -> object:
    with replayer.fork(path, at=at, sets=sets, out=out, **kwargs) as run:  # type: ignore[arg-type]
        load_agent("sdk_agent").main()
    return run


def test_the_refund_is_served_not_run_and_the_server_never_starts(
        recorded: Path, ledger: Ledger, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    ledger.remove()  # the live part asks for nothing the server must answer
    out = tmp_path / "fork.jsonl"
    run = fork(recorded, out, seq_of(recorded, "tool", "lookup"), [f"result={EDITED}"])
    printed = capsys.readouterr().out
    assert f"lookup: {EDITED}\n" in printed
    assert "refund: refunded 40.00 EUR on A-1\n" in printed  # as recorded
    assert "progress: [(0.5, 1.0, 'writing the ledger'), (1.0, 1.0, 'done')]" in printed
    assert ledger.rows() == [("A-1", 40.0)]
    lines = steps(out)
    refund = lines[-1]
    assert (refund["name"], refund["policy"]) == ("refund", "recorded")
    assert refund["from"]["seq"] == seq_of(recorded, "tool", "refund")
    assert refund["mcp"]["server"]["name"] == "ledger"
    assert getattr(run, "policy_calls", None) == [
        {"seq": refund["seq"], "tool": "refund", "rule": "recorded", "from": refund["from"]}]
    with replayer.replay(out) as again:  # the fork replays as any run
        load_agent("sdk_agent").main()
    assert again.result is not None and again.result.identical, again.result.report()


def test_named_live_the_refund_runs_on_a_server_started_then(
        recorded: Path, ledger: Ledger, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fork.jsonl"
    fork(recorded, out, seq_of(recorded, "tool", "lookup"), [f"result={EDITED}"],
         live_tools=["refund"])
    assert "refund: refunded 40.00 EUR on A-1\n" in capsys.readouterr().out
    assert ledger.rows() == [("A-1", 40.0)] * 2  # it ran, once
    refund = steps(out)[-1]
    assert "policy" not in refund and refund["mcp"]["destructive"] is True
    assert len(refund["mcp"]["notifications"]) == 3  # from the server, live


def test_a_tool_named_by_the_user_is_refused(
        recorded: Path, ledger: Ledger, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Forked at the prompt (an ``mcp`` line, edited as its result): the lookup that
    follows is refused as the user said, the refund served, and nothing starts the
    server."""
    ledger.remove()
    out = tmp_path / "fork.jsonl"
    fork(recorded, out, seq_of(recorded, "mcp", "prompts/get"),
         ["result.messages.0.content.text=Apologise twice."],
         tools=ToolPolicy.parse(["lookup=refuse"]))
    printed = capsys.readouterr().out
    assert "lookup: tool 'lookup' was not run: the tool policy refuses it" in printed
    assert printed.count("(error)") == 1 and "refund: refunded 40.00 EUR" in printed
    lookup = next(o for o in steps(out) if o.get("name") == "lookup")
    assert lookup["policy"] == "refuse" and lookup["error"]["type"] == "ToolRefused"


def deja(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=dict(os.environ))


def test_the_command_line_records_replays_and_forks(ledger: Ledger, tmp_path: Path) -> None:
    """``deja record``, ``deja replay`` with the server's command gone, ``deja fork --set``
    (the refund served) and ``deja fork --live-tool refund`` (the refund run)."""
    agent = str(AGENTS / "sdk_agent.py")
    recorded = deja("record", "-o", "run.jsonl", "--", "python", agent, cwd=tmp_path)
    assert recorded.returncode == 0, recorded.stderr
    assert ledger.rows() == [("A-1", 40.0)]
    ledger.remove()
    replayed = deja("replay", "run.jsonl", cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert ": identical" in replayed.stdout and "7/7 served" in replayed.stdout
    at = str(seq_of(tmp_path / "run.jsonl", "tool", "lookup"))
    served = deja("fork", "run.jsonl", "--at", at, "--set", f"result={EDITED}", "-o",
                  "fork.jsonl", cwd=tmp_path)
    assert served.returncode == 0, served.stdout + served.stderr
    assert "tool 'refund' not run: served the recorded answer" in served.stderr, served.stderr
    assert ledger.rows() == [("A-1", 40.0)]
    ledger.install()
    live = deja("fork", "run.jsonl", "--at", at, "--set", f"result={EDITED}", "-o",
                "live.jsonl", "--live-tool", "refund", cwd=tmp_path)
    assert live.returncode == 0, live.stdout + live.stderr
    assert ledger.rows() == [("A-1", 40.0)] * 2


def test_the_warning_before_a_fork_names_the_destructive_tool(recorded: Path) -> None:
    from recorder.cassette import load
    from replayer.fork import side_effect_warning

    at = seq_of(recorded, "tool", "lookup")
    said = side_effect_warning(load(recorded), at)
    assert said is not None and "refund (step" in said and "they do not run" in said, said
