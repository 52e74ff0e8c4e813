"""``deja sweep`` on the durable workers: each fork one workflow on the sweep's queue, run
by a real ``deja worker`` (its own DEJA_HOME, the embedded SQLite database), its record
the output of the workflow's step, as a suite's incidents are.

The run is one incident of ``tests/suite_incidents.py`` (the order agent asked for a
refund of 30, which it plans with a tool), recorded once against the stub model. Two
forks perturb the tool: raising (the agent crashes) and empty (the agent asks for its
summary live, from the stub the worker points at). ``deja sweep`` is a real process with
no worker of its own: the forks run on the worker, and the sweep's summary says so;
``--workers`` without a reachable runs database is refused before anything runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from runs_helpers import base_env, sqlite_url, start_worker, wait_up
from suite_incidents import LIVE_ANSWER, live_script, script_for

from deja.runs import engine
from recorder.cassette import load
from recorder.testing.server import StubServer
from replayer import suite_summary

TIMEOUT = 300.0


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]) -> Path:
    """The agent and its refund-30 run, recorded once."""
    from suite_incidents import AGENT

    root = tmp_path_factory.mktemp("sweep-workers")
    (root / "agent.py").write_text(AGENT)
    with StubServer(script_for("REFUND 30")) as model:
        done = subprocess.run([sys.executable, "-m", "deja", "record", "-o", "run.jsonl", "--",
                               "python", "agent.py"], cwd=root, capture_output=True, text=True,
                              timeout=TIMEOUT, env={**module_env, "ANTHROPIC_API_KEY": "sk-stub",
                                                    "ANTHROPIC_BASE_URL": model.url})
    assert done.returncode == 0, done.stderr
    return root


def sweep(project: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", "sweep", "run.jsonl", "--perturb",
                           "tool=plan_refund:error,empty", "-j", "2", "--json", *extra],
                          cwd=project, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def the_summary(out: Path) -> dict:
    [path] = (out / ".deja" / "suites").glob("*.json")
    return suite_summary.read(path)


def test_a_sweep_runs_its_forks_on_the_workers(recorded: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    for name in ("agent.py", "run.jsonl"):
        (project / name).write_bytes((recorded / name).read_bytes())
    home = tmp_path / "home"
    env = base_env(home, ANTHROPIC_API_KEY="sk-stub")
    with StubServer(live_script()) as live:
        worker = start_worker("w1", {**env, "ANTHROPIC_BASE_URL": live.url}, tmp_path / "logs")
        try:
            wait_up(worker)
            # the sweep's own environment has no model: only the worker can reach the stub
            done = sweep(project, env, "-o", "out", "--id", "what-if-w")
            forks = {p.name: p.read_bytes() for p in (project / "out").glob("*.jsonl")}
            # the same sweep again: its forks have their verdicts, none runs again
            again = sweep(project, env, "-o", "out", "--id", "what-if-w")
        finally:
            worker.stop()
            worker.reap()
    assert again.returncode == 1 and "sweep what-if-w (resumed)" in again.stderr, again.stderr
    assert json.loads(again.stdout)["rows"] == json.loads(done.stdout)["rows"]
    assert {p.name: p.read_bytes() for p in (project / "out").glob("*.jsonl")} == forks
    assert done.returncode == 1, done.stderr[-3000:]  # both perturbations change the outcome
    assert "2 fork(s), 2 at a time, on the workers (w1)" in done.stderr
    rows = {row["kind"]: row for row in json.loads(done.stdout)["rows"]}
    assert (rows["error"]["status"], rows["error"]["exit_code"]) == ("failed", 1)
    assert (rows["empty"]["status"], rows["empty"]["answer"]) == ("completed", LIVE_ANSWER)
    assert rows["empty"]["live"]["model_calls"] == 1 and len(live.requests) == 1
    assert {row["worker"] for row in rows.values()} == {"w1"}
    summary = the_summary(project / "out")
    assert (summary["kind"], summary["mode"], summary["where"]) == (
        "sweep", "sweep", "on the workers (w1)")
    entries = {e["incident"]: e for e in summary["incidents"]}
    assert sorted(entries) == ["s001-plan-refund-empty", "s001-plan-refund-error"]
    for name, entry in entries.items():
        assert entry["worker"] == "w1" and entry["verdict"] == "outcome_changed", entry
        assert entry["new_run"] == load(project / "out" / f"{name}.jsonl").run
    # each fork was one workflow of the sweep's queue, its record checkpointed
    client = engine.Client(sqlite_url(home))
    try:
        ids = [engine.suite_workflow_id(summary["suite"], name) for name in entries]
        states = client.states(ids)
    finally:
        client.close()
    assert {s["status"] for s in states.values()} == {"SUCCESS"}, states
    assert "Traceback" not in worker.log()


def test_workers_with_no_database_is_refused_before_anything_runs(
        recorded: Path, tmp_path: Path) -> None:
    """--workers when the runs database cannot be reached: bad input, nothing written."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("agent.py", "run.jsonl"):
        (project / name).write_bytes((recorded / name).read_bytes())
    env = base_env(tmp_path / "home", ANTHROPIC_API_KEY="sk-stub",
                   DEJA_DATABASE_URL="postgresql://deja@127.0.0.1:1/nothing")
    refused = sweep(project, env, "--workers", "-o", "refused")
    assert refused.returncode == 2, refused.stderr
    assert "--workers: the runs database" in refused.stderr
    assert not (project / "refused").exists()
