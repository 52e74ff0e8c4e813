"""Incident suites on the durable workers: each incident of a ``deja suite`` is one
workflow of the engine, run by whichever ``deja worker`` takes it.

- :func:`live_workers` says whether a worker runs against the database (a heartbeat newer
  than :data:`deja.runs.locks.DEAD_AFTER`, from a process that still lives when it is on
  this machine), without creating an embedded database that is not there.
- :class:`WorkersRunner` is a :class:`replayer.suite.Runner`: it registers the suite's
  queue (``-j`` incidents at a time across the workers), enqueues each job under a
  deterministic workflow id (a suite submitted again with the same id runs no incident
  twice and collects the verdicts it already has), and polls the engine until every
  workflow has ended; each verdict is the output of its workflow's step, which the engine
  checkpointed. A job's command line is stored in the database, so one that holds a
  secret is refused, as a submitted run's is.
- :class:`JobStep` is the worker's side: the step runs the job as a child that dies with
  the worker (:func:`replayer.suite.run_job`); a worker stopping (SIGTERM) stops its
  children and leaves their workflows pending, for the next worker, instead of
  checkpointing the verdict of an incident it cut short.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from deja.runs.config import is_sqlite, sqlite_path
from deja.runs.errors import DatabaseUnavailable
from deja.runs.locks import DEAD_AFTER, WorkerStopping
from deja.runs.output import Children
from deja.runs.spec import _command
from recorder.harness.warm_pool import WarmPool
from replayer.suite import Job, OnDone, Record, run_job, warm_pool

log = logging.getLogger("deja.runs")

POLL = 0.25  # seconds between looks at the engine while a suite runs
NO_WORKER_NOTE = 20.0  # seconds without a live worker before the suite says so


def live_workers(url: str) -> list[str] | None:
    """The workers that beat within :data:`DEAD_AFTER` seconds; None when the database
    cannot be reached. An embedded database that does not exist has none (and is not
    created)."""
    if is_sqlite(url) and not sqlite_path(url).exists():
        return []
    from deja.runs.store import Store  # the database layer: only when there is a database

    try:
        store = Store(url)
    except DatabaseUnavailable:
        return None
    try:
        now = time.time()
        return [w["worker_id"] for w in store.workers()
                if now - w["beat"] <= DEAD_AFTER and w["taken_over_by"] is None
                and not _gone_here(w)]
    except DatabaseUnavailable:
        return None
    finally:
        store.close()


def _gone_here(worker: dict[str, Any]) -> bool:
    """A worker of this machine whose process is gone (stopped a moment ago: its last beat
    is still fresh)."""
    if worker["host"] != socket.gethostname():
        return False
    try:
        os.kill(int(worker["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, TypeError):
        return False
    return False


def check_storable(jobs: Sequence[Job]) -> None:
    """Refuse (``BadRunRequest``) a job whose command line holds a secret: it would be
    stored in the runs database."""
    for job in jobs:
        _command({"command": list(job.argv)})


class WorkersRunner:
    """Run a suite's jobs on the workers of the database at ``url``; see the module
    docstring. ``say`` reports what the suite waits for (no worker up): its ``what``
    (``incidents``, a sweep's ``forks``) wait, unless the user does ``again`` (how to run
    them here instead)."""

    def __init__(self, url: str, suite_id: str, say: Any = None, *, what: str = "incidents",
                 again: str | None = None) -> None:
        self.url, self.suite_id = url, suite_id
        self.say = say or (lambda text: None)
        self.what = what
        self.again = again or f"run the suite again with --inline --id {suite_id}"

    def __call__(self, jobs: Sequence[Job], parallel: int,
                 on_done: OnDone | None) -> list[Record]:
        from deja.runs import engine

        check_storable(jobs)
        client = engine.Client(self.url)
        try:
            queue = client.suite_queue(self.suite_id, parallel)
            ids = [engine.suite_workflow_id(self.suite_id, job.key) for job in jobs]
            for workflow, job in zip(ids, jobs, strict=True):
                client.enqueue_job(queue, workflow, job.to_dict())
            records = self._collect(client, ids, jobs, on_done)
            client.remove_queue(queue)
        finally:
            client.close()
        return records

    def _collect(self, client: Any, ids: list[str], jobs: Sequence[Job],
                 on_done: OnDone | None) -> list[Record]:
        """Poll the engine until every workflow has ended; each one's record as it
        ends, and all of them in the jobs' order."""
        from deja.runs import engine

        found: dict[str, Record] = {}
        keys = dict(zip(ids, (job.key for job in jobs), strict=True))
        alone_since: float | None = None
        said = False
        while len(found) < len(ids):
            pending = [w for w in ids if w not in found]
            for workflow, state in client.states(pending).items():
                if state["status"] in engine.ENDED:
                    found[workflow] = _record_of(keys[workflow], state)
                    if on_done is not None:
                        on_done(found[workflow])
            if len(found) == len(ids):
                break
            alone_since, said = self._no_worker(alone_since, said)
            time.sleep(POLL)
        return [found[w] for w in ids]

    def _no_worker(self, since: float | None, said: bool) -> tuple[float | None, bool]:
        """Say once when no worker has been up for a while: the incidents wait in the
        queue until one starts."""
        now = time.monotonic()
        if said or (since is not None and now - since < NO_WORKER_NOTE):
            return since, said
        if live_workers(self.url):
            return None, False
        if since is None:
            return now, False
        self.say(f"no worker has been up for {NO_WORKER_NOTE:.0f} s: the {self.what} wait in "
                 f"the queue until one starts (deja worker), or {self.again}")
        return since, True


def _record_of(key: str, state: dict[str, Any]) -> Record:
    """An ended workflow's record: its output, or why it has none."""
    output = state.get("output")
    if state["status"] == "SUCCESS" and isinstance(output, dict):
        return output
    why = {"CANCELLED": "its workflow was cancelled",
           "MAX_RECOVERY_ATTEMPTS_EXCEEDED": "its workflow was recovered too many times"
           }.get(state["status"], f"its workflow failed: {state.get('error')}")
    return {"incident": key, "verdict": "error", "error": f"{why} (on worker "
                                                         f"{state.get('executor')})"}


class JobStep:
    """The engine's suite-job step on a worker: run the job, return its record. Warm jobs
    start as forks of one fork server the worker starts with its first such job and keeps
    until it stops (:func:`replayer.suite.warm_pool`)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.stopping = threading.Event()
        self.children = Children()
        self._pools = contextlib.ExitStack()
        self._pool: WarmPool | None = None
        self._pool_tried = False
        self._pool_lock = threading.Lock()

    def __call__(self, job: dict[str, Any]) -> dict[str, Any]:
        if self.stopping.is_set():
            raise WorkerStopping
        task = Job.from_dict(job)
        record = run_job(task, started=self.children.add,
                         pool=self._warm() if task.warm else None)
        if self.stopping.is_set():  # cut short by the stop: the next worker runs it again
            raise WorkerStopping
        return {**record, "worker": self.worker_id}

    def _warm(self) -> WarmPool | None:
        """The worker's fork server, started once (None: it could not start)."""
        with self._pool_lock:
            if not self._pool_tried and not self.stopping.is_set():
                self._pool_tried = True
                self._pool = self._pools.enter_context(warm_pool())
            return self._pool

    def stop(self) -> None:
        """Stop the jobs running here (their workflows stay pending), then the fork
        server."""
        self.stopping.set()
        self.children.stop()
        with self._pool_lock:
            self._pool = None
            self._pools.close()
