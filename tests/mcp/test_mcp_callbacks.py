"""A server that asks the client things during a tool call, a real process over stdio:
``summarize`` asks the client's model (``sampling/createMessage``), ``confirm`` asks its
user (``elicitation/create``). The questions and the client's answers are kept with the
call, in order; a replay serves the calls without the server and without asking the
client's callbacks; a fork runs ``confirm`` live only when it is named, since the server
gave it no annotations (so the MCP specification takes it to be destructive), and then
the server, started late, asks the client again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp_helpers import Ledger, ledger_fixture, load_agent, seq_of, steps  # noqa: F401

import recorder
import replayer
from recorder.capture.mcp.calls import destructive

ASKED = ("asked to sample: Summarize in one line: order A-1: 40.00 EUR paid, 0.00 EUR "
         "refunded\n")
ANSWERS = "summarize: summary: A-1 paid, not refunded\nconfirm: A-1: approved\n"
OUTPUT = ASKED + "summarize: summary: A-1 paid, not refunded\n" \
    "asked to confirm: Refund order A-1?\nconfirm: A-1: approved\n"


@pytest.fixture
def recorded(ledger: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        load_agent("callbacks_agent").main()
    assert capsys.readouterr().out == OUTPUT
    return path


def test_the_questions_and_answers_are_kept_and_replay_asks_nobody(
        recorded: Path, ledger: Ledger, capsys: pytest.CaptureFixture[str]) -> None:
    by_name = {o.get("name"): o for o in steps(recorded)}
    summarize, confirm = by_name["summarize"]["mcp"], by_name["confirm"]["mcp"]
    [sampling] = summarize["notifications"]
    assert sampling["method"] == "sampling/createMessage"
    assert sampling["params"]["messages"][0]["content"]["text"] == ASKED.split(": ", 1)[1][:-1]
    assert sampling["result"]["content"]["text"] == "A-1 paid, not refunded"
    [elicitation] = confirm["notifications"]
    assert (elicitation["method"], elicitation["params"]["message"]) == (
        "elicitation/create", "Refund order A-1?")
    assert elicitation["result"] == {"action": "accept", "content": {"approved": True}}
    # readOnlyHint: not destructive; no annotations at all: destructive
    assert "destructive" not in summarize and confirm["destructive"] is True
    assert '"id"' not in recorded.read_text()

    ledger.remove()
    with replayer.replay(recorded) as run:
        load_agent("callbacks_agent").main()
    assert capsys.readouterr().out == ANSWERS  # no callback was asked anything
    assert run.result is not None and run.result.identical, run.result.report()


@pytest.mark.parametrize("live", [False, True])
def test_a_fork_runs_the_unannotated_tool_only_when_named(
        recorded: Path, ledger: Ledger, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, live: bool) -> None:
    """Forked at the summary: ``confirm`` is served its recorded answer and nothing starts
    the server; named live, it runs on a server started then, whose question reaches the
    client's callback, which answers otherwise this time."""
    if not live:
        ledger.remove()
    monkeypatch.setenv("LEDGER_APPROVE", "no")
    out = tmp_path / "fork.jsonl"
    with replayer.fork(recorded, at=seq_of(recorded, "tool", "summarize"),
                       sets=["result=summary: edited"], out=out,
                       live_tools=["confirm"] if live else []):
        load_agent("callbacks_agent").main()
    printed = capsys.readouterr().out
    confirm = steps(out)[-1]
    assert confirm["name"] == "confirm" and "summarize: summary: edited\n" in printed
    if not live:
        assert confirm["policy"] == "recorded" and "asked to" not in printed
        assert "confirm: A-1: approved\n" in printed
        return
    assert "policy" not in confirm
    assert "asked to confirm: Refund order A-1?\nconfirm: A-1: not approved\n" in printed
    assert confirm["mcp"]["notifications"][0]["result"] == {
        "action": "accept", "content": {"approved": False}}


def test_the_destructive_default_is_the_specifications() -> None:
    assert destructive(None) and destructive({}) and destructive({"readOnlyHint": False})
    assert destructive({"destructiveHint": True, "title": "Refund"})
    assert not destructive({"readOnlyHint": True})
    assert not destructive({"destructiveHint": False})
