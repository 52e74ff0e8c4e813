"""``deja worker``: take runs from the queue and run each under the harness, durably.

A worker is one executor of the engine (``runs.engine``) with a stable id. For each run
it dequeues, its agent step (:func:`AgentStep.__call__`):

1. takes the run's lock, so that two agents never run one run at once: a ``flock`` next to
   the cassette on one machine and, on Postgres, an advisory lock as well (both die with
   their holder; a run dispatched again waits for the old holder to be gone). That lock
   dies with the worker, but a dead worker's agent lives on until its parent-death signal
   has ended it (it writes an ``interrupted`` end line; a tool stuck in a C call sees the
   signal only when the call returns), holding the cassette's writer lock: the step then
   waits for that writer to be gone too, so that the resume reads the cassette as the
   agent left it and is not refused;
2. runs ``deja record`` the first time, ``deja resume`` once the cassette holds a
   recorded prefix (a worker died mid-run, or the run asked a question): recorded turns
   replay, a trailing intent is settled, then the run goes on live. The child dies with
   the worker (a parent-death signal), so a killed worker never leaves an agent running;
3. watches the child: its progress record is copied to the runs database every half
   second, and a cancel asked through ``deja serve`` becomes the run's cancel flag, so the
   agent stops at its next boundary;
4. reads how the run ended from its cassette: ``completed`` (with the artefacts the
   verified cassette vouches for), ``exhausted``, ``stopped``, ``cancelled``,
   ``interrupted``, ``input_required`` (exit 75: the run's part ends; the answer
   enqueues the next part, which resumes the cassette with it), or ``failed``.

Every worker beats every 2 s in ``deja_workers``. A worker whose beat is older than 10 s is
dead: the first live peer to claim it asks the engine to recover its pending runs (they
are dispatched again, exactly once, and resumed as above). A worker stopped with SIGTERM
or SIGINT stops its agents (they end ``interrupted``, resumable) and exits without
finishing their runs, which the next worker with its id, or a peer, picks up again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from recorder.ask import ANSWER_ENV, EXIT_INPUT_REQUIRED, WORKER_ENV
from recorder.cassette.lock import describe, holder_of
from recorder.harness.child import preexec
from recorder.harness.progress import read_status, request_cancel, valid_run_id
from runs import schedules
from runs.config import cassette_dir, database_url, is_sqlite
from runs.errors import CassettesNotShared, WorkerIdTaken
from runs.spec import record_argv, resume_argv
from runs.store import Store

log = logging.getLogger("deja.runs")

BEAT = 2.0  # seconds between heartbeats
DEAD_AFTER = 10.0  # a worker whose last beat is older than this is dead
WATCH = 0.5  # seconds between looks at a running child
SHARE_MARKER = ".deja-share"


def default_worker_id() -> str:
    return f"{socket.gethostname()}-1"


def check_shared(store: Store, cassettes: Path) -> None:
    """The cassette directory must be the one every worker of this database writes to.

    The first worker leaves a marker with a random token in it and the token in the
    database; a worker that finds another token (or none) where the database expects one
    is looking at a different directory: a share that is not mounted, or another path.
    """
    try:
        cassettes.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CassettesNotShared(f"the cassette directory {cassettes} cannot be created "
                                 f"({exc.strerror or exc}); set DEJA_CASSETTE_DIR to a "
                                 "writable directory every worker reaches") from None
    marker = cassettes / SHARE_MARKER
    found = _read_marker(marker)
    created = False
    if found is None:  # the first worker here: create it whole, or read the winner's
        draft = cassettes / f"{SHARE_MARKER}.{os.getpid()}"
        draft.write_text(os.urandom(12).hex() + "\n")
        try:
            os.link(draft, marker)
            created = True
        except FileExistsError:
            pass
        finally:
            draft.unlink(missing_ok=True)
        found = _read_marker(marker)
    expected = store.get_meta("cassette_share")
    if expected is None and found is not None:
        if store.set_meta("cassette_share", found):
            store.set_meta("cassette_dir", str(cassettes))
            return
        expected = store.get_meta("cassette_share")
    if found != expected:
        if created:  # not the directory the database knows: leave it as it was
            marker.unlink(missing_ok=True)
            found = None
        where = store.get_meta("cassette_dir") or "the shared directory"
        raise CassettesNotShared(
            f"the cassette directory {cassettes} is not the one the other workers of this "
            f"database write to ({where}: its marker {SHARE_MARKER} is "
            f"{'missing' if found is None else 'different'} here). Mount that shared "
            "directory at the same path on every worker (NFS or the like, with working "
            "flock and rename) and point DEJA_CASSETTE_DIR at it")


def _read_marker(marker: Path) -> str | None:
    try:
        return marker.read_text().strip() or None
    except OSError:
        return None


def cassette_state(path: Path) -> tuple[str, dict[str, Any] | None]:
    """``("none", None)`` when no header is on disk, ``("open", None)`` for a recorded
    prefix, ``("ended", end_line)`` for a run that ended."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return "none", None
    lines = data.split(b"\n")
    if not lines or not lines[0].strip() or not data.startswith(b"{") or b"\n" not in data:
        return "none", None
    last = next((line for line in reversed(lines) if line.strip()), b"")
    if b'"kind":"end"' in last:
        with contextlib.suppress(ValueError):
            return "ended", json.loads(last)
    return "open", None


