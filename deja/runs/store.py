"""deja's own tables beside the engine's, in the same database: runs, workers, schedules,
alerts, and the verdict on each scheduled occurrence's deadline.

The engine keeps what it needs to execute a run durably (its workflow and step rows);
these tables keep what people ask about: a run's command, labels and lifecycle status, its
latest progress record, the question it waits on, its verified artefacts; the workers and
their heartbeats; the schedules, their occurrences, whether each had its verified
artefact by its deadline, and the alerts sent. ``deja check`` reads only these, so an
absence alert fires with no worker alive.

SQLAlchemy Core (the engine's own dependency) speaks to SQLite and Postgres alike. Nothing
secret is stored: a submission whose command line holds a secret is refused before it
gets here (``deja.runs.spec``), and progress records arrive redacted.

The tables are created by whichever process comes first; one that finds another creating
them at the same moment (``deja serve`` and ``deja worker`` started together) looks again.
A worker's store waits for a database that cannot be reached (:meth:`Store.wait_for_database`);
everyone else's raises :class:`deja.runs.errors.DatabaseUnavailable` at once. A row's status
is deja's bookkeeping: what a run's status is comes from its cassette's end line first
(:func:`recorder.cassette.schema.run_status`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import sqlalchemy as sa

from deja.runs.config import is_sqlite, safe_url, sqlalchemy_url, sqlite_path
from deja.runs.errors import DatabaseUnavailable
from recorder.capture.redact import DEFAULT

log = logging.getLogger("deja.runs")
T = TypeVar("T")
CREATE_ATTEMPTS = 20  # tries to create the tables while another process creates them
MAX_RETRY_DELAY = 5.0  # seconds between tries to reach a database that is down

metadata = sa.MetaData()

runs_table = sa.Table(
    "deja_runs", metadata,
    sa.Column("run_id", sa.String(128), primary_key=True),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("labels", sa.Text, nullable=False, default="{}"),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("question", sa.Text),
    sa.Column("progress", sa.Text),
    sa.Column("worker", sa.String(128)),
    sa.Column("error", sa.Text),
    sa.Column("artefacts", sa.Text),
    sa.Column("updated", sa.Float, nullable=False),
    sa.Column("ended", sa.Float),
    sa.Column("schedule", sa.String(128), index=True),
    sa.Column("occurrence", sa.String(64)),
    # Answers given so far: the run's current workflow is run_id, then run_id.1, .2, ...
    sa.Column("attempt", sa.Integer, nullable=False, default=0),
)

workers_table = sa.Table(
    "deja_workers", metadata,
    sa.Column("worker_id", sa.String(128), primary_key=True),
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("started", sa.Float, nullable=False),
    sa.Column("beat", sa.Float, nullable=False),
    sa.Column("taken_over_by", sa.String(128)),
)

schedules_table = sa.Table(
    "deja_schedules", metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("cron", sa.String(128), nullable=False),
    sa.Column("tz", sa.String(64), nullable=False),
    sa.Column("deadline", sa.String(16)),
    sa.Column("alert", sa.Text),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
)

alerts_table = sa.Table(
    "deja_alerts", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("schedule", sa.String(128), nullable=False),
    sa.Column("occurrence", sa.String(64), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("run_id", sa.String(128)),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("delivery", sa.Text),
    sa.UniqueConstraint("schedule", "occurrence", "kind", name="deja_alert_once"),
)

deadlines_table = sa.Table(
    "deja_deadlines", metadata,
    sa.Column("schedule", sa.String(128), primary_key=True),
    sa.Column("occurrence", sa.String(64), primary_key=True),
    sa.Column("met", sa.Boolean, nullable=False),
    sa.Column("at", sa.Float, nullable=False),
)

meta_table = sa.Table(
    "deja_meta", metadata,
    sa.Column("key", sa.String(128), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

DISK_ERROR = "CassetteWriteError"  # the error of a run its cassette directory stopped
ENDED = frozenset({"completed", "failed", "cancelled", "exhausted", "stopped",
                   "interrupted", "needs_attention"})


def _loads(text: str | None) -> Any:
    return json.loads(text) if text else None


def _row(row: Any) -> dict[str, Any]:
    out = dict(row._mapping)
    for key in ("spec", "labels", "progress", "artefacts"):
        if key in out:
            out[key] = _loads(out[key])
    return out


def _values(fields: dict[str, Any]) -> dict[str, Any]:
    """A run row's columns for ``fields``: redacted and serialised, stamped."""
    values: dict[str, Any] = {"updated": time.time()}
    for key, value in fields.items():
        if key in ("question", "error", "progress") and value is not None:
            value = DEFAULT.value(value)  # nothing secret is stored (recorder's rules)
        values[key] = json.dumps(value) if key in ("progress", "artefacts") and \
            value is not None else value
    if fields.get("status") in ENDED:
        values.setdefault("ended", time.time())
    return values


