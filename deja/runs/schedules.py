"""Scheduled runs and the two alerts: a run that fails, and an artefact that is absent.

``deja schedule add NAME --cron "0 6 * * 1" --tz Europe/Paris --deadline 07:00
--alert CMD|URL -- CMD`` stores the schedule (``deja_schedules``) and an engine cron
schedule whose workflow submits each occurrence as a run with a **deterministic id**,
``s_<name>_<UTC time of the occurrence>``: an occurrence can only ever be one run.

**Backfill.** After downtime, every occurrence missed since the schedule last fired is
submitted once when a worker comes back (the engine's automatic backfill), oldest first,
each under its own deterministic id: never twice, however often workers restart. An
occurrence that runs late can still satisfy its deadline if no check has judged it yet;
an alert already raised stays raised.

**The deadline** is a time of day (``07:00``: the first 07:00 in the schedule's zone at
or after the occurrence) or a delay (``90m``, ``2h``, ``30s``). By then the occurrence
must have a **verified artefact**: its run ended ``completed``, its cassette verifies,
and a file it declared with ``recorder.artefact(path)`` still has the SHA-256 the
cassette recorded (the worker stores the verified ones on the run's row when it ends; the
first check after the deadline hashes those files again). Otherwise an **absence** alert
fires: the run never started, is still queued or working, or ended without a verified
artefact (a file changed since the run counts as none). Each occurrence is judged once,
by the first check after its deadline (``deja_deadlines``): a later run that overwrites
the same file does not page for an occurrence already judged. A scheduled run that ends
in any status but ``completed`` raises a **failure** alert at once. Each alert fires
once per occurrence (a unique row in ``deja_alerts``).

:func:`check` evaluates deadlines from the database alone, so ``deja check`` from system
cron fires alerts even when no worker is alive; live workers run it every 15 s as well.
An alert goes to the schedule's ``--alert``: a URL gets the alert as a JSON ``POST``; a
command gets it as JSON on its standard input and as ``DEJA_ALERT_*`` environment
variables. Without ``--alert`` it is printed by ``deja check`` and shown in the viewer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from deja.runs.errors import BadSchedule
from deja.runs.locks import live_workers
from deja.runs.store import DISK_ERROR, ENDED, Store
from recorder.cassette.schema import Kind, run_status
from recorder.harness.progress import cassette_end

log = logging.getLogger("deja.runs")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_CLOCK = re.compile(r"([01]?\d|2[0-3]):([0-5]\d)")
_DELAY = re.compile(r"(\d+)(s|m|h)")
LOOKBACK = 200  # occurrences examined per schedule by a check


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name or ""):
        raise BadSchedule(f"{name!r} is not a schedule name (letters, digits, '_' and '-', "
                          "up to 64, e.g. weekly-report)")
    return name


def check_cron(cron: str) -> str:
    from croniter import croniter

    fields = cron.split()
    if len(fields) not in (5, 6) or not croniter.is_valid(cron, second_at_beginning=True):
        raise BadSchedule(f"{cron!r} is not a cron expression: five fields, minute hour "
                          "day-of-month month day-of-week (e.g. \"0 6 * * 1\": Mondays at "
                          "06:00), or six with seconds first")
    return cron


def check_tz(tz: str) -> str:
    try:
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise BadSchedule(f"{tz!r} is not a time zone; use an IANA name such as UTC or "
                          "Europe/Paris") from None
    return tz


def check_deadline(deadline: str | None) -> str | None:
    if deadline is None or _CLOCK.fullmatch(deadline) or _DELAY.fullmatch(deadline):
        return deadline
    raise BadSchedule(f"{deadline!r} is not a deadline: a time of day (07:00) or a delay "
                      "after the occurrence (90m, 2h, 30s)")


def occurrence_id(name: str, when: datetime) -> str:
    return f"s_{name}_{when.astimezone(UTC).strftime('%Y%m%dT%H%M%SZ')}"


def deadline_of(when: datetime, deadline: str, tz: str) -> datetime:
    delay = _DELAY.fullmatch(deadline)
    if delay:
        amount, unit = int(delay.group(1)), delay.group(2)
        return when + timedelta(**{{"s": "seconds", "m": "minutes", "h": "hours"}[unit]:
                                   amount})
    clock = _CLOCK.fullmatch(deadline)
    assert clock is not None
    local = when.astimezone(ZoneInfo(tz))
    due = local.replace(hour=int(clock.group(1)), minute=int(clock.group(2)), second=0,
                        microsecond=0)
    if due < local:
        due += timedelta(days=1)
    return due


def occurrences(schedule: dict[str, Any], until: datetime) -> list[datetime]:
    """The schedule's occurrences after its creation up to ``until`` included (the latest
    ``LOOKBACK``), oldest first.

    Walked backwards from ``until``: a check costs ``LOOKBACK`` steps however old the
    schedule is (walking forwards from its creation, a per-minute schedule a month old
    took seconds per check).
    """
    from croniter import croniter

    tz = ZoneInfo(schedule["tz"])
    start = (until + timedelta(microseconds=1)).astimezone(tz)  # get_prev is strict
    it = croniter(schedule["cron"], start, second_at_beginning=True)
    out: list[datetime] = []
    while len(out) < LOOKBACK:
        when = it.get_prev(datetime)
        if when.timestamp() <= schedule["created"]:
            break
        out.append(when)
    return out[::-1]


def next_occurrence(schedule: dict[str, Any], after: datetime | None = None) -> datetime:
    from croniter import croniter

    tz = ZoneInfo(schedule["tz"])
    base = (after or datetime.now(UTC)).astimezone(tz)
    return croniter(schedule["cron"], base, second_at_beginning=True).get_next(datetime)


def occurrence(store: Store, name: str, when_text: str) -> dict[str, Any] | None:
    """Submit the run of one occurrence (the engine's schedule workflow calls this)."""
    schedule = store.schedule(name)
    if schedule is None:
        return None  # removed since: nothing to run
    when = datetime.fromisoformat(when_text)
    run_id = occurrence_id(name, when)
    spec = dict(schedule["spec"])
    spec["run_id"] = run_id
    spec["cassette"] = str(Path(spec["cassette_dir"]) / f"{run_id}.jsonl")
    spec["labels"] = {**(spec.get("labels") or {}), "schedule": name,
                      "occurrence": when.astimezone(UTC).isoformat()}
    store.add_run(run_id, spec, schedule=name, occurrence=when.astimezone(UTC).isoformat())
    return spec


def verified_artefacts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The files the run declared whose content its verified cassette vouches for."""
    from recorder.cassette import load
    from recorder.errors import DejaError

    try:
        cassette = load(spec["cassette"], require_signature=True)
    except DejaError as exc:
        log.warning("run %s: its cassette does not verify (%s); no artefact counts",
                    spec.get("run_id"), exc)
        return []
    out = []
    for obs in cassette.observations:
        if obs.get("kind") != Kind.EFFECT or obs.get("name") != "artefact":
            continue
        info = obs.get("value")
        if not isinstance(info, dict) or not isinstance(info.get("path"), str):
            continue
        path = Path(spec["cwd"]) / info["path"]
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            continue
        if digest == info.get("sha256"):
            out.append({"path": info["path"], "sha256": digest, "bytes": info.get("bytes")})
    return out


def still_verified(run: dict[str, Any]) -> bool:
    """Whether a completed run's verified artefacts (stored on its row when it ended,
    from its verified cassette) still hold the content the cassette vouched for."""
    if status_of(run) != "completed":
        return False
    for info in run.get("artefacts") or []:
        try:
            digest = hashlib.sha256((Path(run["spec"]["cwd"]) / info["path"])
                                    .read_bytes()).hexdigest()
        except (OSError, KeyError, TypeError):
            continue
        if digest == info.get("sha256"):
            return True
    return False


def _end_of(run: dict[str, Any]) -> dict[str, Any] | None:
    cassette = (run.get("spec") or {}).get("cassette")
    return cassette_end(cassette)[1] if cassette else None


def status_of(run: dict[str, Any]) -> str:
    """A run's status as everyone shows it (:func:`recorder.cassette.schema.run_status`):
    its cassette's end line first, then its row."""
    return run_status(_end_of(run), run["status"])