class RunLock:
    """A lock per run that dies with its holder: flock on one machine, plus a Postgres
    advisory lock when the runs database is Postgres (across machines)."""

    def __init__(self, store: Store, cassettes: Path) -> None:
        self.store = store
        self.dir = cassettes / ".locks"
        self.dir.mkdir(parents=True, exist_ok=True)

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
            if not is_sqlite(self.store.url):
                conn = self.store.engine.connect()
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


class WorkerStopping(BaseException):
    """The worker is stopping: the run's step must not finish (it is picked up again)."""


class AgentStep:
    """The engine's agent step: one run under the harness, from its cassette's state."""

    def __init__(self, store: Store, worker_id: str, cassettes: Path, cancelled: Any) -> None:
        self.store = store
        self.worker_id = worker_id
        self.locks = RunLock(store, cassettes)
        self.cancelled = cancelled
        self.stopping = threading.Event()
        self.children: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()

    def __call__(self, spec: dict[str, Any], answer: str | None,
                 workflow: str) -> dict[str, Any]:
        run_id = spec["run_id"]
        if not valid_run_id(run_id):
            return {"status": "failed", "error": f"{run_id!r} is not a run id"}
        self.store.update_run(run_id, status="working", worker=self.worker_id, question=None)
        with self.locks.hold(run_id, self.stopping):
            outcome = self._run(spec, answer, workflow)
        fields: dict[str, Any] = {"status": outcome["status"],
                                  "question": outcome.get("question"),
                                  "error": outcome.get("error")}
        if "artefacts" in outcome:
            fields["artefacts"] = outcome["artefacts"]
        progress = read_status(run_id)
        if progress is not None:
            fields["progress"] = progress
        self.store.update_run(run_id, **fields)
        if outcome["status"] != "input_required":
            schedules.after_run(self.store, run_id)
        return outcome

    def _last_writer_gone(self, run_id: str, cassette: Path) -> None:
        """Wait until no process holds the cassette's writer lock (a dead worker's agent,
        still ending); said once in the log when it takes a while."""
        since = time.monotonic()
        said = False
        while (holder := holder_of(cassette)) is not None:
            if not said and time.monotonic() - since > DEAD_AFTER:
                said = True
                log.warning("run %s: waiting for %s to stop writing %s before resuming it",
                            run_id, describe(holder), cassette)
            if self.stopping.wait(0.1):
                raise WorkerStopping

    def _run(self, spec: dict[str, Any], answer: str | None, workflow: str) -> dict[str, Any]:
        cassette = Path(spec["cassette"])
        self._last_writer_gone(spec["run_id"], cassette)
        state, end = cassette_state(cassette)
        if state == "ended" and end is not None and end.get("status") != "interrupted":
            return self._ended(spec, end)  # dispatched again after it ended: report it
        argv = record_argv(spec) if state == "none" else resume_argv(spec)
        env = dict(os.environ)
        env[WORKER_ENV] = "1"
        env.pop(ANSWER_ENV, None)
        if answer is not None:
            env[ANSWER_ENV] = answer
        if self.stopping.is_set():
            raise WorkerStopping
        try:
            child = subprocess.Popen(argv, cwd=spec["cwd"], env=env, preexec_fn=preexec())
        except OSError as exc:
            return {"status": "failed", "error": f"the worker cannot start deja ({exc})"}
        with self._lock:
            self.children.add(child)
        try:
            code = self._watch(spec["run_id"], workflow, child)
        finally:
            with self._lock:
                self.children.discard(child)
        if self.stopping.is_set():
            raise WorkerStopping  # the run stays pending; it resumes on the next dispatch
        state, end = cassette_state(cassette)
        if state == "ended" and end is not None:
            return self._ended(spec, end)
        record = read_status(spec["run_id"]) or {}
        if code == EXIT_INPUT_REQUIRED and record.get("status") == "input_required":
            return {"status": "input_required", "question": record.get("question")}
        if state == "none":
            return {"status": "failed", "error": f"the program did not start recording "
                                                 f"(deja exited {code})"}
        return {"status": "failed",
                "error": f"the program ended without an end line (exit status {code})"}

    def _watch(self, run_id: str, workflow: str, child: subprocess.Popen[bytes]) -> int:
        asked = False
        last: str | None = None
        while True:
            try:
                return child.wait(WATCH)
            except subprocess.TimeoutExpired:
                pass
            record = read_status(run_id)
            if record is not None:
                text = json.dumps(record, sort_keys=True)
                if text != last:
                    last = text
                    with contextlib.suppress(sa.exc.SQLAlchemyError, OSError):
                        self.store.update_run(run_id, progress=record)
            if not asked:
                with contextlib.suppress(Exception):
                    if self.cancelled(workflow):
                        request_cancel(run_id, "cancelled through deja serve")
                        asked = True

    def _ended(self, spec: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
        status = str(end.get("status"))
        if status == "completed":
            return {"status": "completed", "artefacts": schedules.verified_artefacts(spec)}
        if status == "error":
            error = end.get("error") or {}
            message = error.get("message") if isinstance(error, dict) else None
            return {"status": "failed", "error": message or "the program failed"}
        return {"status": status}

    def stop(self) -> None:
        """Stop every running agent (each ends ``interrupted``, resumable)."""
        self.stopping.set()
        with self._lock:
            children = list(self.children)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(0.1, deadline - time.monotonic()))


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


