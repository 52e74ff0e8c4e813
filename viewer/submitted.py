"""What the Submitted runs page asks of the runs database, as plain functions.

The runs submitted with ``deja submit`` or ``POST /runs`` (and those a schedule fired) live
in the runs database (:func:`deja.runs.config.database_url`), not in a cassette folder. This
module opens it through :class:`deja.runs.service.Runs`, the service ``deja serve`` uses, and
turns its records into the rows the page (:mod:`viewer.submitted_page`) lays out.

Viewing never creates the database: an embedded SQLite file that does not exist yet is
reported as such (:func:`missing_database`) before anything opens it; a Postgres server
that does not answer raises :class:`deja.runs.errors.DatabaseUnavailable` with its fix.
The engine's client (``deja.runs.engine``, slow to import) is imported by :func:`connect`
only, so the other pages of the viewer never pay for it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from deja.runs.config import is_sqlite, safe_url
from deja.runs.errors import DatabaseUnavailable
from deja.runs.service import Runs
from deja.runs.store import Store, unavailable
from viewer.queries import labels_text

ACTIVE = ("queued", "working", "input_required")
CANCELLABLE = ("queued", "working")
RECENT = 20  # ended runs listed below the active ones
ACTIVE_LIMIT = 200
ACTIVE_COLUMNS = ("run", "status", "step", "turn", "spend", "worker", "labels", "submitted",
                  "updated")
ENDED_COLUMNS = ("run", "status", "step", "turn", "spend", "worker", "labels", "submitted",
                 "ended", "error")
SCHEDULE_COLUMNS = ("name", "cron", "tz", "next", "deadline", "last verified artefact",
                    "latest alert", "command")
HOW_TO_START = ("Start the service with `deja serve` (the HTTP API: `deja submit -- CMD` "
                "sends it runs) and at least one `deja worker` to run them; schedules are "
                "added with `deja schedule add`. Set `DEJA_DATABASE_URL` to read a Postgres "
                "runs database instead of the embedded one under `$DEJA_HOME`.")


@dataclass(frozen=True)
class Board:
    """What the page shows: the active runs, the recently ended ones, the schedules."""

    where: str  # the database, without its password
    active: list[dict[str, Any]]
    ended: list[dict[str, Any]]
    schedules: list[dict[str, Any]]


def database_file(url: str) -> Path | None:
    """The file of an SQLite URL (None for a server database, or SQLite in memory)."""
    if not is_sqlite(url):
        return None
    name = sa.engine.make_url(url).database
    return Path(name) if name and name != ":memory:" else None


def missing_database(url: str) -> Path | None:
    """The SQLite file ``url`` names when it does not exist yet: no run was ever submitted
    (opening it would create it, which viewing must not do)."""
    path = database_file(url)
    return path if path is not None and not path.is_file() else None


def connect(url: str) -> Runs:
    """The runs service over ``url``; :class:`DatabaseUnavailable` when it cannot be
    reached, or when it is an SQLite file that does not exist yet."""
    missing = missing_database(url)
    if missing is not None:
        raise DatabaseUnavailable(f"no runs database yet: {missing} does not exist (it is "
                                  "created when the first worker or `deja serve` starts)")
    from deja.runs import engine

    store = Store(url)
    try:
        client = engine.Client(url)
    except BaseException:
        store.close()
        raise
    return Runs(store, client)


def close(runs: Runs) -> None:
    runs.client.close()
    runs.store.close()


def database_errors() -> tuple[type[BaseException], ...]:
    """What a database that stops answering raises (the engine is imported by then: the
    page has a connection)."""
    from deja.runs import engine

    return (sa.exc.SQLAlchemyError, *engine.ENGINE_ERRORS)


def board(runs: Runs, *, recent: int = RECENT) -> Board:
    """The active runs (newest first), the ``recent`` latest ended ones and the schedules;
    :class:`DatabaseUnavailable` when the database stops answering."""
    failures = database_errors()
    try:
        active = runs.list_runs(status=list(ACTIVE), limit=ACTIVE_LIMIT)
        ended = [r for r in runs.list_runs(limit=recent + len(active))
                 if r["status"] not in ACTIVE][:recent]
        kept = runs.schedules()
    except failures as exc:
        raise unavailable(runs.store.url, exc) from None
    return Board(where=safe_url(runs.store.url), active=active, ended=ended, schedules=kept)


def run_record(runs: Runs, run_id: str) -> dict[str, Any]:
    """What the runs database says of run ``run_id``: its status and ``cassette``, the file
    its worker records into, wherever that lies (the viewer opens it by this name only,
    never by a path from its URL). :class:`recorder.errors.NoSuchRun` when it holds no such
    run, :class:`DatabaseUnavailable` when it stops answering."""
    try:
        return runs.get(run_id)
    except database_errors() as exc:
        raise unavailable(runs.store.url, exc) from None


def turn_text(record: dict[str, Any]) -> str | None:
    turn, limit = record.get("turn"), record.get("turn_limit")
    if turn is None:
        return None
    return f"{turn}/{limit}" if limit is not None else str(turn)


def run_row(record: dict[str, Any]) -> dict[str, Any]:
    """One row of a runs table (every column of :data:`ENDED_COLUMNS` and
    :data:`ACTIVE_COLUMNS`)."""
    return {"run": record["run_id"], "status": record["status"], "step": record.get("step"),
            "turn": turn_text(record), "spend": record.get("spend_usd"),
            "worker": record.get("worker"), "labels": labels_text(record.get("labels")),
            "submitted": record.get("submitted"), "updated": record.get("updated"),
            "ended": record.get("ended"), "error": record.get("error")}


def waiting(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that wait for an answer (each has its question)."""
    return [r for r in records if r["status"] == "input_required"]


def cancellable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["status"] in CANCELLABLE]


def artefact_text(last: dict[str, Any] | None) -> str | None:
    """A schedule's last verified artefact: its file(s) and the run that made them."""
    if not last:
        return None
    files = ", ".join(a["path"] for a in last.get("artefacts") or [])
    return f"{files} ({last['run_id']})"


def alert_text(alert: dict[str, Any]) -> str:
    return f"{alert['kind']} at {alert['at']}: {alert['message']}"


def schedule_row(schedule: dict[str, Any]) -> dict[str, Any]:
    """One row of the schedules table (:data:`SCHEDULE_COLUMNS`)."""
    alerts = schedule.get("alerts") or []
    return {"name": schedule["name"], "cron": schedule["cron"], "tz": schedule["tz"],
            "next": schedule["next"], "deadline": schedule.get("deadline"),
            "last verified artefact": artefact_text(schedule.get("last_verified_artefact")),
            "latest alert": alert_text(alerts[0]) if alerts else None,
            "command": shlex.join(schedule.get("command") or [])}