def _failed(run: dict[str, Any]) -> bool:
    """Ended other than ``completed``; a run its full cassette directory stopped is not
    over (it is dispatched again once there is room)."""
    status = status_of(run)
    waiting = status == "interrupted" and (run.get("error") or "").startswith(DISK_ERROR)
    return status in ENDED and status != "completed" and not waiting


def end_error(end: dict[str, Any]) -> str | None:
    """What an end line says went wrong (a failed run's message, an interruption's)."""
    error = end.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    if message or end.get("reason"):
        return str(message or end.get("reason"))
    return "the program failed" if run_status(end) == "failed" else None


def _message(kind: str, schedule: dict[str, Any], occ: str, run: dict[str, Any] | None,
             due: datetime | None) -> str:
    name = schedule["name"]
    end = _end_of(run) if run is not None else None  # read once
    status = run_status(end, run["status"]) if run is not None else None
    if kind == "failure":
        assert run is not None
        error = run.get("error") or (end_error(end) if end is not None else None)
        return (f"scheduled run {run['run_id']} of {name} ({occ}) ended {status}"
                + (f": {error}" if error else ""))
    when = due.isoformat() if due is not None else "its deadline"
    if run is None:
        why = "the run never started"
    elif status in ("queued", "working", "input_required"):
        why = f"the run {run['run_id']} is still {status}"
    elif status == "completed":
        why = f"the run {run['run_id']} completed without a verified artefact"
    else:
        why = f"the run {run['run_id']} ended {status}"
    return f"no verified artefact for {name} ({occ}) by {when}: {why}"