def _beat_and_watch(store: Store, worker_id: str, recover: Any, stop: threading.Event,
                    check_every: float) -> None:
    host, pid = socket.gethostname(), os.getpid()
    last_check = 0.0
    while not stop.wait(BEAT):
        try:
            store.beat(worker_id, host, pid)
            now = time.time()
            for peer in store.workers():
                if peer["worker_id"] == worker_id or peer["taken_over_by"] is not None:
                    continue
                if now - peer["beat"] > DEAD_AFTER and store.claim_dead(
                        peer["worker_id"], worker_id, now - DEAD_AFTER):
                    taken = recover([peer["worker_id"]])
                    log.warning("worker %s is dead (last beat %.0f s ago); %s took over %d "
                                "run(s): %s", peer["worker_id"], now - peer["beat"],
                                worker_id, len(taken), ", ".join(taken) or "none")
            if now - last_check >= check_every:
                last_check = now
                schedules.check(store)
        except Exception:  # a database hiccup must not stop the heartbeat
            log.exception("worker %s: heartbeat", worker_id)


def serve(worker_id: str, url: str | None = None, concurrency: int = 1,
          check_every: float = 15.0) -> None:
    """Run a worker until SIGTERM or SIGINT."""
    from runs import engine

    url = url or database_url()
    cassettes = cassette_dir()
    store = Store(url)
    WorkerIdLock(store, worker_id)
    check_shared(store, cassettes)
    worker = engine.Worker(url, worker_id, concurrency)
    step = AgentStep(store, worker_id, cassettes, worker.cancelled)
    engine.set_hooks(agent=step,
                     occurrence=lambda name, when: schedules.occurrence(store, name, when))
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    store.beat(worker_id, socket.gethostname(), os.getpid(), first=True)
    worker.launch()
    worker.backfill_unfired({s["name"]: s["created"] for s in store.schedules()})
    sys.stderr.write(f"deja: worker {worker_id} is up ({concurrency} at a time; "
                     f"database {'embedded SQLite' if is_sqlite(url) else 'Postgres'}, "
                     f"cassettes in {cassettes})\n")
    sys.stderr.flush()
    beat = threading.Thread(target=_beat_and_watch, name="deja-heartbeat", daemon=True,
                            args=(store, worker_id, worker.recover, stop, check_every))
    beat.start()
    while not stop.wait(1.0):
        pass
    sys.stderr.write(f"deja: worker {worker_id} is stopping; its runs in flight are "
                     "picked up again\n")
    sys.stderr.flush()
    step.stop()
    os._exit(0)  # without finishing the engine's steps in flight: they are resumed later
