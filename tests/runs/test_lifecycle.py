"""A run's lifecycle under real ``deja worker`` processes, driven through the runs service
(what ``deja serve`` and the CLI wrap): input required answered while no worker is up,
cancel of a queued and of a working run, a failing agent, and the named errors of bad
input (an unknown run, a database that is down, a cassette directory that is not
shared, a worker id already in use)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from lifecycle_helpers import (  # noqa: F401 (fixtures)
    ASKING_AGENT,
    FAILING_AGENT,
    PYTHON,
    QUICK_AGENT,
    SLOW_AGENT,
    Workers,
    cassette_lines,
    ended,
    home_fixture,
    runs_fixture,
    status_of,
    status_of_row,
    wait_for,
    workers_fixture,
    write_agent,
)

from deja.runs import config, engine, service
from deja.runs.cassettes import check_shared
from deja.runs.errors import CassettesNotShared, DatabaseUnavailable, WorkerIdTaken
from deja.runs.locks import WorkerIdLock
from deja.runs.store import Store
from deja.runs.worker import AgentStep
from recorder.errors import NoSuchRun


def submit(runs: service.Runs, directory: Path, agent: Path) -> str:
    return str(runs.submit({"command": [PYTHON, agent.name], "cwd": str(directory)})["run_id"])


def test_input_required_answered_while_the_worker_is_down(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    agent = write_agent(tmp_path, "agent.py", ASKING_AGENT)
    run_id = submit(runs, tmp_path, agent)
    cassette = config.cassette_dir() / f"{run_id}.jsonl"

    first = workers.start("w1")
    waiting = wait_for("the run to ask", lambda: status_of(runs, run_id, "input_required"))
    assert waiting["question"] == "Pay invoice INV-7 twice?"
    assert waiting["answer"] == f"deja answer {run_id} TEXT"
    first.stop()
    assert first.proc.returncode == 0, first.output()

    # No worker is up: the run still waits, and the answer is taken durably.
    assert runs.get(run_id)["status"] == "input_required"
    assert ended(cassette) is None  # a resumable prefix, no end line
    answered = runs.answer(run_id, "no, once is enough")
    assert answered == {"run_id": run_id, "status": "input_required",
                        "question": "Pay invoice INV-7 twice?", "answered": True}
    assert not (tmp_path / "decision.txt").exists()

    second = workers.start("w1")
    done = wait_for("the run to complete",
                    lambda: status_of(runs, run_id, "completed", "failed"))
    assert done["status"] == "completed", (done, second.output())
    assert (tmp_path / "decision.txt").read_text() == "answer: no, once is enough\n"
    assert [a["path"] for a in done["artefacts"]] == ["decision.txt"]
    second.stop()

    lines = cassette_lines(cassette)
    asks = [line for line in lines if line.get("kind") == "effect" and line["name"] == "ask"]
    assert [line["value"] for line in asks] == ["no, once is enough"]
    assert lines[-1]["kind"] == "end" and lines[-1]["status"] == "completed"

    # Offline, the answer comes from the cassette: nobody is asked (stdin is empty, no
    # worker, no answer file), and the program takes the same path.
    (tmp_path / "decision.txt").unlink()
    replay = subprocess.run(
        [PYTHON, "-m", "deja", "replay", str(cassette), "--", PYTHON, agent.name],
        cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "answer: no, once is enough" in replay.stdout
    assert "identical" in replay.stdout
    assert "asks:" not in replay.stderr
    assert (tmp_path / "decision.txt").read_text() == "answer: no, once is enough\n"


def test_cancel_of_a_queued_and_of_a_working_run(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    slow = write_agent(tmp_path, "slow.py", SLOW_AGENT)
    queued = submit(runs, tmp_path, slow)
    assert runs.cancel(queued) == {"run_id": queued, "status": "cancelled", "was": "queued"}
    assert runs.get(queued)["status"] == "cancelled"
    working = submit(runs, tmp_path, slow)  # queued behind the cancelled one

    worker = workers.start("w1")  # one at a time: the queue is taken in order
    wait_for("the second run to make turns",
             lambda: (runs.get(working).get("step") or "").startswith("tool tick"),
             show=lambda: (runs.get(working), worker.output()))
    asked = runs.cancel(working)
    assert asked == {"run_id": working, "status": "cancelling", "was": "working"}
    cassette = config.cassette_dir() / f"{working}.jsonl"
    end = wait_for("the working run to end at its next boundary", lambda: ended(cassette),
                   show=lambda: (runs.get(working), worker.output()))
    assert end["status"] == "cancelled", worker.output()
    lines = cassette_lines(cassette)
    ticks = [line for line in lines if line.get("kind") == "tool"]
    assert 0 < len(ticks) < 100  # it stopped well before its last turn
    stop = next(line for line in lines if line.get("event") == "cancelled")
    assert stop["detail"]["before"] == "tool tick"
    assert stop["detail"]["reason"] == "cancelled through deja serve"
    wait_for("the row to say cancelled",
             lambda: runs.store.get_run(working)["status"] == "cancelled")  # type: ignore[index]
    assert runs.get(working)["status"] == "cancelled"

    # The queued run never started: no cassette, no worker, still cancelled.
    assert not (config.cassette_dir() / f"{queued}.jsonl").exists()
    record = runs.get(queued)
    assert record["status"] == "cancelled"
    assert record["worker"] is None
    assert runs.store.get_run(queued)["status"] == "cancelled"  # type: ignore[index]
    assert {r["run_id"] for r in runs.list_runs(status=["cancelled"])} == {queued, working}


def killed_mid_run(runs: service.Runs, workers: Workers, tmp_path: Path) -> str:
    """A slow run, working under worker w1 when w1 and its agent get SIGKILL; its id."""
    run_id = submit(runs, tmp_path, write_agent(tmp_path, "slow.py", SLOW_AGENT))
    first = workers.start("w1")
    wait_for("the run to make turns",
             lambda: (runs.get(run_id).get("step") or "").startswith("tool tick"),
             show=lambda: (runs.get(run_id), first.output()))
    os.killpg(first.proc.pid, signal.SIGKILL)  # the worker and its agent, at once
    first.proc.wait(10)
    return run_id


def test_a_waiting_run_whose_worker_died_before_the_engine_knew_is_cancelled_for_good(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    """A worker wrote that its run waits for an answer and died before the engine recorded
    the end of the run's part: the row says ``input_required``, the engine still has the
    part pending. Cancelling the run cancels that part too: the run says cancelled, and
    a worker started with the same id does not take it up again."""
    run_id = killed_mid_run(runs, workers, tmp_path)
    runs.store.update_run(run_id, status="input_required", question="Go on?")
    assert runs.get(run_id)["status"] == "input_required"

    assert runs.cancel(run_id) == {"run_id": run_id, "status": "cancelled",
                                   "was": "input_required"}
    assert runs.get(run_id)["status"] == "cancelled"
    cassette = config.cassette_dir() / f"{run_id}.jsonl"
    written = cassette.read_bytes()

    workers.start("w1")  # the engine takes up the pending parts of w1 as it starts
    quick = submit(runs, tmp_path, write_agent(tmp_path, "quick.py", QUICK_AGENT))
    done = wait_for("a run submitted after it to end",
                    lambda: status_of(runs, quick, "completed", "failed"))
    assert done["status"] == "completed", done
    assert runs.get(run_id)["status"] == "cancelled"
    assert runs.store.get_run(run_id)["status"] == "cancelled"  # type: ignore[index]
    assert cassette.read_bytes() == written  # not resumed


def test_a_working_run_cancelled_while_its_worker_is_dead_stays_cancelled_when_it_restarts(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    """A worker is killed while its run works, the run is cancelled, and the worker comes
    back with the same id: the run says cancelled (no one is left to stop it at a boundary,
    and a live worker of its id made it read as still stopping), and it is not resumed."""
    run_id = killed_mid_run(runs, workers, tmp_path)
    cancelled = runs.cancel(run_id)
    assert cancelled["was"] == "working", cancelled
    cassette = config.cassette_dir() / f"{run_id}.jsonl"
    written = cassette.read_bytes()

    again = workers.start("w1")
    assert runs.get(run_id)["status"] == "cancelled", again.output()
    assert runs.store.get_run(run_id)["status"] == "cancelled"  # type: ignore[index]
    assert f"run {run_id}: cancelled while its worker was down" in again.output()
    assert cassette.read_bytes() == written  # not resumed


def test_a_part_of_a_run_cancelled_while_it_waited_runs_nothing(
        runs: service.Runs, home: Path, tmp_path: Path) -> None:
    """A part the engine starts for a run whose row says cancelled (a cancel that reached
    deja's row and not the engine) runs no program and leaves the run cancelled."""
    run_id = submit(runs, tmp_path, write_agent(tmp_path, "quick.py", QUICK_AGENT))
    runs.store.update_run(run_id, status="cancelled")
    row = runs.store.get_run(run_id)
    assert row is not None
    step = AgentStep(runs.store, "w1", config.cassette_dir(), lambda workflow: False)
    assert step(row["spec"], None, run_id) == {"status": "cancelled"}
    assert runs.store.get_run(run_id)["status"] == "cancelled"  # type: ignore[index]
    assert not Path(row["spec"]["cassette"]).exists()


def test_a_failing_agent_ends_failed_with_its_error(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    agent = write_agent(tmp_path, "failing.py", FAILING_AGENT)
    run_id = submit(runs, tmp_path, agent)
    workers.start("w1")
    record = wait_for("the run to end", lambda: status_of(runs, run_id, "failed", "completed"))
    assert record["status"] == "failed"
    assert record["error"] == "the ledger is locked"
    # The status comes from the end line; the worker's bookkeeping follows it.
    row = wait_for("the row to say failed",
                   lambda: status_of_row(runs, run_id, "failed"))
    assert row["error"] == "the ledger is locked"
    end = ended(config.cassette_dir() / f"{run_id}.jsonl")
    assert end is not None and end["status"] == "error"
    assert [r["run_id"] for r in runs.list_runs(status=["failed"])] == [run_id]


def test_an_unknown_run_is_named_with_the_fix(runs: service.Runs) -> None:
    for call in (runs.get, runs.cancel, lambda run: runs.answer(run, "yes")):
        with pytest.raises(NoSuchRun, match=r"no run 'r_0000000000000000dead' in the runs "
                                             r"database .*`deja runs` lists the runs it holds"):
            call("r_0000000000000000dead")
    with pytest.raises(NoSuchRun, match=r"no run '\.\./etc/passwd'"):
        runs.get("../etc/passwd")


def test_the_embedded_database_is_made_in_a_fresh_deja_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = tmp_path / "never-used" / ".deja"
    monkeypatch.setenv("DEJA_HOME", str(fresh))
    monkeypatch.delenv("DEJA_DATABASE_URL", raising=False)
    store = Store(config.database_url())
    try:
        assert store.list_runs() == []
        assert (fresh / "runs.sqlite").is_file()
    finally:
        store.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_database_that_is_down_is_named_with_the_fix(workers: Workers) -> None:
    url = f"postgresql://deja:s3cret-pw@127.0.0.1:{_closed_port()}/deja"
    fix = "start the Postgres server, or point DEJA_DATABASE_URL at one that runs"
    for connect in (Store, engine.Client):
        with pytest.raises(DatabaseUnavailable) as caught:
            connect(url)
        message = str(caught.value)
        host = url.rpartition("@")[2]
        assert message.startswith(f"the runs database postgresql://deja:***@{host} "
                                  "cannot be reached (")
        assert "Connection refused" in message and message.endswith(fix)
        assert "s3cret-pw" not in message

    worker = workers.start("w1", "--db", url, wait=False)
    assert worker.wait_exit() != 0
    output = worker.output()
    assert "DatabaseUnavailable" in output and fix in output
    assert "s3cret-pw" not in output


def test_a_second_worker_is_refused_a_taken_id_or_an_unshared_cassette_dir(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    workers.start("w1")
    cassettes = config.cassette_dir()
    assert (cassettes / ".deja-share").is_file()

    same_id = workers.start("w1", wait=False)
    assert same_id.wait_exit() != 0
    assert "WorkerIdTaken: worker id 'w1' is in use by a live worker on this machine; " \
           "give each worker its own --id" in same_id.output()
    with pytest.raises(WorkerIdTaken, match="give each worker its own --id"):
        WorkerIdLock(runs.store, "w1")

    elsewhere = tmp_path / "not-the-share"
    other_dir = workers.start("w2", env={"DEJA_CASSETTE_DIR": str(elsewhere)}, wait=False)
    assert other_dir.wait_exit() != 0
    output = other_dir.output()
    assert f"CassettesNotShared: the cassette directory {elsewhere} is not the one the " \
           f"other workers of this database write to ({cassettes}: its marker " \
           ".deja-share is missing here)" in output
    assert "point DEJA_CASSETTE_DIR at it" in output
    with pytest.raises(CassettesNotShared, match="is not the one the other workers"):
        check_shared(runs.store, elsewhere)
    assert "is up" not in output
