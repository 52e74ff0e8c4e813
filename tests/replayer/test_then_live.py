"""Replay, then live: the recorded incident is served while the changed program asks what
it asked before, and goes live at the first call the recording does not hold.

The incident: a model call, a lookup tool, a model call, a summary request that a code fix
changes (step 3), then a refund into a SQLite ledger. Replayed with the fix, steps 0-2 come
from the cassette (no live call), step 3 goes to a stub, and the refund (a side effect)
is served its recorded answer, or run once when named. Real anthropic SDK, a real stub
server on 127.0.0.1.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import pytest

import recorder
import replayer
from recorder.cassette import load
from recorder.testing.server import StubServer

MODEL = "claude-sonnet-4-6"
LEDGER: list[Path] = []


@recorder.tool
def lookup(order: str) -> dict[str, Any]:
    return {"order": order, "amount": 30}


@recorder.tool(side_effect=True)
def refund(order: str, amount: int) -> dict[str, Any]:
    with sqlite3.connect(LEDGER[0]) as db:
        db.execute("CREATE TABLE IF NOT EXISTS refunds (ord TEXT, amount INTEGER)")
        db.execute("INSERT INTO refunds VALUES (?, ?)", (order, amount))
    return {"refunded": amount}


def agent(url: str, *, fixed: bool, amount_from_lookup: bool = True) -> list[Any]:
    """The incident's program; ``fixed``: the code fix, which changes the summary request."""
    with anthropic.Anthropic(base_url=url, api_key="sk-stub", max_retries=0) as client:
        def ask(text: str) -> str:
            reply = client.messages.create(model=MODEL, max_tokens=64,
                                           messages=[{"role": "user", "content": text}])
            return reply.content[0].text  # type: ignore[union-attr]

        said: list[Any] = [ask("What is order A7?")]
        info = lookup("A7")
        said.append(ask(f"Order {info}: refund it?"))
        said.append(ask("Summarise in one line." if fixed else "Summarise."))
        said.append(refund("A7", info["amount"] if amount_from_lookup else 45))
        return said


