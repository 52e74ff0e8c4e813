"""A cancel and an answer, or a cancel and a worker, reaching one run at the same moment:
whoever moves the run first wins, the other is told, and a cancelled run runs nothing.

The moment is made exact by the engine's real client with a second caller's call slipped
into it (:class:`Meanwhile`): an answer's part is enqueued and, before the answer moves the
run's row, a cancel reads and moves it; or the reverse."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from lifecycle_helpers import (  # noqa: F401 (fixtures)
    ASKING_AGENT,
    PYTHON,
    QUICK_AGENT,
    Workers,
    ended,
    home_fixture,
    runs_fixture,
    status_of,
    status_of_row,
    wait_for,
    workers_fixture,
    write_agent,
)

from deja.runs import config, service
from deja.runs.errors import BadRunRequest
from deja.runs.store import DISK_ERROR
from deja.runs.worker import AgentStep


class Meanwhile:
    """The engine's client; ``then`` runs once, right after the named call reaches the
    engine (another caller acting on the run at that moment)."""

    def __init__(self, client: Any, call: str, then: Callable[[], Any]) -> None:
        self.client = client
        self.call = call
        self.then: Callable[[], Any] | None = then
        self.result: Any = None

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)
        if name != self.call:
            return method

        def called(*args: Any) -> Any:
            out = method(*args)
            if self.then is not None:
                then, self.then = self.then, None
                try:
                    self.result = then()
                except BadRunRequest as exc:  # what the other caller was told
                    self.result = exc
            return out

        return called


def waiting_run(runs: service.Runs, workers: Workers, tmp_path: Path) -> tuple[str, bytes]:
    """A run that asks a question and waits, no worker up; its id and its cassette."""
    agent = write_agent(tmp_path, "agent.py", ASKING_AGENT)
    run_id = str(runs.submit({"command": [PYTHON, agent.name],
                              "cwd": str(tmp_path)})["run_id"])
    first = workers.start("w1")
    wait_for("the run to ask", lambda: status_of(runs, run_id, "input_required"))
    # The engine records the end of the part just after the row says it waits.
    wait_for("the engine to record that the run's part ended",
             lambda: runs.client.states([run_id])[run_id]["status"] == "SUCCESS")
    first.stop()
    cassette = config.cassette_dir() / f"{run_id}.jsonl"
    assert ended(cassette) is None  # open, waiting for its answer
    return run_id, cassette.read_bytes()


def nothing_ran(runs: service.Runs, workers: Workers, tmp_path: Path, run_id: str,
                written: bytes) -> None:
    """A worker takes up what the engine holds: a run submitted after ``run_id`` ends, and
    ``run_id`` is still cancelled, not resumed."""
    worker = workers.start("w1")
    quick = runs.submit({"command": [PYTHON, write_agent(tmp_path, "quick.py",
                                                          QUICK_AGENT).name],
                         "cwd": str(tmp_path)})["run_id"]
    done = wait_for("a run submitted after it to end",
                    lambda: status_of(runs, quick, "completed", "failed"),
                    show=worker.output)
    assert done["status"] == "completed", done
    assert runs.get(run_id)["status"] == "cancelled"
    assert runs.store.get_run(run_id)["status"] == "cancelled"  # type: ignore[index]
    assert (config.cassette_dir() / f"{run_id}.jsonl").read_bytes() == written
    assert not (tmp_path / "decision.txt").exists()  # the answer was never acted on


def test_a_cancel_that_lands_while_an_answer_is_given_wins_and_the_answer_is_refused(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    run_id, written = waiting_run(runs, workers, tmp_path)
    client = Meanwhile(runs.client, "answer", lambda: runs.cancel(run_id))
    answering = service.Runs(runs.store, client)

    with pytest.raises(BadRunRequest, match=f"run {run_id} was cancelled as it was "
                                            "answered; the answer is not used"):
        answering.answer(run_id, "yes, pay it twice")
    assert client.result == {"run_id": run_id, "status": "cancelled", "was": "input_required"}
    # The answer's part, already enqueued, is cancelled in the engine too.
    part = runs.client.states([f"{run_id}.1"])[f"{run_id}.1"]
    assert part["status"] == "CANCELLED", part
    nothing_ran(runs, workers, tmp_path, run_id, written)


def test_an_answer_that_lands_while_a_cancel_is_made_is_cancelled_with_its_part(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    run_id, written = waiting_run(runs, workers, tmp_path)
    client = Meanwhile(runs.client, "cancel", lambda: runs.answer(run_id, "yes, twice"))
    cancelling = service.Runs(runs.store, client)

    # The cancel read the run waiting; the answer moved it to its next part before the
    # cancel wrote: the cancel reads it again and cancels that part.
    assert cancelling.cancel(run_id) == {"run_id": run_id, "status": "cancelled",
                                         "was": "queued"}
    assert client.result["answered"] is True
    part = runs.client.states([f"{run_id}.1"])[f"{run_id}.1"]
    assert part["status"] == "CANCELLED", part
    nothing_ran(runs, workers, tmp_path, run_id, written)


def test_a_part_that_a_later_part_followed_runs_nothing(
        runs: service.Runs, home: Path, tmp_path: Path) -> None:
    """The engine starts a part of a run whose row is already at a later part (one
    recovered after an answer was taken): it runs no program and leaves the row as it is."""
    run_id = runs.submit({"command": [PYTHON, write_agent(tmp_path, "quick.py",
                                                           QUICK_AGENT).name],
                          "cwd": str(tmp_path)})["run_id"]
    assert runs.store.move_run(run_id, "queued", 0, status="queued", attempt=2)
    assert not runs.store.move_run(run_id, "queued", 0, status="cancelled")  # moved already
    row = runs.store.get_run(run_id)
    assert row is not None
    step = AgentStep(runs.store, "w1", config.cassette_dir(), lambda workflow: False)
    assert step(row["spec"], None, f"{run_id}.1") == {
        "status": "superseded", "error": f"part {run_id}.1 of run {run_id} was followed by "
                                         "part 2; it ran nothing"}
    after = runs.store.get_run(run_id)
    assert after is not None
    assert (after["status"], after["attempt"], after["worker"]) == ("queued", 2, None)
    assert not Path(row["spec"]["cassette"]).exists()


def test_a_cancel_that_a_worker_beats_to_a_queued_run_stops_it_at_its_next_boundary(
        runs: service.Runs, home: Path, tmp_path: Path) -> None:
    """The cancel read the run queued; a worker took it up before the cancel wrote: the
    run is not marked cancelled under its running agent (two statuses), it is stopped."""
    run_id = runs.submit({"command": [PYTHON, write_agent(tmp_path, "quick.py",
                                                           QUICK_AGENT).name],
                          "cwd": str(tmp_path)})["run_id"]
    runs.store.beat("w1", socket.gethostname(), os.getpid(), first=True)  # a live worker
    client = Meanwhile(runs.client, "cancel",
                       lambda: runs.store.claim_run(run_id, "w1", 0))
    assert service.Runs(runs.store, client).cancel(run_id) == {
        "run_id": run_id, "status": "cancelling", "was": "working"}
    assert client.result is True  # the worker's claim went first
    row = runs.store.get_run(run_id)
    assert row is not None and (row["status"], row["worker"]) == ("working", "w1")
    # What the worker watches for, to stop its agent at the next boundary:
    assert runs.client.states([run_id])[run_id]["status"] == "CANCELLED"


def test_of_two_answers_given_at_once_one_is_used_and_the_other_caller_is_told(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    run_id, _ = waiting_run(runs, workers, tmp_path)
    client = Meanwhile(runs.client, "answer", lambda: runs.answer(run_id, "no, once"))
    answered = service.Runs(runs.store, client).answer(run_id, "yes, twice")
    assert answered["answered"] is True
    # The other answer came after this one reached the engine: it is not used, and says so.
    assert isinstance(client.result, BadRunRequest)
    assert str(client.result) == (f"run {run_id} was answered by another caller at the "
                                  "same moment; that answer is used, not this one")
    workers.start("w1")
    done = wait_for("the run to complete", lambda: status_of(runs, run_id, "completed",
                                                             "failed"))
    assert done["status"] == "completed", done
    assert (tmp_path / "decision.txt").read_text() == "answer: yes, twice\n"


def test_a_run_waiting_for_its_cassette_directory_can_be_cancelled(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    """A run interrupted by a full cassette directory is dispatched again once the
    directory is writable: until then it can be cancelled, and then it is not."""
    run_id, _ = waiting_run(runs, workers, tmp_path)  # a part ended, its cassette open
    runs.store.update_run(run_id, status="interrupted",
                          error=f"{DISK_ERROR}: the disk is full; the run is dispatched "
                                "again once it is writable")
    assert runs.cancel(run_id) == {"run_id": run_id, "status": "cancelled",
                                   "was": "interrupted"}
    assert runs.get(run_id)["status"] == "cancelled"
    assert not runs.store.requeue(run_id, "interrupted", 0)  # what reconcile would do
    assert runs.cancel(run_id)["note"] == "the run already ended cancelled"


def test_a_cancel_that_a_worker_beats_to_a_recovered_part_stops_it_at_its_next_boundary(
        runs: service.Runs, home: Path, tmp_path: Path) -> None:
    """A worker died mid-run and the engine queued its part again: the row still says
    working under the dead worker, the run reads queued. A live worker takes the part up
    between the cancel's read and its write: the run is stopped, not marked cancelled
    under its running agent."""
    run_id = runs.submit({"command": [PYTHON, write_agent(tmp_path, "quick.py",
                                                           QUICK_AGENT).name],
                          "cwd": str(tmp_path)})["run_id"]
    runs.store.update_run(run_id, status="working", worker="w0")  # w0 died with it
    assert runs.get(run_id)["status"] == "queued"  # the engine holds its part, queued
    runs.store.beat("w1", socket.gethostname(), os.getpid(), first=True)
    client = Meanwhile(runs.client, "cancel", lambda: runs.store.claim_run(run_id, "w1", 0))
    assert service.Runs(runs.store, client).cancel(run_id) == {
        "run_id": run_id, "status": "cancelling", "was": "working"}
    row = runs.store.get_run(run_id)
    assert row is not None and (row["status"], row["worker"]) == ("working", "w1")


def test_a_queued_run_whose_part_was_cancelled_before_it_started_ends_cancelled(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    """A cancel that reached the engine's part after a worker took it off the queue and
    before its step started: the step never runs to end the row, which said ``queued``
    for good. A worker's reconciliation ends it."""
    run_id = runs.submit({"command": [PYTHON, write_agent(tmp_path, "quick.py",
                                                           QUICK_AGENT).name],
                          "cwd": str(tmp_path)})["run_id"]
    runs.client.cancel(run_id)  # the engine's part only, as that cancel leaves it
    with runs.store.begin() as conn:  # older than a submission still on its way
        conn.execute(sa.text("UPDATE deja_runs SET updated = updated - 60 "
                             "WHERE run_id = :run"), {"run": run_id})
    worker = workers.start("w1")
    row = wait_for("the row to say cancelled",
                   lambda: status_of_row(runs, run_id, "cancelled"), show=worker.output)
    assert row["worker"] is None  # it never ran
    assert f"run {run_id}: cancelled before it started; it ends cancelled" in worker.output()
    assert not (config.cassette_dir() / f"{run_id}.jsonl").exists()
