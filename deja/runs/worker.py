"""``deja worker``: take runs from the queue and run each under the harness, durably.

A worker is one executor of the engine (``deja.runs.engine``) with a stable id. For each run
it dequeues, its agent step (:func:`AgentStep.__call__`):

1. takes the run's lock (:class:`deja.runs.locks.RunLock`), so that two agents never run one
   run at once: it dies with its holder, and a run dispatched again waits for the old
   holder to be gone. That lock dies with the worker, but a dead worker's agent lives on
   until its parent-death signal has ended it (it writes an ``interrupted`` end line; a
   tool stuck in a C call sees the signal only when the call returns), holding the
   cassette's writer lock: the step then waits for that writer to be gone too, so that
   the resume reads the cassette as the agent left it and is not refused;
2. runs ``deja record`` the first time, ``deja resume`` once the cassette holds a
   recorded prefix (a worker died mid-run, or the run asked a question): recorded turns
   replay, a trailing intent is settled, then the run goes on live. The child dies with
   the worker (a parent-death signal), so a killed worker never leaves an agent running;
3. watches the child: its progress record is copied to the runs database every half
   second, and a cancel asked through ``deja serve`` becomes the run's cancel flag, so the
   agent stops at its next boundary;
4. reads how the run ended from its cassette's end line
   (:func:`recorder.cassette.schema.run_status`): ``completed`` (with the artefacts the
   verified cassette vouches for), ``failed`` (the end line's ``error``), ``exhausted``,
   ``stopped``, ``cancelled``, or ``input_required`` (exit 75: the run's part ends; the
   answer enqueues the next part, which resumes the cassette with it);
5. an agent that dies alone (the out-of-memory killer, a SIGKILL of the agent or of its
   ``deja record``: its child ends without a final end line, or with an ``interrupted``
   one the worker did not ask for) is a crash: after 1, 4 and 16 s (``DEJA_AGENT_RETRIES``)
   the step resumes the cassette, as for a dead worker's run; one more death and the run
   fails, saying how the agent died each time (its cassette stays open, for ``deja
   resume`` by hand, and its status record says ``failed``). The count starts again on
   each dispatch of the run;
6. a run stopped by its cassette directory (full, read-only, failing: the end line's
   ``CassetteWriteError``, or no end line and a probe of the directory that fails,
   :func:`deja.runs.cassettes.disk_trouble`) ends ``interrupted`` with that error;
   :func:`reconcile` dispatches it again, as its next part, once a probe writes there.

A worker starts by taking its id (:class:`deja.runs.locks.WorkerIdLock`: one live worker per
id) and by checking that its cassette directory is the one its peers write to
(:func:`deja.runs.cassettes.check_shared`). Every worker beats every 2 s in ``deja_workers``. A
worker whose beat is older than 10 s is dead: the first live peer to claim it asks the
engine to recover its pending runs (they are dispatched again, exactly once, and resumed
as above). After the database was unreachable, a worker claims nobody for 10 s (every beat
is old then). A worker stopped with SIGTERM or SIGINT stops its agents (they end
``interrupted``, resumable) and exits without finishing their runs, which the next worker
with its id, or a peer, picks up again.

The worker's bookkeeping waits for a database that cannot be reached (a Postgres
restart) instead of failing the run: the outage is said once when it starts and once when
it ends. Its output is one line per event (a failed run, a retry, a takeover): the
engine's tracebacks and its complaints at every poll of a database that is away are left
out (``deja.runs.engine``). Every 5 s, and at start, :func:`reconcile` brings the database and
the engine's queue back into agreement.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from deja.runs import schedules
from deja.runs.cassettes import _write_error, cassette_state, check_shared, disk_trouble
from deja.runs.config import cassette_dir, database_url, is_sqlite
from deja.runs.errors import DatabaseUnavailable
from deja.runs.locks import DEAD_AFTER, RunLock, WorkerIdLock, WorkerStopping
from deja.runs.output import Children, StderrTail
from deja.runs.spec import part_of, record_argv, resume_argv, workflow_id
from deja.runs.store import DISK_ERROR, Store
from deja.runs.suites import JobStep
from recorder.ask import ANSWER_ENV, EXIT_INPUT_REQUIRED, WORKER_ENV
from recorder.cassette.lock import describe, holder_of
from recorder.cassette.schema import run_status
from recorder.errors import EXIT_CASSETTE_UNWRITABLE, ConfigError
from recorder.harness.child import preexec
from recorder.harness.progress import close_record, read_status, request_cancel, valid_run_id

log = logging.getLogger("deja.runs")

BEAT = 2.0  # seconds between heartbeats
WATCH = 0.5  # seconds between looks at a running child
RETRY_DELAYS = (1.0, 4.0, 16.0)  # an agent that dies is resumed after each; then it fails
RETRIES_ENV = "DEJA_AGENT_RETRIES"  # another list of delays, in seconds: "1,4,16"; "none"
RECONCILE_EVERY = 5.0  # seconds between reconciliations of the database and the engine
RECONCILE_ROWS = 1000  # rows looked at per reconciliation
SUBMIT_GRACE = 30.0  # a submission older than this that the engine does not hold failed


def retry_delays() -> tuple[float, ...]:
    """The delays before each resume of an agent that died (``DEJA_AGENT_RETRIES``)."""
    given = os.environ.get(RETRIES_ENV)
    if given is None or not given.strip():
        return RETRY_DELAYS
    if given.strip().lower() == "none":
        return ()
    try:
        delays = tuple(float(part) for part in given.split(","))
    except ValueError:
        delays = (-1.0,)
    if any(not 0 <= d <= 3600 for d in delays):
        raise ConfigError(f"{RETRIES_HINT} {given!r}: give seconds between 0 and 3600 "
                          "separated by commas (the default is 1,4,16), or none")
    return delays


RETRIES_HINT = f"{RETRIES_ENV}="


def default_worker_id() -> str:
    return f"{socket.gethostname()}-1"


def _disk_full(cassette: Path, code: int, state: str, end: dict[str, Any] | None
               ) -> str | None:
    """What an attempt that left its run open says of a disk that could not be written
    (None: nothing). ``end``: the end line it wrote (None: none, or the one there before,
    put back by a resume that could not start, which is not this attempt's)."""
    return _write_error(end) or (
        f"{cassette} could not be written as the run started (deja exited {code})"
        if code == EXIT_CASSETTE_UNWRITABLE else None) or (
        disk_trouble(cassette.parent) if state != "ended" else None)


def _died(code: int) -> str | None:
    """How a ``deja record``/``resume`` exit status says its program was killed (a
    signal to the launcher, or one its program died of), else None."""
    if code < 0:
        return f"deja was killed by signal {-code}"
    if code > 128 and code - 128 < 65:
        return f"the agent was killed by signal {code - 128}"
    return None


class AgentStep:
    """The engine's agent step: one run under the harness, from its cassette's state."""

    def __init__(self, store: Store, worker_id: str, cassettes: Path, cancelled: Any) -> None:
        self.store = store
        self.worker_id = worker_id
        self.locks = RunLock(store, cassettes)
        self.cancelled = cancelled
        self.stopping = threading.Event()
        self.children = Children()
        self.delays = retry_delays()
        self._tails: dict[str, str] = {}  # run id: the last lines its launcher wrote

    def __call__(self, spec: dict[str, Any], answer: str | None,
                 workflow: str) -> dict[str, Any]:
        run_id = spec["run_id"]
        if not valid_run_id(run_id):
            return {"status": "failed", "error": f"{run_id!r} is not a run id"}
        row = self.store.get_run(run_id)
        if row is None:  # a submission withdrawn: its caller was told
            return {"status": "failed", "error": f"run {run_id} is not in the runs database "
                                                 "(its submission failed); nothing was run"}
        # Cancelled while queued or waiting, or a later part took over: nothing runs. The
        # claim is one conditional write, so a cancel that read the run queued or waiting
        # either lands first or finds it working (and stops it at its next boundary).
        part = part_of(workflow, run_id)
        if not self.store.claim_run(run_id, self.worker_id, part):
            row = self.store.get_run(run_id) or row
            if row["status"] == "cancelled":
                return {"status": "cancelled"}
            return {"status": "superseded", "error": f"part {workflow} of run {run_id} was "
                    f"followed by part {row.get('attempt')}; it ran nothing"}
        with self.locks.hold(run_id, self.stopping):
            outcome = self._run(spec, answer, workflow)
        fields: dict[str, Any] = {"status": outcome["status"],
                                  "question": outcome.get("question"),
                                  "error": outcome.get("error")}
        if "artefacts" in outcome:
            fields["artefacts"] = outcome["artefacts"]
        progress = read_status(run_id)
        tail = self._tails.pop(run_id, None)
        if outcome["status"] == "failed" and tail:  # why, for its record and its alert
            progress = {**(progress or {}), "stderr_tail": tail}
        if progress is not None:
            fields["progress"] = progress
        # Unless a later part took over (an answer read the run's status from the engine
        # first): that part's claim says what the run is.
        self.store.move_run(run_id, "working", part, **fields)
        if outcome["status"] in ("failed", "interrupted"):  # one line per run
            log.warning("run %s %s: %s", run_id, outcome["status"], outcome.get("error"))
        if outcome["status"] != "input_required":
            schedules.after_run(self.store, run_id)
        return outcome

    def _last_writer_gone(self, run_id: str, cassette: Path) -> None:
        """Wait until no process holds the cassette's writer lock (a dead worker's agent,
        or a killed launcher's, still ending); said once in the log when it takes a while."""
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
        """Run the agent until its run ends; an agent that dies without closing its run is
        started again (``deja resume``) after each of the delays (:func:`retry_delays`),
        then the run fails."""
        run_id, cassette = spec["run_id"], Path(spec["cassette"])
        deaths: list[str] = []
        while True:
            self._last_writer_gone(run_id, cassette)
            state, end = cassette_state(cassette)
            if state == "ended" and end is not None and end.get("status") != "interrupted":
                return self._ended(spec, end)  # dispatched again after it ended: report it
            before = end
            code = self._child(spec, answer, workflow, state)  # an unused answer: again
            if isinstance(code, dict):
                return code
            if self.stopping.is_set():
                raise WorkerStopping  # the run stays pending; it resumes on the next dispatch
            self._last_writer_gone(run_id, cassette)  # a killed launcher's agent closing up
            state, end = cassette_state(cassette)
            if state == "ended" and end is not None and end.get("status") != "interrupted":
                return self._ended(spec, end)
            record = read_status(run_id) or {}
            if state == "open" and code == EXIT_INPUT_REQUIRED and \
                    record.get("status") == "input_required":
                return {"status": "input_required", "question": record.get("question")}
            unchanged = state == "ended" and end is not None and end == before
            full = _disk_full(cassette, code, state, None if unchanged else end)
            if full is not None:
                return {"status": "interrupted",
                        "error": f"{DISK_ERROR}: {full}; the run is dispatched again once "
                                 f"{cassette.parent} is writable"}
            killed = _died(code)
            if state == "none" and killed is None:
                return {"status": "failed", "error": f"the program did not start recording "
                                                     f"(deja exited {code})"}
            deaths.append(killed or (
                f"deja exited {code} and the run was not resumed" if unchanged else
                "the run ended interrupted" if state == "ended" else
                f"deja exited {code} without an end line"))
            with contextlib.suppress(Exception):
                if self.cancelled(workflow):
                    return {"status": "cancelled"}
            if len(deaths) > len(self.delays):
                spent = (f"{len(self.delays)} retries are spent" if self.delays else
                         f"no retries ({RETRIES_ENV}=none)")
                times = "once" if len(deaths) == 1 else f"{len(deaths)} times"
                error = (f"the agent died {times} without closing its run "
                         f"({'; '.join(deaths)}); {spent}. It can be resumed by hand: "
                         f"deja resume {cassette}")
                close_record(run_id, "failed", error)  # what the open cassette cannot say
                return {"status": "failed", "error": error}
            delay = self.delays[len(deaths) - 1]
            log.warning("run %s: %s before its run ended; resumed in %g s (retry %d of %d)",
                        run_id, deaths[-1], delay, len(deaths), len(self.delays))
            with contextlib.suppress(DatabaseUnavailable):
                self.store.update_run(run_id, wait=False,
                                      error=f"{deaths[-1]}; retry {len(deaths)} of "
                                            f"{len(self.delays)} in {delay:g} s")
            if self.stopping.wait(delay):
                raise WorkerStopping

    def _child(self, spec: dict[str, Any], answer: str | None, workflow: str,
               state: str) -> int | dict[str, Any]:
        """Run ``deja record`` (nothing on disk yet) or ``deja resume`` to its exit status."""
        argv = record_argv(spec) if state == "none" else resume_argv(spec)
        env = dict(os.environ)
        env[WORKER_ENV] = "1"
        env.pop(ANSWER_ENV, None)
        if answer is not None:
            env[ANSWER_ENV] = answer
        if self.stopping.is_set():
            raise WorkerStopping
        try:
            child = subprocess.Popen(argv, cwd=spec["cwd"], env=env, preexec_fn=preexec(),
                                     stderr=subprocess.PIPE)
        except OSError as exc:
            return {"status": "failed", "error": f"the worker cannot start deja ({exc})"}
        assert child.stderr is not None
        tail = StderrTail(child.stderr)
        self.children.add(child)
        try:
            return self._watch(spec["run_id"], workflow, child)
        finally:
            self.children.discard(child)
            self._tails[spec["run_id"]] = tail.text()

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
                    with contextlib.suppress(DatabaseUnavailable, sa.exc.SQLAlchemyError,
                                             OSError):
                        self.store.update_run(run_id, progress=record, wait=False)
            if not asked:
                with contextlib.suppress(Exception):
                    if self.cancelled(workflow):
                        request_cancel(run_id, "cancelled through deja serve")
                        asked = True

    def _ended(self, spec: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
        status = run_status(end)
        if status == "completed":
            return {"status": "completed", "artefacts": schedules.verified_artefacts(spec)}
        error = end.get("error") or {}
        message = error.get("message") if isinstance(error, dict) else None
        if status == "failed":
            return {"status": "failed", "error": message or end.get("reason")
                    or "the program failed"}
        out: dict[str, Any] = {"status": status}
        if status == "interrupted":  # a resumable run (a full disk): say why
            out["error"] = str(message or end.get("reason") or "interrupted")
        return out

    def stop(self) -> None:
        """Stop every running agent (each ends ``interrupted``, resumable)."""
        self.stopping.set()
        self.children.stop()


def cancelled_while_down(store: Store, worker: Any, worker_id: str) -> list[str]:
    """Runs a worker of this id was running when it died, cancelled since: the engine never
    takes up a cancelled part and this worker, just started, runs none of them, so nobody
    would end them; their rows are set ``cancelled`` (else a live worker of their id makes
    them read as still stopping, ``working``, for good). What was done, in words."""
    done = []
    for row in store.list_runs(status=["working"], limit=RECONCILE_ROWS):
        attempt = int(row.get("attempt") or 0)
        if row.get("worker") == worker_id and \
                worker.cancelled(workflow_id(row["run_id"], attempt)) and \
                store.move_run(row["run_id"], "working", attempt, status="cancelled"):
            done.append(f"run {row['run_id']}: cancelled while its worker was down; it "
                        "ends cancelled")
    return done


def reconcile(store: Store, worker: Any, now: float | None = None) -> list[str]:
    """Bring the runs database and the engine back into agreement; what was done, in words.

    - A run interrupted by a full or failing cassette directory (:data:`DISK_ERROR`) is
      dispatched again, as its next part, once a probe writes there: exactly once, however
      many workers reconcile at the same moment.
    - A ``queued`` row whose current part the engine does not hold after
      :data:`SUBMIT_GRACE`: a submission the engine never took (``deja serve`` removes
      the row and answers an error; a crash or a database that failed in between can
      leave it) is removed, since its caller never heard that it was accepted; a part
      dispatched again here whose enqueue failed is enqueued.
    - A ``queued`` row whose current part the engine cancelled after taking it off its
      queue and before its step started (the step, which ends a cancelled run's row,
      never runs) ends ``cancelled``.
    """
    now = time.time() if now is None else now
    done: list[str] = []
    rows = store.list_runs(status=["queued", "interrupted"], limit=RECONCILE_ROWS)
    for row in rows:
        error = row.get("error") or ""
        if row["status"] != "interrupted" or not error.startswith(DISK_ERROR):
            continue
        attempt = int(row.get("attempt") or 0)
        if disk_trouble(Path(row["spec"]["cassette"]).parent) is None and \
                store.requeue(row["run_id"], "interrupted", attempt):
            worker.enqueue(row["spec"], attempt + 1)
            done.append(f"run {row['run_id']}: its cassette directory is writable again; "
                        "dispatched again")
    stale = {workflow_id(row["run_id"], int(row.get("attempt") or 0)): row for row in rows
             if row["status"] == "queued" and now - row["updated"] > SUBMIT_GRACE}
    known = worker.known(list(stale))
    for part, row in stale.items():
        attempt = int(row.get("attempt") or 0)
        if known.get(part) == "CANCELLED":  # before its step started: nobody else ends it
            if store.move_run(row["run_id"], "queued", attempt,
                              unchanged_since=row["updated"], status="cancelled"):
                done.append(f"run {row['run_id']}: cancelled before it started; it ends "
                            "cancelled")
            continue
        if part in known:
            continue
        if attempt == 0:
            if store.forget_submission(row["run_id"]):
                done.append(f"run {row['run_id']}: its submission never reached the queue "
                            "(its caller was answered an error); its row is removed")
        else:
            worker.enqueue(row["spec"], attempt)
            done.append(f"run {row['run_id']}: part {attempt} was not in the queue; "
                        "enqueued")
    return done


def _created(store: Store) -> dict[str, float]:
    return {s["name"]: s["created"] for s in store.schedules()}


def _fill_gaps(store: Store, worker: Any, covered: dict[str, float], launched: float,
               now: float) -> None:
    """Submit what the engine's scheduler left out since this worker started
    (:meth:`engine.Worker.backfill_window`): each schedule from where its last window
    ended (or from the second before the start, or from when it was added) to a second
    ago. A schedule whose window fails keeps its start and is tried again."""
    end = now - 1.0
    for name, created in _created(store).items():
        start = max(covered.get(name, launched - 1.0), created)
        try:
            worker.backfill_window(name, start, end)
        except Exception as exc:  # noqa: BLE001 (one schedule's trouble stops no other)
            if name not in covered or covered[name] != start:
                log.warning("schedule %s: its occurrences since %s could not be checked "
                            "(%s: %s); tried again", name, time.strftime(
                                "%H:%M:%S", time.gmtime(start)), type(exc).__name__,
                            (str(exc).strip().splitlines() or [""])[0])
            covered[name] = start
            continue
        covered[name] = end - 1.0  # a second over: a window's start is not in it


def _beat_and_watch(store: Store, worker_id: str, worker: Any, stop: threading.Event,
                    check_every: float, launched: float) -> None:
    host, pid = socket.gethostname(), os.getpid()
    last_check = last_reconcile = 0.0
    covered: dict[str, float] = {}  # schedule: its occurrences submitted up to then
    while not stop.wait(BEAT):
        try:
            store.beat(worker_id, host, pid)
            now = time.time()
            # After the database was down, every worker's beat is old: wait until the
            # others had time to beat again before calling any of them dead.
            settled = time.monotonic() - store.back_since >= DEAD_AFTER
            for peer in store.workers() if settled else []:
                if peer["worker_id"] == worker_id or peer["taken_over_by"] is not None:
                    continue
                if now - peer["beat"] > DEAD_AFTER and store.claim_dead(
                        peer["worker_id"], worker_id, now - DEAD_AFTER):
                    taken = worker.recover([peer["worker_id"]])
                    log.warning("worker %s is dead (last beat %.0f s ago); %s took over %d "
                                "run(s): %s", peer["worker_id"], now - peer["beat"],
                                worker_id, len(taken), ", ".join(taken) or "none")
            if now - last_reconcile >= RECONCILE_EVERY:
                last_reconcile = now
                for line in reconcile(store, worker, now):
                    log.warning("%s", line)
                _fill_gaps(store, worker, covered, launched, now)
            if now - last_check >= check_every:
                last_check = now
                schedules.check(store)
        except Exception as exc:  # noqa: BLE001 (a hiccup must not stop the heartbeat)
            log.warning("worker %s: heartbeat: %s: %s", worker_id, type(exc).__name__,
                        (str(exc).strip().splitlines() or [""])[0])


def _log_to_stderr(worker_id: str) -> None:
    """deja's own lines on standard error, one per event, no traceback."""
    logger = logging.getLogger("deja.runs")
    if not any(getattr(h, "name", None) == "deja-worker" for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.name = "deja-worker"
        handler.setFormatter(logging.Formatter(f"deja: worker {worker_id}: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.WARNING)


def serve(worker_id: str, url: str | None = None, concurrency: int = 1,
          check_every: float = 15.0) -> None:
    """Run a worker until SIGTERM or SIGINT."""
    from deja.runs import engine

    url = url or database_url()
    cassettes = cassette_dir()
    _log_to_stderr(worker_id)
    store = Store(url)
    WorkerIdLock(store, worker_id)
    check_shared(store, cassettes)
    worker = engine.Worker(url, worker_id, concurrency)
    step = AgentStep(store, worker_id, cassettes, worker.cancelled)
    jobs = JobStep(worker_id)  # the incidents of deja suite
    engine.set_hooks(agent=step,
                     occurrence=lambda name, when: schedules.occurrence(store, name, when),
                     job=jobs)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    launched = time.time()
    store.beat(worker_id, socket.gethostname(), os.getpid(), first=True)
    worker.launch()
    store.wait_for_database()  # from here on, an outage is waited out, not a failure
    worker.backfill_unfired(_created(store))
    for line in [*cancelled_while_down(store, worker, worker_id), *reconcile(store, worker)]:
        log.warning("%s", line)
    sys.stderr.write(f"deja: worker {worker_id} is up ({concurrency} at a time; "
                     f"database {'embedded SQLite' if is_sqlite(url) else 'Postgres'}, "
                     f"cassettes in {cassettes})\n")
    sys.stderr.flush()
    beat = threading.Thread(target=_beat_and_watch, name="deja-heartbeat", daemon=True,
                            args=(store, worker_id, worker, stop, check_every, launched))
    beat.start()
    while not stop.wait(1.0):
        pass
    sys.stderr.write(f"deja: worker {worker_id} is stopping; its runs in flight are "
                     "picked up again\n")
    sys.stderr.flush()
    step.stop()
    jobs.stop()
    os._exit(0)  # without finishing the engine's steps in flight: they are resumed later