def refunds(ledger: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(ledger) as db:
        return list(db.execute("SELECT ord, amount FROM refunds ORDER BY rowid"))


@pytest.fixture
def incident(stub: Callable[[dict], StubServer], tmp_path: Path) -> Path:
    LEDGER[:] = [tmp_path / "ledger.db"]
    server = stub({"default": {"text": "recorded answer"}})
    with recorder.record(tmp_path / "incident.jsonl"):
        agent(server.url, fixed=False)
    server.stop()
    assert refunds(LEDGER[0]) == [("A7", 30)]
    return tmp_path / "incident.jsonl"


def test_the_unchanged_prefix_is_served_and_the_changed_step_goes_live(
        incident: Path, stub: Callable[[dict], StubServer], tmp_path: Path) -> None:
    live = stub({"default": {"text": "a new summary"}})
    out = tmp_path / "fixed.jsonl"
    with replayer.replay(incident, on_divergence="live", out=out) as run:
        said = agent(live.url, fixed=True)
    assert said == ["recorded answer", "recorded answer", "a new summary", {"refunded": 30}]
    assert len(live.requests) == 1  # only step 3: the prefix cost no live call
    assert refunds(LEDGER[0]) == [("A7", 30)]  # the refund: served, not made again
    new = load(out)
    parent = load(incident)
    assert new.header["parent"]["run"] == parent.run
    assert new.header["parent"]["step"] == 3
    assert new.header["parent"]["divergence"]["category"] == "changed_request"
    assert [o["kind"] for o in new.observations] == ["model", "tool", "model", "model", "tool"]
    assert new.observations[4]["policy"] == "recorded"
    assert new.end is not None and new.end["status"] == "completed"
    assert run.policy_calls[0]["tool"] == "refund"
    # the new run is a recording of the fixed program: it replays whole, offline
    live.stop()
    with replayer.replay(out):
        assert agent(live.url, fixed=True) == said


def test_a_side_effect_with_new_arguments_runs_only_when_named(
        incident: Path, stub: Callable[[dict], StubServer], tmp_path: Path) -> None:
    live = stub({"default": {"text": "live"}})
    with pytest.raises(recorder.ToolRefused, match="'refund' was not run"), \
            replayer.replay(incident, on_divergence="live", out=tmp_path / "a.jsonl"):
        agent(live.url, fixed=True, amount_from_lookup=False)
    assert refunds(LEDGER[0]) == [("A7", 30)]
    refused = load(tmp_path / "a.jsonl", allow_incomplete=True)
    assert refused.observations[-1]["policy"] == "refuse"
    with replayer.replay(incident, on_divergence="live", out=tmp_path / "b.jsonl",
                         live_tools=["refund"]):
        agent(live.url, fixed=True, amount_from_lookup=False)
    assert refunds(LEDGER[0]) == [("A7", 30), ("A7", 45)]


def test_a_run_that_never_leaves_the_recording_is_a_whole_copy(
        incident: Path, stub: Callable[[dict], StubServer], tmp_path: Path) -> None:
    live = stub({"default": {"text": "live"}})
    out = tmp_path / "same.jsonl"
    with replayer.replay(incident, on_divergence="live", out=out):
        agent(live.url, fixed=False)
    assert live.requests == []
    new = load(out)
    assert "step" not in new.header["parent"]
    assert len(new.observations) == len(load(incident).observations)


def test_nothing_is_written_before_the_run_leaves_the_recording(
        incident: Path, stub: Callable[[dict], StubServer], tmp_path: Path) -> None:
    out = tmp_path / "stopped.jsonl"
    scope = replayer.replay(incident, on_divergence="live", out=out)
    session = scope.__enter__()
    try:
        with anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key="k",
                                 max_retries=0) as client:
            client.messages.create(model=MODEL, max_tokens=64, messages=[
                {"role": "user", "content": "What is order A7?"}])
        assert not out.exists()  # served from the recording: nothing new yet
        assert session.writer is not None and session.writer.next_seq == 1
    finally:
        session.abandon()
    assert out.exists()  # stopped: what it served is written, to be resumed
    assert len(load(out, allow_incomplete=True).observations) == 1


def test_the_new_runs_totals_split_at_the_step_it_left(
        incident: Path, stub: Callable[[dict], StubServer], tmp_path: Path) -> None:
    from recorder.cassette.rows import run_totals

    live = stub({"default": {"text": "a new summary"}})
    with replayer.replay(incident, on_divergence="live", out=tmp_path / "fixed.jsonl"):
        agent(live.url, fixed=True)
    totals = run_totals(load(tmp_path / "fixed.jsonl"))
    assert totals["live_from"] == 3
    assert totals["replayed"]["model_calls"] == 2 and totals["live"]["model_calls"] == 1


# ------------------------------------------------------------------ the command line

PROGRAM = """\
import json, os, sqlite3

import anthropic
import recorder


@recorder.tool
def lookup(order):
    return {"order": order, "amount": 30}


@recorder.tool(side_effect=True)
def refund(order, amount):
    with sqlite3.connect(os.environ["LEDGER"]) as db:
        db.execute("CREATE TABLE IF NOT EXISTS refunds (ord TEXT, amount INTEGER)")
        db.execute("INSERT INTO refunds VALUES (?, ?)", (order, amount))
    return {"refunded": amount}


client = anthropic.Anthropic(max_retries=0)


def ask(text):
    reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=64,
                                   messages=[{"role": "user", "content": text}])
    return reply.content[0].text


print(ask("What is order A7?"))
info = lookup("A7")
print(ask(f"Order {info}: refund it?"))
print(ask("Summarise in one line." if os.environ.get("FIXED") else "Summarise."))
try:
    print("refund", json.dumps(refund("A7", int(os.environ.get("AMOUNT", info["amount"])))))
except recorder.ToolRefused as exc:
    print("refused", exc)
"""


