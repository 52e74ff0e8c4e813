"""An agent that dies alone (the out-of-memory killer picks it, not its worker): the run is
dispatched again and resumed from its cassette, a few times with a pause between, and then
fails with the reason.

The reconciliation example (``examples/reconciliation.py``: 61 turns, 20 payments into an
external SQLite ledger keyed by deja's idempotency key) runs under ``python -m deja worker``,
a real process with its own DEJA_HOME, embedded database and stub model:

- the agent killed with SIGKILL mid-run, found through its status record (the pid of the
  process that records the run) and checked in ``/proc`` to be the agent;
- ``deja record``, the worker's child that launches the agent, killed with SIGKILL (the
  agent then gets its parent-death signal and ends ``interrupted``);
- the agent killing itself with SIGKILL right after a payment, before its outcome is
  logged (``RECON_CRASH``), twice: the run completes;
- a small agent that kills itself each time it runs, four times, one more than the
  retries: the run fails, saying why.

A run that completes is the uninterrupted run: the same transcript, exactly its payments,
each once under its intent's key. The worker prints one line per retry and per failed
run, and no traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runs_helpers import (
    KEY,
    SCRIPT,
    Reference,
    WorkerProcess,
    base_env,
    check_like_reference,
    line_count,
    open_runs,
    reconciliation,
    record_reference,
    resumed_lines,
    sqlite_url,
    start_worker,
    story,
    submit,
    wait_up,
)

from deja.runs import service
from deja.runs.store import ENDED
from recorder.cassette import load
from recorder.cassette.keys import Keyring
from recorder.testing.server import StubServer

TIMEOUT = 300.0  # for a run to end on two busy cores
RETRIES = "0.5,0.5,0.5"  # DEJA_AGENT_RETRIES for these tests: three, without the long waits
# A traceback through the worker or the engine (an agent's own, on the output the worker
# passes on, is the agent's business).
TRACEBACK = re.compile(r'File "[^"]*/(runs|dbos)/_?\w+\.py"|heartbeat: ')


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    with StubServer(SCRIPT) as server:
        return record_reference(tmp_path_factory.mktemp("agent-death-ref"), server.url)


class Rig:
    """One worker, its database, its cassettes, its ledger and a stub model."""

    def __init__(self, folder: Path, runs: service.Runs, server: StubServer,
                 **env: str) -> None:
        self.folder = folder
        self.home = folder / "home"
        self.cassettes = folder / "cassettes"
        self.ledger = folder / "ledger.sqlite"
        self.runs = runs
        self.env = base_env(self.home, DEJA_CASSETTE_DIR=str(self.cassettes),
                            RECON_LEDGER=str(self.ledger), ANTHROPIC_BASE_URL=server.url,
                            DEJA_AGENT_RETRIES=RETRIES, **env)
        self.worker: WorkerProcess | None = None

    def start(self) -> WorkerProcess:
        self.worker = start_worker("w1", self.env, self.folder / "logs")
        wait_up(self.worker)
        return self.worker

    def submit(self) -> str:
        return submit(self.runs, self.cassettes, reconciliation())

    def log(self) -> str:
        return self.worker.log() if self.worker else ""

    def run_script(self, name: str, source: str) -> tuple[str, Path, dict[str, Any], str]:
        """Start the worker, run ``source`` as the agent ``name`` until its run ends: the
        run's id, its cassette, its final record, and what to show when an assert fails."""
        (self.folder / name).write_text(source)
        self.start()
        run_id = submit(self.runs, self.cassettes, {"command": [sys.executable, name],
                                                    "cwd": str(self.folder)})
        cassette = self.cassettes / f"{run_id}.jsonl"
        final = self.ended(run_id)
        return run_id, cassette, final, f"run {run_id}\n{story(cassette)}\n{self.log()}"

    def wait(self, what: str, probe: Any, every: float = 0.05) -> Any:
        deadline = time.monotonic() + TIMEOUT
        while True:
            got = probe()
            if got:
                return got
            assert self.worker is not None and self.worker.alive(), self.log()
            assert time.monotonic() < deadline, f"{what} did not happen:\n{self.log()}"
            time.sleep(every)

    def ended(self, run_id: str) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            record = self.runs.get(run_id)
            row = self.runs.store.get_run(run_id)
            # the status and the worker's bookkeeping of it (the row) both say it ended
            return record if record["status"] in ENDED and row and row["status"] in ENDED \
                else None
        return dict(self.wait(f"run {run_id} to end", probe, every=0.2))

    def agent_pid(self, run_id: str) -> int:
        """The live agent of the run: the pid its status record names, checked in /proc."""
        def probe() -> int | None:
            try:
                record = json.loads((self.home / "runs" / f"{run_id}.json").read_text())
                with open(f"/proc/{record['pid']}/cmdline", "rb") as fh:
                    cmdline = fh.read()
            except (OSError, ValueError, KeyError):
                return None
            argv = cmdline.split(b"\0")  # the agent's, not its launcher's (`-m deja`)
            return int(record["pid"]) if any(a.endswith(b"reconciliation.py") for a in argv) \
                and b"deja" not in argv else None
        return int(self.wait("the agent's pid", probe, every=0.01))

    def launcher_pid(self, run_id: str) -> int:
        """The worker's child that runs ``deja record`` (or ``resume``) for the run."""
        assert self.worker is not None

        def probe() -> int | None:
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/stat", "rb") as fh:
                        ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        cmdline = fh.read()
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == self.worker.pid and b"deja" in cmdline.split(b"\0") and \
                        run_id.encode() in cmdline:  # type: ignore[union-attr]
                    return int(pid)
            return None
        return int(self.wait("the launcher's pid", probe, every=0.01))