def _created_meanwhile(exc: sa.exc.DBAPIError) -> bool:
    """Another process created a table (or locked the file to do so) as this one did."""
    text = str(getattr(exc, "orig", exc)).lower()
    return "already exists" in text or "database is locked" in text or \
        "duplicate key" in text


def _retried(method: Callable[..., T]) -> Callable[..., T]:
    """A store method that, once :meth:`Store.wait_for_database` was called, waits for a
    database that cannot be reached instead of raising (``wait=False``: not this call)."""

    @functools.wraps(method)
    def call(self: Store, *args: Any, wait: bool = True, **kwargs: Any) -> T:
        if not wait:  # this call only: raise at once (a progress record, best effort)
            return method(self, *args, **kwargs)
        return self._retry(lambda: method(self, *args, **kwargs))

    return call


class Store:
    """The deja tables of one database."""

    def __init__(self, url: str) -> None:
        self.url = url
        kwargs: dict[str, Any] = {}
        if is_sqlite(url):
            kwargs["connect_args"] = {"timeout": 30}
            folder = sqlite_path(url).parent
            if not folder.exists():  # a fresh $DEJA_HOME: private, like the rest of it
                with contextlib.suppress(OSError):
                    folder.mkdir(mode=0o700, parents=True)
        else:
            kwargs.update(pool_pre_ping=True, pool_size=2, max_overflow=2)
        self.engine = sa.create_engine(sqlalchemy_url(url), **kwargs)
        if is_sqlite(url):
            @sa.event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn: Any, _record: Any) -> None:
                cursor = dbapi_conn.cursor()
                cursor.execute("PRAGMA busy_timeout=30000")
                cursor.close()
        self.patient = False  # see wait_for_database()
        self._down_since: float | None = None
        self.back_since = float("-inf")  # time.monotonic() when an outage last ended
        self._down_lock = threading.Lock()
        self._create_tables()

    def _create_tables(self) -> None:
        """Create the tables that are missing: idempotent, also when another process
        (``deja serve`` and ``deja worker`` started together) creates them at the same
        moment. SQLite then says ``OperationalError: table ... already exists``, Postgres
        a duplicate in its catalogue: the loser looks again, and finds them made."""
        for attempt in range(CREATE_ATTEMPTS):
            try:
                metadata.create_all(self.engine, checkfirst=True)
                return
            except sa.exc.DBAPIError as exc:
                if not _created_meanwhile(exc) or attempt == CREATE_ATTEMPTS - 1:
                    raise unavailable(self.url, exc) from None
                time.sleep(0.05 * (attempt + 1))

    def wait_for_database(self) -> None:
        """From now on, a call that cannot reach the database waits for it and tries again
        (a worker's bookkeeping: a database restarted mid-run must not fail the run).
        The outage is logged once when it starts and once when it ends."""
        self.patient = True

    def _retry(self, call: Callable[[], T]) -> T:
        delay = 0.25
        while True:
            try:
                result = call()
            except DatabaseUnavailable as exc:
                if not self.patient:
                    raise
                with self._down_lock:
                    if self._down_since is None:
                        self._down_since = time.monotonic()
                        log.warning("%s; waiting for it, and trying again", exc)
                time.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_DELAY)
                continue
            if self._down_since is not None:
                with self._down_lock:
                    if self._down_since is not None:
                        log.warning("the runs database %s is back after %.0f s",
                                    safe_url(self.url), time.monotonic() - self._down_since)
                        self._down_since = None
                        self.back_since = time.monotonic()
            return result

    @contextmanager
    def begin(self) -> Iterator[sa.Connection]:
        try:
            with self.engine.begin() as conn:
                yield conn
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            raise unavailable(self.url, exc) from None

    def close(self) -> None:
        self.engine.dispose()

    # -- runs

    @_retried
    def add_run(self, run_id: str, spec: dict[str, Any], *, schedule: str | None = None,
                occurrence: str | None = None) -> bool:
        """Record a submitted run; False when the id is already known (idempotent)."""
        now = time.time()
        try:
            with self.begin() as conn:
                conn.execute(runs_table.insert().values(
                    run_id=run_id, spec=json.dumps(spec),
                    labels=json.dumps(spec.get("labels") or {}),
                    created=now, updated=now, status="queued", attempt=0, schedule=schedule,
                    occurrence=occurrence))
        except sa.exc.IntegrityError:
            return False
        return True

    def forget_submission(self, run_id: str) -> bool:
        """Remove the row of a submission the engine did not take (its caller was told it
        failed); a row a worker took further is kept."""
        with self.begin() as conn:
            return bool(conn.execute(runs_table.delete().where(
                runs_table.c.run_id == run_id, runs_table.c.status == "queued",
                runs_table.c.attempt == 0)).rowcount)

    @_retried
    def requeue(self, run_id: str, status: str, attempt: int) -> bool:
        """Move a run that is ``status`` at part ``attempt`` to its next part, ``queued``:
        True for exactly one caller (two workers reconciling at once agree)."""
        return self.move_run(run_id, status, attempt, status="queued", attempt=attempt + 1,
                             error=None, ended=None, wait=False)

    @_retried
    def get_run(self, run_id: str) -> dict[str, Any] | None:
        with self.begin() as conn:
            row = conn.execute(runs_table.select().where(runs_table.c.run_id == run_id)).first()
        return _row(row) if row is not None else None

    @_retried
    def list_runs(self, *, status: list[str] | None = None, schedule: str | None = None,
                  limit: int = 100) -> list[dict[str, Any]]:
        query = runs_table.select().order_by(runs_table.c.created.desc()).limit(limit)
        if status:
            query = query.where(runs_table.c.status.in_(status))
        if schedule:
            query = query.where(runs_table.c.schedule == schedule)
        with self.begin() as conn:
            return [_row(row) for row in conn.execute(query)]

    @_retried
    def update_run(self, run_id: str, **fields: Any) -> None:
        with self.begin() as conn:
            conn.execute(runs_table.update().where(runs_table.c.run_id == run_id).values(
                **_values(fields)))

    @_retried
    def move_run(self, run_id: str, was: str | tuple[str, ...], part: int,
                 unchanged_since: float | None = None, **fields: Any) -> bool:
        """Update a run that is ``was`` (a status, or one of them) at part ``part`` (and,
        given ``unchanged_since``, the row's ``updated`` as read: no write since): False
        when it is no longer (another caller moved it first; of two racing callers,
        exactly one wins)."""
        where = [runs_table.c.run_id == run_id,
                 runs_table.c.status.in_([was] if isinstance(was, str) else was),
                 runs_table.c.attempt == part]
        if unchanged_since is not None:
            where.append(runs_table.c.updated == unchanged_since)
        with self.begin() as conn:
            return bool(conn.execute(runs_table.update().where(*where).values(
                **_values(fields))).rowcount)

    @_retried
    def claim_run(self, run_id: str, worker_id: str, attempt: int) -> bool:
        """Mark the run ``working`` under ``worker_id`` for its part ``attempt``, unless it
        was cancelled or a later part took over: False then, and nothing is written."""
        with self.begin() as conn:
            return bool(conn.execute(runs_table.update().where(
                runs_table.c.run_id == run_id, runs_table.c.status != "cancelled",
                runs_table.c.attempt <= attempt).values(**_values(dict(
                    status="working", worker=worker_id, question=None, error=None,
                    attempt=attempt)))).rowcount)

    # -- workers

    @_retried
    def beat(self, worker_id: str, host: str, pid: int, *, first: bool = False) -> None:
        now = time.time()
        with self.begin() as conn:
            done = conn.execute(workers_table.update().where(
                workers_table.c.worker_id == worker_id).values(
                beat=now, host=host, pid=pid,
                **({"started": now, "taken_over_by": None} if first else {}))).rowcount
            if not done:
                conn.execute(workers_table.insert().values(
                    worker_id=worker_id, host=host, pid=pid, started=now, beat=now))

    @_retried
    def workers(self) -> list[dict[str, Any]]:
        with self.begin() as conn:
            return [dict(row._mapping) for row in conn.execute(
                workers_table.select().order_by(workers_table.c.worker_id))]

    @_retried
    def worker(self, worker_id: str) -> dict[str, Any] | None:
        with self.begin() as conn:
            row = conn.execute(workers_table.select().where(
                workers_table.c.worker_id == worker_id)).first()
        return dict(row._mapping) if row is not None else None

    @_retried
    def claim_dead(self, dead: str, by: str, older_than: float) -> bool:
        """Claim a dead worker's runs for ``by``: True for exactly one claimant."""
        with self.begin() as conn:
            return bool(conn.execute(workers_table.update().where(
                workers_table.c.worker_id == dead, workers_table.c.beat < older_than,
                workers_table.c.taken_over_by.is_(None)).values(taken_over_by=by)).rowcount)

    # -- schedules

    @_retried
    def add_schedule(self, name: str, cron: str, tz: str, deadline: str | None,
                     alert: str | None, spec: dict[str, Any]) -> bool:
        try:
            with self.begin() as conn:
                conn.execute(schedules_table.insert().values(
                    name=name, cron=cron, tz=tz, deadline=deadline, alert=alert,
                    spec=json.dumps(spec), created=time.time()))
        except sa.exc.IntegrityError:
            return False
        return True

    @_retried
    def schedules(self) -> list[dict[str, Any]]:
        with self.begin() as conn:
            return [_row(row) for row in conn.execute(
                schedules_table.select().order_by(schedules_table.c.name))]

    @_retried
    def schedule(self, name: str) -> dict[str, Any] | None:
        with self.begin() as conn:
            row = conn.execute(schedules_table.select().where(
                schedules_table.c.name == name)).first()
        return _row(row) if row is not None else None

    @_retried
    def remove_schedule(self, name: str) -> bool:
        with self.begin() as conn:
            return bool(conn.execute(schedules_table.delete().where(
                schedules_table.c.name == name)).rowcount)

    # -- alerts

    @_retried
    def add_alert(self, schedule: str, occurrence: str, kind: str, message: str,
                  run_id: str | None) -> bool:
        """Record an alert; False when this one was already raised (each fires once)."""
        try:
            with self.begin() as conn:
                conn.execute(alerts_table.insert().values(
                    schedule=schedule, occurrence=occurrence, kind=kind, message=message,
                    run_id=run_id, at=time.time()))
        except sa.exc.IntegrityError:
            return False
        return True

    @_retried
    def set_delivery(self, schedule: str, occurrence: str, kind: str, delivery: str) -> None:
        with self.begin() as conn:
            conn.execute(alerts_table.update().where(
                alerts_table.c.schedule == schedule, alerts_table.c.occurrence == occurrence,
                alerts_table.c.kind == kind).values(delivery=delivery))

    @_retried
    def alerts(self, schedule: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        query = alerts_table.select().order_by(alerts_table.c.at.desc()).limit(limit)
        if schedule:
            query = query.where(alerts_table.c.schedule == schedule)
        with self.begin() as conn:
            return [dict(row._mapping) for row in conn.execute(query)]

    # -- deadlines: each occurrence is judged once, when its deadline has passed

    @_retried
    def judged(self, schedule: str) -> set[str]:
        """The occurrences of ``schedule`` whose deadline was already judged."""
        with self.begin() as conn:
            return {row[0] for row in conn.execute(sa.select(deadlines_table.c.occurrence)
                                                   .where(deadlines_table.c.schedule == schedule))}

    @_retried
    def judge(self, schedule: str, occurrence: str, met: bool) -> bool:
        """Record whether the occurrence had its verified artefact by its deadline; False
        when another check judged it first."""
        try:
            with self.begin() as conn:
                conn.execute(deadlines_table.insert().values(
                    schedule=schedule, occurrence=occurrence, met=met, at=time.time()))
        except sa.exc.IntegrityError:
            return False
        return True

    # -- meta

    @_retried
    def get_meta(self, key: str) -> str | None:
        with self.begin() as conn:
            row = conn.execute(sa.select(meta_table.c.value).where(meta_table.c.key == key)).first()
        return row[0] if row is not None else None

    @_retried
    def set_meta(self, key: str, value: str) -> bool:
        """Set ``key`` unless it is set; False when another value was there first."""
        try:
            with self.begin() as conn:
                conn.execute(meta_table.insert().values(key=key, value=value))
        except sa.exc.IntegrityError:
            return self.get_meta(key) == value
        return True


def unavailable(url: str, exc: BaseException) -> DatabaseUnavailable:
    reason = str(getattr(exc, "orig", exc) or exc).strip().splitlines()[0]
    fix = ("check the file's directory exists and is writable" if is_sqlite(url) else
           "start the Postgres server, or point DEJA_DATABASE_URL at one that runs")
    return DatabaseUnavailable(f"the runs database {safe_url(url)} cannot be reached "
                               f"({reason}); {fix}")
