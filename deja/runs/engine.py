"""The durable-execution engine, DBOS Transact: the only module of deja that imports it.

DBOS keeps workflows in a database (SQLite embedded by default, Postgres for many
machines, one URL apart) and checkpoints between their steps. deja uses it this way:

- **A run is one workflow** whose id is deja's run id, so a submission is idempotent. Its
  one step runs the agent under the harness (``deja.runs.worker.agent_step``): ``deja record``
  the first time, ``deja resume`` of its cassette whenever the cassette already holds a
  recorded prefix. The engine's checkpoints are between steps; the cassette is the
  checkpoint inside the step. A worker that dies mid-step has its run dispatched again
  and the step resumes the cassette (recorded turns replay, a trailing intent is
  settled, then live).
- **Input required** ends the step and the workflow (the agent's process exits after
  asking), so a waiting run holds no worker slot. The answer is the input of the run's
  next workflow, ``<run>.<n>`` (the n-th answer), enqueued by whoever answers: it is as
  durable as a submission, waits in the queue while no worker is up, and an answer given
  twice is one workflow. Its step resumes the cassette with the answer.
- **A schedule** is an engine cron schedule, with automatic backfill, whose workflow
  (on its own queue: sleeping or scheduling work never holds a run's slot) submits the
  occurrence's run under a deterministic id, so a backfill cannot submit twice.
- **Recovery of a dead peer** uses the engine's own recovery call for that executor id,
  which re-enqueues the peer's pending workflows so that exactly one executor runs each.
- **An incident suite** (``deja suite``) is a queue of its own, ``deja-suite-<suite id>``,
  whose global concurrency is the suite's ``-j``; each incident is one workflow on it,
  ``suite:<suite id>:<cassette>`` (a suite submitted again runs no incident twice), whose
  one step runs the incident's job (``deja.runs.suites.JobStep``) and returns its verdict,
  which the engine checkpoints: a worker that dies mid-suite loses no verdict, and the
  incidents it had in flight are recovered like any pending workflow. Workers listen to
  every queue in the database, so a suite's queue needs no worker restarted.

The engine's API moves across releases: everything it offers deja goes through this
module, and its version is pinned to the range tested (``pyproject.toml``). Pitfalls
avoided here: the application version is pinned (its default, a hash of the code, would
strand runs in flight across an upgrade of deja); executor ids are given, unique per
worker; queues are registered after launch; the SQLite file is put in WAL mode; logging
stays at WARNING (no migration chatter, no sign-up banner).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from dbos import DBOS, DBOSClient, DBOSConfig, EnqueueOptions, SetWorkflowID
from dbos import error as dbos_error

from deja.runs.config import is_sqlite, sqlite_path
from deja.runs.errors import DatabaseUnavailable, RunFailed
from deja.runs.spec import workflow_id

APP_NAME = "deja"
APP_VERSION = "deja-runs-1"  # pinned: runs in flight survive an upgrade of deja
RUNS_QUEUE = "deja-runs"
SCHEDULES_QUEUE = "deja-schedules"
RUN_WORKFLOW = "deja.run"
OCCURRENCE_WORKFLOW = "deja.occurrence"
SUITE_WORKFLOW = "deja.suite-job"
SUITE_QUEUE = "deja-suite-"  # + the suite's id
ENDED = ("SUCCESS", "ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED")
ENGINE_ERRORS: tuple[type[BaseException], ...] = (dbos_error.DBOSException,)

# What the workflows call, set by the worker before launch (the engine knows no agent).
_hooks: dict[str, Callable[..., Any]] = {}


def set_hooks(*, agent: Callable[[dict[str, Any], str | None, str], dict[str, Any]],
              occurrence: Callable[[str, str], dict[str, Any] | None],
              job: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    _hooks.update(agent=agent, occurrence=occurrence)
    if job is not None:
        _hooks["job"] = job


@DBOS.step(name="deja.agent")
def _agent_step(spec: dict[str, Any], answer: str | None) -> dict[str, Any]:
    return dict(_hooks["agent"](spec, answer, DBOS.workflow_id or spec["run_id"]))


@DBOS.workflow(name=RUN_WORKFLOW, max_recovery_attempts=1000)
def _run_workflow(spec: dict[str, Any], answer: str | None = None) -> dict[str, Any]:
    outcome = _agent_step(spec, answer)
    if outcome.get("status") == "failed":  # the engine's ERROR is deja's failure
        raise RunFailed(outcome.get("error") or "the run failed")
    return outcome


@DBOS.step(name="deja.suite-job")
def _suite_job_step(job: dict[str, Any]) -> dict[str, Any]:
    return dict(_hooks["job"](job))


@DBOS.workflow(name=SUITE_WORKFLOW, max_recovery_attempts=1000)
def _suite_job_workflow(job: dict[str, Any]) -> dict[str, Any]:
    return _suite_job_step(job)


def suite_workflow_id(suite_id: str, key: str) -> str:
    """The workflow of one incident of a suite: the same suite and incident, the same
    workflow (``:`` never appears in a run's id, so it is no run's)."""
    return f"suite:{suite_id}:{key}"


@DBOS.step(name="deja.occurrence")
def _occurrence_step(name: str, when: str) -> dict[str, Any] | None:
    return _hooks["occurrence"](name, when)


@DBOS.workflow(name=OCCURRENCE_WORKFLOW)
def _occurrence_workflow(scheduled: datetime, context: Any) -> None:
    spec = _occurrence_step(str(context["name"]), scheduled.isoformat())
    if spec is not None:
        with SetWorkflowID(spec["run_id"]):
            DBOS.enqueue_workflow(RUNS_QUEUE, _run_workflow, spec)


class _EngineNoise(logging.Filter):
    """What the engine logs is for deja's own eyes, not the worker's output.

    - A cancelled run is the user's decision, a failed run is reported by the worker in
      one line (``run R failed: why``): neither gets the engine's traceback.
    - An execution that lost its workflow to another (a peer recovered it while this
      worker could not reach the database) waits for the owner's outcome: expected after
      an outage, not news.
    - A database that cannot be reached is said once by the worker when the outage starts
      and once when it ends (``deja.runs.store``); the engine's own complaints at every poll in
      between are left out.
    - Anything else is kept in one line (no traceback), the same line at most once a
      minute.
    """

    QUIET = (dbos_error.DBOSWorkflowCancelledError,
             dbos_error.DBOSAwaitedWorkflowCancelledError, RunFailed)
    EXPECTED = ("no longer owned by this execution", "was cancelled during execution",
                "outcome was not recorded")
    OUTAGE = ("OperationalError", "InterfaceError", "connection failed", "Connection refused",
              "server closed the connection", "could not connect", "database is locked",
              "terminating connection", "the database system is", "Database connection",
              "Notification listener error", "connection is closed")
    REPEAT_AFTER = 60.0

    def __init__(self) -> None:
        super().__init__()
        self._said: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and _caused_by(exc, self.QUIET):
            return False
        text = record.getMessage()
        if exc is not None:
            text = f"{text.rstrip(': ')}: {type(exc).__name__}: {exc}"
        if any(phrase in text for phrase in self.EXPECTED + self.OUTAGE):
            return False
        first = (text.strip().splitlines() or [""])[0]
        record.msg, record.args = first, None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        now = time.monotonic()
        if now - self._said.get(first[:80], -self.REPEAT_AFTER) < self.REPEAT_AFTER:
            return False
        self._said[first[:80]] = now
        return True


def _caused_by(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, kinds):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return False


def _quiet() -> None:
    for name in ("dbos", "alembic", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    dbos_logger = logging.getLogger("dbos")
    if not any(isinstance(f, _EngineNoise) for f in dbos_logger.filters):
        dbos_logger.addFilter(_EngineNoise())


MIGRATE_ATTEMPTS = 20  # tries while another process creates the same tables


def prepare(url: str) -> None:
    """Create or migrate the engine's tables (idempotent, also when ``deja serve`` and a
    worker do it at the same moment: the loser tries again); SQLite in WAL mode."""
    _quiet()
    for attempt in range(MIGRATE_ATTEMPTS):
        try:
            DBOS.migrate(url)
            break
        except Exception as exc:  # noqa: BLE001 (the engine raises its driver's errors as they come)
            text = str(exc).lower()
            raced = "already exists" in text or "database is locked" in text or \
                "duplicate key" in text
            if not raced or attempt == MIGRATE_ATTEMPTS - 1:
                raise DatabaseUnavailable(_unreachable(url, exc)) from None
            time.sleep(0.05 * (attempt + 1))
    if is_sqlite(url):
        for attempt in range(MIGRATE_ATTEMPTS):
            try:
                with contextlib.closing(sqlite3.connect(sqlite_path(url), timeout=30)) as conn:
                    conn.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as exc:  # another process holds it this instant
                if "locked" not in str(exc) or attempt == MIGRATE_ATTEMPTS - 1:
                    raise DatabaseUnavailable(_unreachable(url, exc)) from None
                time.sleep(0.05 * (attempt + 1))


def _unreachable(url: str, exc: BaseException) -> str:
    from deja.runs.config import safe_url

    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    fix = ("check that its directory exists and is writable" if is_sqlite(url) else
           "start the Postgres server, or point DEJA_DATABASE_URL at one that runs")
    return f"the runs database {safe_url(url)} cannot be reached ({reason}); {fix}"


class Client:
    """Submit, inspect, cancel and answer runs from outside a worker (``deja serve``)."""

    def __init__(self, url: str, *, migrate: bool = True) -> None:
        if migrate:
            prepare(url)
        try:
            self._client = DBOSClient(system_database_url=url, application_name=APP_NAME,
                                      retry_connection_errors=False)
        except Exception as exc:  # noqa: BLE001 (the driver's own errors)
            raise DatabaseUnavailable(_unreachable(url, exc)) from None
        self.url = url

    def close(self) -> None:
        self._client.destroy()

    def submit(self, spec: dict[str, Any]) -> None:
        options = EnqueueOptions(workflow_name=RUN_WORKFLOW, queue_name=RUNS_QUEUE,
                                 workflow_id=spec["run_id"], app_version=APP_VERSION)
        self._client.enqueue(options, spec)

    def states(self, run_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The engine's view of each run: status, output, error, executor."""
        if not run_ids:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for status in self._client.list_workflows(workflow_ids=run_ids, load_input=False):
            out[status.workflow_id] = {
                "status": status.status, "output": status.output,
                "error": str(status.error) if status.error is not None else None,
                "executor": status.executor_id}
        return out

    def cancel(self, run_id: str) -> None:
        self._client.cancel_workflow(run_id)

    def answer(self, spec: dict[str, Any], text: str, attempt: int) -> None:
        """Enqueue the run's next part, which resumes its cassette with ``text``."""
        options = EnqueueOptions(workflow_name=RUN_WORKFLOW, queue_name=RUNS_QUEUE,
                                 workflow_id=workflow_id(spec["run_id"], attempt),
                                 app_version=APP_VERSION)
        self._client.enqueue(options, spec, text)

    def answer_of(self, run_id: str, attempt: int) -> str | None:
        """The answer part ``attempt`` of the run was enqueued with (None: no such part)."""
        for status in self._client.list_workflows(
                workflow_ids=[workflow_id(run_id, attempt)], load_output=False):
            args = status.input["args"] if status.input is not None else ()
            return str(args[1]) if len(args) > 1 and args[1] is not None else None
        return None

    def add_schedule(self, name: str, cron: str, tz: str) -> None:
        self._client.create_schedule(
            schedule_name=f"deja-{name}", workflow_name=OCCURRENCE_WORKFLOW, schedule=cron,
            context={"name": name}, automatic_backfill=True, cron_timezone=tz,
            queue_name=SCHEDULES_QUEUE, application_name=APP_NAME)

    def remove_schedule(self, name: str) -> None:
        self._client.delete_schedule(f"deja-{name}")

    def suite_queue(self, suite_id: str, concurrency: int) -> str:
        """Register the queue of a suite, ``concurrency`` incidents at a time across all
        workers (again: its limit updated); its name."""
        name = SUITE_QUEUE + suite_id
        self._client.register_queue(name, global_concurrency=concurrency,
                                    polling_interval_sec=0.2, on_conflict="always_update")
        return name

    def enqueue_job(self, queue: str, workflow: str, job: dict[str, Any]) -> None:
        """Enqueue one job of a suite as ``workflow`` (idempotent: a workflow id the
        engine holds is not enqueued again, whatever became of it)."""
        options = EnqueueOptions(workflow_name=SUITE_WORKFLOW, queue_name=queue,
                                 workflow_id=workflow, app_version=APP_VERSION)
        self._client.enqueue(options, job)

    def remove_queue(self, name: str) -> None:
        """Remove a suite's queue once every workflow on it has ended (a pending one
        would never be dequeued again)."""
        self._client.delete_queue(name)



