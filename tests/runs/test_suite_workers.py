"""``deja suite`` on the durable workers: each incident one workflow on the suite's queue,
its verdict the output of the workflow's step, which the engine checkpoints.

A real ``deja worker`` (its own DEJA_HOME, the embedded SQLite database) is up, so ``deja
suite`` (a real process, no ``--workers`` flag) sends the twenty incidents of
``tests/suite_incidents.py`` to it, with the change that fixes three and breaks one, as
replays-then-live against a stub whose live answer is slow. Once a verdict is
checkpointed and an incident is in its live part (its new cassette written, no end
line yet), the worker is killed with SIGKILL and started again under its id. Then:

- the suite reports exactly the three fixed and the one broken, as inline;
- the verdicts checkpointed before the kill are the ones reported (their incidents were
  not run again: same process), none is lost;
- the incident cut short was run again and replaced what it had half-written: one
  finished, signed cassette per incident, nothing else;
- the same suite id again runs nothing and reports the same records.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from runs_helpers import base_env, sqlite_url, start_worker, wait_up
from suite_incidents import check_the_fix, live_script, make_incidents, record_project

from deja.runs import engine
from recorder.harness.progress import cassette_end

SUITE = "fix-20"
TIMEOUT = 300.0  # for the kill point to come, and for the suite to end
POLL = 0.02


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]) -> Path:
    return record_project(tmp_path_factory.mktemp("suite-workers") / "project", module_env)


def suite_args(*extra: str) -> list[str]:
    return [sys.executable, "-m", "deja", "suite", "incidents", "-j", "2", "--id", SUITE,
            "--then", "stub", "slow.stub.json", "-o", "out", "--json", *extra, "--",
            "python", "fixed.py"]


def states(client: engine.Client, made: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The engine's view of each incident's workflow, by the incident's file name."""
    ids = {engine.suite_workflow_id(SUITE, name): name for name in made}
    return {ids[w]: state for w, state in client.states(list(ids)).items()}


def half_written(out: Path) -> list[str]:
    """The new cassettes written but not ended: an incident in its live part."""
    return [p.name for p in out.glob("*.jsonl") if cassette_end(p)[0] == "open"]


def ended(path: Path) -> bool:
    """The new cassette has its end line, and not an interrupted one."""
    state, end = cassette_end(path)
    return state == "ended" and end is not None and end.get("status") != "interrupted"


def wait_gone(worker: Any) -> None:
    """Until nothing of a killed worker's session is left (its jobs and their programs)."""
    deadline = time.monotonic() + TIMEOUT
    while worker.orphans():
        assert time.monotonic() < deadline, f"the worker's jobs outlived it: {worker.orphans()}"
        time.sleep(POLL)


def wait_for_the_kill_point(client: engine.Client, made: dict[str, str], out: Path,
                            suite: subprocess.Popen[str]) -> tuple[dict[str, Any], list[str]]:
    """Until a verdict is checkpointed and an incident is live; the checkpointed outputs
    and the incidents half-written."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert suite.poll() is None, "the suite ended before the kill point"
        assert time.monotonic() < deadline, f"no kill point: {states(client, made)}"
        done = {name: s["output"] for name, s in states(client, made).items()
                if s["status"] == "SUCCESS"}
        live = half_written(out)
        if done and live:
            return done, live
        time.sleep(POLL)


def test_a_worker_killed_mid_suite_loses_no_verdict(recorded: Path, tmp_path: Path) -> None:
    project = Path(shutil.copytree(recorded, tmp_path / "project"))
    made = make_incidents(project)
    (project / "slow.stub.json").write_text(json.dumps(live_script(delay_ms=1500)))
    home = tmp_path / "home"
    env = {**base_env(home), "ANTHROPIC_API_KEY": "sk-stub"}
    logs = tmp_path / "logs"
    worker = start_worker("w1", env, logs)
    again = None
    try:
        wait_up(worker)
        with (tmp_path / "suite.err").open("w") as err:
            suite = subprocess.Popen(suite_args(), cwd=project, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=err)
        client = engine.Client(sqlite_url(home))
        try:
            done, live = wait_for_the_kill_point(client, made, project / "out", suite)
            worker.kill()
            # Its jobs die with it (a parent-death signal). One seen half-written may have
            # ended in the moment before the kill: that one is finished, and taken as is.
            wait_gone(worker)
            finished = [name for name in live if ended(project / "out" / name)]
            live = [name for name in live if name not in finished]
            again = start_worker("w1", env, logs)
            stdout, _ = suite.communicate(timeout=TIMEOUT)
        finally:
            client.close()
        said = (tmp_path / "suite.err").read_text()
        assert suite.returncode == 1, said[-3000:]
        document = json.loads(stdout)
        assert document["where"] == "on the workers (w1)"
        check_the_fix(document, made, project / "out")
        records = {r["incident"]: r for r in document["incidents"]}
        for name, output in done.items():  # checkpointed before the kill: kept, not rerun
            assert records[name]["process"] == output["process"], name
            assert records[name]["verdict"] == output["verdict"]
        for name in live:  # cut short: run again, its half-written cassette replaced
            assert records[name]["process"] != done.get(name, {}).get("process")
            assert "was left unfinished by an earlier attempt" in records[name]["output"]
        for name in finished:  # ended before the kill, its verdict not yet checkpointed
            assert "was finished by an earlier attempt" in records[name]["output"]
        assert all(r["worker"] == "w1" for r in records.values())
        resubmitted = subprocess.run(suite_args(), cwd=project, env=env, text=True,
                                     capture_output=True, timeout=TIMEOUT)
        assert resubmitted.returncode == 1, resubmitted.stderr[-3000:]
        assert json.loads(resubmitted.stdout)["incidents"] == document["incidents"]
    finally:
        for process in (worker, again):
            if process is not None:
                process.reap()
    assert "Traceback" not in "".join(p.read_text() for p in logs.glob("*.log"))