def deja(*args: str, cwd: Path, env: dict[str, str]) -> Any:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.fixture
def project(stub: Callable[[dict], StubServer], tmp_path: Path) -> tuple[Path, dict[str, str]]:
    import os

    (tmp_path / "agent.py").write_text(PROGRAM)
    server = stub({"default": {"text": "recorded answer"}})
    env = {**os.environ, "LEDGER": str(tmp_path / "ledger.db"),
           "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "sk-stub"}
    done = deja("record", "-o", "incident.jsonl", "--", "python", "agent.py", cwd=tmp_path,
                env=env)
    assert done.returncode == 0, done.stderr
    server.stop()
    (tmp_path / "fix.stub.json").write_text('{"default": {"text": "a new summary"}}')
    return tmp_path, env


def test_deja_replay_then_stub_goes_live_at_the_changed_step(
        project: tuple[Path, dict[str, str]]) -> None:
    root, env = project
    ran = deja("replay", "incident.jsonl", "--then", "stub", "fix.stub.json", "-o",
               "fixed.jsonl", cwd=root, env={**env, "FIXED": "1"})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["recorded answer", "recorded answer", "a new summary",
                                       'refund {"refunded": 30}']
    assert "served the recording up to step 3; there the program asked for something else " \
           "(model, changed request): live from there against the stub at" in ran.stderr
    assert "step 4: tool 'refund' not run: served the recorded answer" in ran.stderr
    assert "deja diff incident.jsonl fixed.jsonl" in ran.stderr
    fixed = load(root / "fixed.jsonl")
    assert fixed.header["parent"]["step"] == 3
    assert fixed.header["parent"]["run"] == load(root / "incident.jsonl").run
    assert refunds(root / "ledger.db") == [("A7", 30)]
    # the new run replays the fixed program offline, as any recording
    again = deja("replay", "fixed.jsonl", cwd=root, env={**env, "FIXED": "1"})
    assert again.returncode == 0, again.stdout + again.stderr


def test_deja_replay_then_live_runs_a_named_side_effect_once(
        project: tuple[Path, dict[str, str]], stub: Callable[[dict], StubServer]) -> None:
    root, env = project
    live = stub({"default": {"text": "live"}})
    env = {**env, "ANTHROPIC_BASE_URL": live.url, "AMOUNT": "45"}
    refused = deja("replay", "incident.jsonl", "--then", "live", "-o", "a.jsonl", cwd=root,
                   env=env)
    assert refused.returncode == 0, refused.stderr
    assert "refused tool 'refund' was not run" in refused.stdout
    assert refunds(root / "ledger.db") == [("A7", 30)]
    named = deja("replay", "incident.jsonl", "--then", "live", "--live-tool", "refund", "-o",
                 "b.jsonl", cwd=root, env=env)
    assert named.returncode == 0, named.stderr
    assert 'refund {"refunded": 45}' in named.stdout
    assert refunds(root / "ledger.db") == [("A7", 30), ("A7", 45)]
    assert load(root / "b.jsonl").header["parent"]["step"] == 4  # the refund's arguments
    assert live.requests == []  # every model call was the recorded one


def test_deja_replay_then_refuses_what_it_cannot_do(
        project: tuple[Path, dict[str, str]]) -> None:
    root, env = project
    for args, said in (
            (["--then", "stub"], "--then stub needs the stub's script"),
            (["-o", "x.jsonl"], "-o, --tool and --live-tool go with --then"),
            (["incident.jsonl", "--then", "live"], "--then takes one cassette"),
            (["--then", "live", "--tool", "refund=maybe"], "one of live, recorded, refuse")):
        ran = deja("replay", "incident.jsonl", *args, cwd=root, env=env)
        assert ran.returncode == 2 and said in ran.stderr, (args, ran.stderr)
    assert sorted(p.name for p in root.glob("*.jsonl")) == ["incident.jsonl"]
