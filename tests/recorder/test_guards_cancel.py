"""Cancelling a run from another process (``deja cancel``), seen at its next boundary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import guard_helpers
import pytest
from click.testing import CliRunner
from conftest import MODEL, read_lines
from guard_agents.chatty import ask, client
from guard_helpers import (
    CHATTY,
    ROOT,
    SCRIPT,
    STATUS_FIELDS,
    USAGE,
    assert_replay_stops_the_same,
    chat,
    controls,
    deja,
    end_of,
)

import recorder
from deja.cli import main as cli
from recorder import Cancelled
from recorder.harness.progress import Progress, read_status, request_cancel
from recorder.providers.pricing import PriceTable

# Fixtures shared by the test_guards files.
breaker_clock = guard_helpers.breaker_clock


# ------------------------------------------------------------------------------ cancel


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def header_run(path: Path) -> str | None:
    try:
        first = path.read_text().split("\n", 1)
    except FileNotFoundError:
        return None
    return json.loads(first[0])["run"] if len(first) == 2 else None


def test_cancel_from_another_process_stops_the_run_at_the_next_boundary(
        stub, tmp_path: Path) -> None:
    server = stub({"turns": [], "default": {"text": "ok", "usage": USAGE, "delay_ms": 20}})
    path = tmp_path / "cancel.jsonl"
    log = tmp_path / "agent.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deja", "record", "-o", str(path), "--max-turns", "5000",
             "--", "python", str(CHATTY)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "ANTHROPIC_BASE_URL": server.url}, start_new_session=True)
    try:
        run = wait_for("the cassette header", lambda: header_run(path))
        wait_for("two turns", lambda: (read_status(run) or {}).get("turn", 0) >= 2)

        shown = deja("status", run, "--json")
        assert shown.returncode == 0, shown.stderr
        live = json.loads(shown.stdout)
        assert live["status"] == "running", live
        assert set(STATUS_FIELDS) <= set(live), sorted(set(STATUS_FIELDS) - set(live))
        assert live["run_id"] == run
        assert live["turn"] >= 2 and live["turn_limit"] == 5000
        assert live["budget_s"] == 3600 and live["elapsed_s"] > 0
        assert live["tokens"] == 120 * live["turn"] and live["token_limit"] is None
        per_turn = PriceTable().cost(MODEL, USAGE)
        assert live["spend_usd"] == pytest.approx(per_turn * live["turn"])
        assert live["dollar_limit"] is None
        assert live["artefacts"] == [str(path.resolve())]
        assert live["cancel"] == f"deja cancel {run}"
        assert isinstance(live["step"], str) and live["step"]
        assert "ended" not in live

        cancelled = deja("cancel", run, "--reason", "wrong input file")
        sent_at_cancel = len(server.requests)
        assert cancelled.returncode == 0, cancelled.stderr
        assert proc.wait(timeout=30) == 0  # the agent caught Cancelled and returned 0
    finally:
        if proc.poll() is None:  # a failure above: stop deja record and the agent under it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    assert "stopped: Cancelled" in log.read_text()
    lines = read_lines(path)
    models = [line for line in lines if line.get("kind") == "model"]
    assert len(server.requests) == len(models)  # every request is in the cassette
    assert len(models) <= sent_at_cancel + 1  # at most the one in flight at the flag
    (stop,) = controls(path)
    assert stop["event"] == "cancelled"
    assert stop["detail"]["reason"] == "wrong input file"
    assert stop["detail"]["before"].startswith("model call POST")
    assert [line.get("kind") for line in lines[1:]][-2:] == ["control", "end"]  # nothing after
    end = lines[-1]
    assert end["status"] == "cancelled" and end["reason"] == "cancelled"
    assert end["exit_code"] == 0
    assert end["totals"]["model_calls"] == len(models)
    assert_replay_stops_the_same(path, lambda calls: chat(client(server.url), 10**6, calls),
                                 Cancelled, len(models), steps=len(models) + 1)

    after = json.loads(deja("status", run, "--json").stdout)
    assert after["status"] == "cancelled" and after["ended"] is True
    assert after["turn"] == len(models)
    assert after["totals"]["model_calls"] == len(models)

    runner = CliRunner()
    human = runner.invoke(cli, ["status", run])
    assert human.exit_code == 0 and f"run {run}: cancelled" in human.output
    again = runner.invoke(cli, ["cancel", run])
    assert again.exit_code == 2 and "already ended" in again.output
    unknown = runner.invoke(cli, ["cancel", "r_000000000000deadbeef"])
    assert unknown.exit_code == 2 and "no run" in unknown.output
    assert runner.invoke(cli, ["status", "r_000000000000deadbeef"]).exit_code == 2


def test_cancel_is_read_before_a_tool_call_and_the_body_never_runs(stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    ran: list[str] = []

    @recorder.tool
    def lookup(q: str) -> str:
        ran.append(q)
        return q.upper()

    path = tmp_path / "tool.jsonl"
    with pytest.raises(Cancelled), recorder.record(path) as rec:
        ask(client(server.url), 0)
        lookup("a")
        request_cancel(rec.run_id, "enough")
        lookup("b")
    assert ran == ["a"]
    (stop,) = controls(path)
    assert stop["event"] == "cancelled" and stop["detail"]["before"] == "tool lookup"
    assert end_of(path)["status"] == "cancelled"

    def agent(calls: list[int]) -> None:
        calls.append(0)
        ask(client(server.url), 0)
        calls.append(1)
        lookup("a")
        calls.append(2)
        lookup("b")

    assert_replay_stops_the_same(path, agent, Cancelled, 2, steps=3)
    assert ran == ["a"]  # the replay ran no tool body


# ------------------------------------------------------------------------------ status record


def test_the_status_record_reaches_the_latest_state_within_its_interval() -> None:
    run = "r_progress_1"
    progress = Progress(run, {"turn_limit": 5}, interval=0.05)
    assert (read_status(run) or {}).get("step") == "starting"  # written when it is made
    for turn in range(1, 4):  # steps within the interval: left to the writer thread
        progress.update(turn=turn, step=f"model response {turn}")
    wait_for("the latest step", lambda: (read_status(run) or {}).get("turn") == 3, timeout=5)
    assert (read_status(run) or {})["step"] == "model response 3"

    progress.update(turn=4, step="waiting")
    progress.update(status="exhausted", step="stopped")  # a change of status: at once
    record = read_status(run) or {}
    assert record["status"] == "exhausted" and record["turn"] == 4
    progress.update(status="exhausted", step="ended: exhausted", ended=True, force=True)
    assert (read_status(run) or {})["ended"] is True
    assert not progress.pending  # nothing is left to write after the end
    progress.update(step="after the end")  # kept in memory, never written
    assert not progress.pending
    assert (read_status(run) or {})["step"] == "ended: exhausted"