def _failure_detail(run: dict[str, Any]) -> dict[str, Any]:
    """A failed run's exit status (its end line's) and the last lines its launcher wrote
    to stderr (kept, redacted, in its record)."""
    end = _end_of(run)
    progress = run.get("progress")
    progress = progress if isinstance(progress, dict) else {}
    return {"exit_status": end.get("exit_code") if end else None,
            "stderr_tail": progress.get("stderr_tail")}


def _raise(store: Store, schedule: dict[str, Any], occ: str, kind: str,
           run: dict[str, Any] | None, due: datetime | None = None) -> dict[str, Any] | None:
    message = _message(kind, schedule, occ, run, due)
    run_id = run["run_id"] if run else None
    if not store.add_alert(schedule["name"], occ, kind, message, run_id):
        return None
    alert: dict[str, Any] = {"kind": kind, "schedule": schedule["name"], "occurrence": occ,
                             "run_id": run_id, "message": message}
    if kind == "failure" and run is not None:  # why, without a login on the worker
        alert.update(_failure_detail(run))
    store.set_delivery(schedule["name"], occ, kind, deliver(schedule.get("alert"), alert))
    return alert


def deliver(target: str | None, alert: dict[str, Any]) -> str:
    """Send ``alert`` to a URL (JSON POST) or a command (JSON on stdin); say how it went."""
    if not target:
        return "stored"
    body = json.dumps(alert).encode()
    try:
        if target.startswith(("http://", "https://")):
            request = urllib.request.Request(target, data=body, method="POST",
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                return f"posted ({response.status})"
        env = dict(os.environ, DEJA_ALERT_KIND=alert["kind"],
                   DEJA_ALERT_SCHEDULE=alert["schedule"],
                   DEJA_ALERT_OCCURRENCE=alert["occurrence"],
                   DEJA_ALERT_RUN=alert.get("run_id") or "", DEJA_ALERT_MESSAGE=alert["message"])
        done = subprocess.run(target, shell=True, input=body, env=env, timeout=60,
                              capture_output=True, check=False)
        return f"command exited {done.returncode}"
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        log.warning("alert for %s could not be delivered to its target: %s",
                    alert["schedule"], exc)
        return f"failed: {type(exc).__name__}: {exc}"


def after_run(store: Store, run_id: str) -> None:
    """A scheduled run that ended other than ``completed`` raises its failure alert."""
    run = store.get_run(run_id)
    if run is None or not run.get("schedule") or not _failed(run):
        return
    schedule = store.schedule(run["schedule"])
    if schedule is not None:
        _raise(store, schedule, run["occurrence"], "failure", run)


def check(store: Store, now: datetime | None = None) -> list[dict[str, Any]]:
    """Raise every alert due as of ``now`` (default: the current time) and return the new
    ones: failures of scheduled runs, and occurrences past their deadline with no
    verified artefact."""
    now = now or datetime.now(UTC)
    raised: list[dict[str, Any]] = []
    # A run whose live worker has not written its end yet: the worker raises its failure
    # alert as it does (after_run), with the error and the launcher's last lines.
    writing = live_workers(store)
    for schedule in store.schedules():
        runs = {r["occurrence"]: r for r in store.list_runs(schedule=schedule["name"],
                                                           limit=LOOKBACK)}
        for run in runs.values():
            if _failed(run) and not (run["status"] in ("queued", "working")
                                     and run.get("worker") in writing):
                alert = _raise(store, schedule, run["occurrence"], "failure", run)
                if alert:
                    raised.append(alert)
        if not schedule.get("deadline"):
            continue
        judged = store.judged(schedule["name"])
        for when in occurrences(schedule, now):
            due = deadline_of(when, schedule["deadline"], schedule["tz"])
            occ = when.astimezone(UTC).isoformat()
            if due > now or occ in judged:
                continue
            held = runs.get(occ)
            met = held is not None and still_verified(held)
            if not store.judge(schedule["name"], occ, met) or met:
                continue  # judged by a concurrent check, or satisfied
            alert = _raise(store, schedule, occ, "absence", held, due)
            if alert:
                raised.append(alert)
    return raised
