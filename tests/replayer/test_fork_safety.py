"""A fork goes live after its edited step, but a side-effecting tool does not run again
unless named (--live-tool): deja says so before anything runs, naming the side-effecting
tools the recorded run called after the fork step, and the program can tell what deja is
doing with it (``recorder.mode()``, ``DEJA_MODE``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import recorder
from recorder.cassette import load
from viewer import queries

AGENT = """\
import os

import recorder


@recorder.tool
def look(i):
    return {"i": i}


@recorder.tool(side_effect=True)
def refund(amount):
    with open(os.environ["LEDGER"], "a") as ledger:
        ledger.write(f"{amount}\\n")
    return {"refunded": amount}


print("mode", recorder.mode(), os.environ.get("DEJA_MODE"), flush=True)
look(1)
refund(5)
look(2)
"""


def deja(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, dict[str, str], Path]:
    (tmp_path / "agent.py").write_text(AGENT)
    ledger = tmp_path / "ledger.txt"
    return tmp_path, {**os.environ, "LEDGER": str(ledger)}, ledger


def test_a_fork_says_which_side_effects_may_run_again_and_the_program_knows_its_mode(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    done = deja("record", "-o", "run.jsonl", "--", "python", "agent.py", cwd=root, env=env)
    assert done.returncode == 0, done.stderr
    assert "mode record record" in done.stdout
    assert ledger.read_text() == "5\n"
    kinds = [o["kind"] for o in load(root / "run.jsonl").observations]
    assert kinds == ["tool", "intent", "outcome", "tool"], kinds

    replayed = deja("replay", "run.jsonl", cwd=root, env=env)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "mode replay replay" in replayed.stderr + replayed.stdout
    assert ledger.read_text() == "5\n"  # a replay runs no tool body

    forked = deja("fork", "run.jsonl", "--at", "0", "--set", 'result={"i": 7}', "-o",
                  "fork.jsonl", cwd=root, env=env)
    assert forked.returncode == 0, forked.stderr
    warning = ("deja: WARNING: after step 0 the recorded run called 1 side-effecting tool(s): "
               "refund (step 1). In this fork they do not run: each call is served the "
               "recorded answer to the same arguments, or refused (the agent sees "
               "ToolRefused); --live-tool NAME runs one for real")
    assert warning in forked.stderr, forked.stderr
    assert forked.stderr.index(warning) < forked.stderr.index("deja: forked run")
    assert "mode fork fork" in forked.stdout
    assert ledger.read_text() == "5\n"  # what the warning said: not run again

    named = deja("fork", "run.jsonl", "--at", "0", "--set", 'result={"i": 7}', "-o",
                 "named.jsonl", "--live-tool", "refund", cwd=root, env=env)
    assert named.returncode == 0, named.stderr
    assert "This fork runs refund live, for real" in named.stderr, named.stderr
    assert ledger.read_text() == "5\n5\n"  # named: it ran for real, once

    late = deja("fork", "run.jsonl", "--at", "3", "--set", 'result={"i": 8}', "-o",
                "late.jsonl", cwd=root, env=env)
    assert late.returncode == 0, late.stderr
    assert "WARNING" not in late.stderr  # nothing side-effecting after step 3
    assert ledger.read_text() == "5\n5\n"

    # the viewer says the same before its Fork button
    assert queries.fork_warnings(root / "run.jsonl", 0) == [warning.removeprefix(
        "deja: WARNING: ")]
    assert queries.fork_warnings(root / "run.jsonl", 1) == []


def test_mode_is_none_outside_a_session_and_says_record_or_replay_in_process(
        tmp_path: Path) -> None:
    assert recorder.mode() is None
    with recorder.record(tmp_path / "r.jsonl"):
        assert recorder.mode() == "record"
        recorder.now()
    assert recorder.mode() is None
    import replayer

    with replayer.replay(tmp_path / "r.jsonl"):
        assert recorder.mode() == "replay"
        recorder.now()
    assert recorder.mode() is None
