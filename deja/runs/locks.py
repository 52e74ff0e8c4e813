"""What keeps the workers of one runs database from stepping on each other: one agent per
run, one live worker per id.

- :class:`RunLock`: a lock per run that dies with its holder, a ``flock`` next to the
  cassettes on one machine and, on Postgres, an advisory lock as well (across machines).
  A run dispatched again waits for the old holder to be gone; a worker that is stopping
  gives up waiting (:class:`WorkerStopping`), and the run is picked up again later.
- :class:`WorkerIdLock`: a ``flock`` under ``$DEJA_HOME/workers`` on this machine, and no
  fresh heartbeat (:data:`DEAD_AFTER`) from another machine under the same id.

The cassette directory the locks sit in is checked to be the shared one by
:func:`deja.runs.cassettes.check_shared`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa

from deja.runs.config import is_sqlite
from deja.runs.errors import WorkerIdTaken
from deja.runs.store import Store

DEAD_AFTER = 10.0  # a worker whose last beat is older than this is dead


def live_workers(store: Store) -> set[str]:
    """The ids of the workers whose last beat is younger than :data:`DEAD_AFTER`."""
    now = time.time()
    return {w["worker_id"] for w in store.workers() if now - w["beat"] < DEAD_AFTER}


class WorkerStopping(BaseException):
    """The worker is stopping: the run's step must not finish (it is picked up again)."""


class RunLock:
    """A lock per run that dies with its holder: flock on one machine, plus a Postgres
    advisory lock when the runs database is Postgres (across machines)."""

    def __init__(self, store: Store, cassettes: Path) -> None:
        self.store = store
        self.dir = cassettes / ".locks"
        self.dir.mkdir(parents=True, exist_ok=True)
        # An advisory lock is held by a session for the whole run: each run holds a
        # connection of its own, outside the store's small pool, which the bookkeeping of
        # every other run (and the heartbeat) shares; closing it releases the lock.
        self.lock_engine: sa.Engine | None = None
        if not is_sqlite(store.url):
            from deja.runs.config import sqlalchemy_url

            self.lock_engine = sa.create_engine(sqlalchemy_url(store.url),
                                                poolclass=sa.pool.NullPool)

    @contextlib.contextmanager
    def hold(self, run_id: str, stopping: threading.Event) -> Iterator[None]:
        fd = os.open(self.dir / f"{run_id}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        conn: sa.Connection | None = None
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if stopping.wait(0.2):
                        raise WorkerStopping from None
            if self.lock_engine is not None:
                conn = self._connect(stopping)
                key = sa.text("select pg_try_advisory_lock(hashtextextended(:run, 0))")
                while not conn.execute(key, {"run": run_id}).scalar():
                    conn.rollback()
                    if stopping.wait(0.5):
                        raise WorkerStopping
                conn.commit()
            yield
        finally:
            if conn is not None:
                with contextlib.suppress(sa.exc.SQLAlchemyError):
                    conn.execute(sa.text("select pg_advisory_unlock_all()"))
                    conn.commit()
                conn.close()
            os.close(fd)

    def _connect(self, stopping: threading.Event) -> sa.Connection:
        """A connection for the run's advisory lock, waiting out a database outage."""
        assert self.lock_engine is not None
        while True:
            try:
                return self.lock_engine.connect()
            except sa.exc.OperationalError:
                if stopping.wait(1.0):
                    raise WorkerStopping from None



class WorkerIdLock:
    """One live worker per id: a flock on this machine, a fresh heartbeat elsewhere."""

    def __init__(self, store: Store, worker_id: str) -> None:
        from recorder.cassette.keys import deja_home

        folder = deja_home() / "workers"
        folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(folder / f"{worker_id}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                          0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise WorkerIdTaken(f"worker id {worker_id!r} is in use by a live worker on this "
                                "machine; give each worker its own --id") from None
        row = store.worker(worker_id)
        host = socket.gethostname()
        if row is not None and row["host"] != host and time.time() - row["beat"] < DEAD_AFTER:
            os.close(self.fd)
            raise WorkerIdTaken(f"worker id {worker_id!r} is in use by a live worker on "
                                f"{row['host']} (last beat {time.time() - row['beat']:.0f} s "
                                "ago); give each worker its own --id")