class Worker:
    """One executor: DBOS launched with this worker's id, dequeuing runs and schedules."""

    def __init__(self, url: str, executor_id: str, concurrency: int,
                 scheduler_poll: float = 2.0) -> None:
        prepare(url)
        config: DBOSConfig = {
            "name": APP_NAME, "system_database_url": url, "application_version": APP_VERSION,
            "executor_id": executor_id, "log_level": "WARNING",
            "scheduler_polling_interval_sec": scheduler_poll,
            "notification_listener_polling_interval_sec": 0.2,
        }
        self.executor_id = executor_id
        self.concurrency = concurrency
        DBOS(config=config)

    def launch(self) -> None:
        DBOS.launch()
        DBOS.register_queue(RUNS_QUEUE, worker_concurrency=self.concurrency,
                            polling_interval_sec=0.2, on_conflict="always_update")
        DBOS.register_queue(SCHEDULES_QUEUE, polling_interval_sec=0.5,
                            on_conflict="always_update")

    def backfill_unfired(self, created: dict[str, float]) -> None:
        """Submit the missed occurrences of schedules that never fired.

        The engine backfills from a schedule's last firing; one that never fired (no
        worker was up since it was added) has none, so its occurrences since it was
        added are enqueued here, under the same deterministic ids the scheduler uses:
        never twice, whoever starts first."""
        now = datetime.now(UTC)
        for name, stamp in created.items():
            schedule = DBOS.get_schedule(f"deja-{name}")
            if schedule is not None and not schedule.get("last_fired_at"):
                DBOS.backfill_schedule(f"deja-{name}", datetime.fromtimestamp(stamp, UTC),
                                       now)

    def backfill_window(self, name: str, start: float, end: float) -> None:
        """Submit the occurrences of schedule ``name`` after ``start`` and before ``end``
        that nobody submitted (the same ids: never twice).

        The engine's scheduler leaves some out: its backfill ends when it runs, and the
        schedule's own thread counts from when it starts, a moment later (after the
        backfill of every schedule before it, however long that takes); an occurrence
        due in between, or one whose submission failed while the database was down, is
        submitted by nobody else."""
        if start < end:
            DBOS.backfill_schedule(f"deja-{name}", datetime.fromtimestamp(start, UTC),
                                   datetime.fromtimestamp(end, UTC))

    def recover(self, executor_ids: list[str]) -> list[str]:
        """Take over the pending runs of dead executors (the engine's recovery call)."""
        handles = DBOS._recover_pending_workflows(executor_ids)
        return [h.get_workflow_id() for h in handles]

    def cancelled(self, workflow: str) -> bool:
        status = DBOS.get_workflow_status(workflow)
        return status is not None and status.status == "CANCELLED"

    def known(self, workflows: list[str]) -> dict[str, str]:
        """Which of ``workflows`` the engine holds, with the status of each."""
        if not workflows:
            return {}
        return {status.workflow_id: status.status for status in DBOS.list_workflows(
            workflow_ids=workflows, load_input=False, load_output=False)}

    def enqueue(self, spec: dict[str, Any], attempt: int) -> None:
        """Enqueue part ``attempt`` of a run (0: its submission) without an answer: a run
        whose row is queued but the engine never took it, or one dispatched again once its
        cassette directory is writable. Idempotent (the part's id is deterministic)."""
        options = EnqueueOptions(workflow_name=RUN_WORKFLOW, queue_name=RUNS_QUEUE,
                                 workflow_id=workflow_id(spec["run_id"], attempt),
                                 app_version=APP_VERSION)
        if attempt:
            DBOS.enqueue_workflow_with_options(options, spec, None)
        else:
            DBOS.enqueue_workflow_with_options(options, spec)