@pytest.fixture
def rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rig]:
    env = getattr(request, "param", {})
    with StubServer(SCRIPT) as server, open_runs(sqlite_url(tmp_path / "home")) as runs:
        made = Rig(tmp_path, runs, server, **env)
        try:
            yield made
        finally:
            if made.worker is not None:
                made.worker.reap()


def _kill_mid_run(rig: Rig, reference: Reference, which: str) -> None:
    rig.start()
    run_id = rig.submit()
    cassette = rig.cassettes / f"{run_id}.jsonl"
    rig.wait("the run to be half way", lambda: line_count(cassette) >= reference.lines // 2,
             every=0.01)
    pid = rig.agent_pid(run_id) if which == "agent" else rig.launcher_pid(run_id)
    os.kill(pid, signal.SIGKILL)
    final = rig.ended(run_id)
    where = f"{which} killed; run {run_id}\n{story(cassette)}\n{rig.log()}"
    assert final["status"] == "completed", f"{final}\n{where}"
    run = check_like_reference(reference, cassette, rig.ledger, where)
    assert len(resumed_lines(run)) == 1, where
    assert "retry 1 of 3" in rig.log(), where
    assert not TRACEBACK.search(rig.log()), where


def test_an_agent_killed_mid_run_is_resumed_and_completes(rig: Rig,
                                                          reference: Reference) -> None:
    _kill_mid_run(rig, reference, "agent")


def test_a_launcher_killed_mid_run_is_resumed_and_completes(rig: Rig,
                                                            reference: Reference) -> None:
    _kill_mid_run(rig, reference, "launcher")


@pytest.mark.parametrize("rig", [{"RECON_CRASH": "8:after_ledger"}], indirect=True)
def test_an_agent_killed_twice_after_paying_completes_paying_each_once(
        rig: Rig, reference: Reference) -> None:
    """The agent dies inside its 8th live payment, after the ledger took it and before its
    outcome is logged; the resumed agent settles that payment (it went through) and dies
    again 8 live payments later. Two retries: the run completes, nothing paid twice."""
    rig.start()
    run_id = rig.submit()
    cassette = rig.cassettes / f"{run_id}.jsonl"
    final = rig.ended(run_id)
    where = f"run {run_id}\n{story(cassette)}\n{rig.log()}"
    assert final["status"] == "completed", f"{final}\n{where}"
    run = check_like_reference(reference, cassette, rig.ledger, where)
    assert len(resumed_lines(run)) == 2, where
    retries = re.findall(r"the agent was killed by signal 9 before its run ended; resumed "
                         r"in 0.5 s \(retry (\d) of 3\)", rig.log())
    assert retries == ["1", "2"], where
    assert not TRACEBACK.search(rig.log()), where


# An agent that dies each time it runs: one turn, then SIGKILL (resumed, it replays the
# turn and dies again).
DOOMED = """\
import os
import signal

import recorder

recorder.now()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_an_agent_that_keeps_dying_fails_with_the_reason_once_retries_are_spent(
        rig: Rig) -> None:
    """Four deaths, one more than the retries: the run fails and says why, in one line of
    the worker's output; its cassette is left open, for a resume by hand."""
    run_id, cassette, final, where = rig.run_script("doomed.py", DOOMED)
    assert final["status"] == "failed", f"{final}\n{where}"
    assert final["error"] == (
        "the agent died 4 times without closing its run ("
        + "; ".join(["the agent was killed by signal 9"] * 4)
        + f"); 3 retries are spent. It can be resumed by hand: deja resume {cassette}"), where
    assert [line for line in rig.log().splitlines() if "failed" in line] == \
        [f"deja: worker w1: run {run_id} failed: {final['error']}"], where
    assert len(re.findall(r"resumed in 0.5 s \(retry \d of 3\)", rig.log())) == 3, where
    assert not TRACEBACK.search(rig.log()), where
    left = load(cassette, keyring=Keyring.of(KEY), require_signature=True,
                allow_incomplete=True)
    assert left.end is None and len(left.observations) == 1, where  # the turn, once


# An agent whose run cannot be resumed: one turn, then it leaves its project's settings
# refused (a budget that is no table) and stops itself with SIGTERM, so the run ends
# interrupted; every resume is then refused at its start.
UNRESUMABLE = """\
import os
import signal
from pathlib import Path

import recorder

recorder.now()
Path("pyproject.toml").write_text('[tool.deja]\\nbudgets = "none"\\n')
os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_run_whose_resume_cannot_start_fails_with_the_reason_and_its_cassette_as_it_was(
        rig: Rig) -> None:
    """Each resume is refused before it runs (exit status 3) and leaves the cassette as it
    found it, its end line put back: each counts as an attempt that failed, not as the end
    line's disk error, and once the retries are spent the run fails saying why."""
    _, cassette, final, where = rig.run_script("unresumable.py", UNRESUMABLE)
    assert final["status"] == "failed", f"{final}\n{where}"
    not_resumed = "deja exited 3 and the run was not resumed"
    assert final["error"].startswith("the agent died 4 times without closing its run ("), where
    assert final["error"].endswith(
        "; ".join([not_resumed] * 3) + f"); 3 retries are spent. It can be resumed by hand: "
        f"deja resume {cassette}"), where
    assert rig.log().count("budgets must be a table of limits") == 3, where
    assert rig.log().count(f"the run was not resumed; {cassette} is as it was") == 3, where
    assert not TRACEBACK.search(rig.log()), where
    left = load(cassette, keyring=Keyring.of(KEY), require_signature=True)
    assert left.end is not None and left.end["status"] == "interrupted", where
    assert len(left.observations) == 1, where  # the turn, once: nothing was cut or added
