"""Scheduled runs and their two alerts, under real ``deja worker`` processes on an
accelerated clock (a six-field cron, seconds first: an occurrence every 3 s).

A schedule fires and submits each occurrence under its deterministic id; occurrences
missed while no worker was up are backfilled once, however often workers restart; an
absence alert fires when no worker is up past a deadline (``check`` reads only the
database), once; a scheduled run that fails raises a failure alert, delivered to a
command and to a URL; a run whose artefact file changed after it ended has no verified
artefact; bad schedules are named errors with the fix.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from lifecycle_helpers import (  # noqa: F401 (fixtures)
    FAILING_AGENT,
    PYTHON,
    REPORT_AGENT,
    AlertSink,
    Workers,
    alert_sink_fixture,
    home_fixture,
    runs_fixture,
    wait_for,
    workers_fixture,
    write_agent,
)

from deja.runs import schedules, service
from deja.runs.errors import BadRunRequest, BadSchedule, NoSuchSchedule

EVERY_3S = "*/3 * * * * *"
NEVER_IN_A_TEST = "0 0 1 1 *"  # midnight on New Year's Day: fired by run-now only
STEP = timedelta(seconds=3)


def payload(directory: Path, agent: Path) -> dict[str, Any]:
    return {"command": [PYTHON, agent.name], "cwd": str(directory)}


def scheduled(runs: service.Runs, name: str) -> dict[datetime, dict[str, Any]]:
    """The schedule's runs by occurrence."""
    return {datetime.fromisoformat(r["occurrence"]): r
            for r in runs.list_runs(schedule=name, limit=1000)}


def completed_through(runs: service.Runs, name: str,
                      until: datetime) -> dict[datetime, dict[str, Any]] | None:
    """The runs, once every occurrence on the grid from the first run up to ``until`` has
    one and each of those completed (later ones may still be on their way)."""
    held = scheduled(runs, name)
    if not held:
        return None
    when = min(held)
    while when <= until:
        if when not in held or held[when]["status"] != "completed":
            return None
        when += STEP
    return held


def statuses(runs: service.Runs, name: str) -> list[tuple[str, str]]:
    return sorted((r["run_id"], r["status"]) for r in scheduled(runs, name).values())


def grid(times: list[datetime]) -> list[datetime]:
    """Every 3-second occurrence from the first of ``times`` to the last."""
    out, when = [], min(times)
    while when <= max(times):
        out.append(when)
        when += STEP
    return out


def check_runs_are_the_occurrences(held: dict[datetime, dict[str, Any]], name: str,
                                   ledger: Path) -> None:
    """One run per occurrence, each with its deterministic id, each executed once (the
    ledger line is a tool call: a run resumed after its worker stopped does not repeat
    it)."""
    for when, run in held.items():
        assert when.second % 3 == 0 and when.microsecond == 0
        assert run["run_id"] == schedules.occurrence_id(name, when) == \
               f"s_{name}_{when.strftime('%Y%m%dT%H%M%SZ')}"
        assert run["labels"] == {"schedule": name, "occurrence": when.isoformat()}
    lines = ledger.read_text().split()
    assert len(lines) == len(set(lines)), lines
    assert set(lines) <= {run["run_id"] for run in held.values()}
    assert {run["run_id"] for run in held.values() if run["status"] == "completed"} <= \
        set(lines)


def test_a_schedule_fires_and_missed_occurrences_are_backfilled_once(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    agent = write_agent(tmp_path, "report.py", REPORT_AGENT)
    runs.add_schedule("tick", EVERY_3S, "UTC", None, None, payload(tmp_path, agent))
    row = runs.store.schedule("tick")
    assert row is not None
    ledger = tmp_path / "ledger.txt"

    # It fires: a run per occurrence, under the occurrence's id. (A run takes about as
    # long as the period here: four at a time keep up.)
    first = workers.start("w1", "-j", "4")
    wait_for("an occurrence to run", lambda: any(
        r["status"] == "completed" for r in scheduled(runs, "tick").values()))
    first.stop()  # a run in flight ends interrupted and is resumed by the next worker
    fired = scheduled(runs, "tick")

    # No worker for a while: occurrences go by unsubmitted.
    time.sleep(5)
    assert scheduled(runs, "tick").keys() == fired.keys()
    workers.start("w1", "-j", "4")
    back = datetime.now(UTC)
    missed = [when for when in schedules.occurrences(row, back) if when > max(fired)]
    assert len(missed) >= 2
    held = wait_for("the missed occurrences to be backfilled and run",
                    lambda: completed_through(runs, "tick", back),
                    show=lambda: statuses(runs, "tick"))
    assert set(missed) <= set(held)
    check_runs_are_the_occurrences(held, "tick", ledger)

    # Restarting the worker again submits nothing twice.
    workers.started[-1].stop()
    workers.start("w1", "-j", "4")
    again = datetime.now(UTC)
    wait_for("the runs up to the restart", lambda: completed_through(runs, "tick", again),
             show=lambda: statuses(runs, "tick"))
    workers.stop_all()
    held = scheduled(runs, "tick")
    check_runs_are_the_occurrences(held, "tick", ledger)
    assert sorted(held) == grid(list(held))  # no occurrence left out since the first


def test_occurrences_missed_before_any_worker_came_up_are_backfilled(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    agent = write_agent(tmp_path, "report.py", REPORT_AGENT)
    runs.add_schedule("early", EVERY_3S, "UTC", None, None, payload(tmp_path, agent))
    row = runs.store.schedule("early")
    assert row is not None
    time.sleep(4)  # at least one occurrence passes with no worker at all
    missed = schedules.occurrences(row, datetime.now(UTC))
    assert missed
    workers.start("w1", "-j", "4")
    wait_for("the occurrences missed since the schedule was made to be submitted",
             lambda: set(missed) <= set(scheduled(runs, "early")), timeout=10)
    held = wait_for("them to run", lambda: completed_through(runs, "early", missed[-1]),
                    show=lambda: statuses(runs, "early"))
    assert min(held) == missed[0]
    check_runs_are_the_occurrences(held, "early", tmp_path / "ledger.txt")


def test_an_occurrence_due_as_the_worker_starts_is_submitted(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    """The engine's backfill ends when it runs and its scheduler counts from when it
    starts, a moment later: an occurrence due in between is the worker's to submit. Here
    the gap is made wide: the engine backfills nothing (as if its backfill had ended
    before the worker started), and a schedule fires every second."""
    agent = write_agent(tmp_path, "report.py", REPORT_AGENT)
    runs.add_schedule("sec", "* * * * * *", "UTC", None, None, payload(tmp_path, agent))
    added = datetime.now(UTC)
    with runs.store.begin() as conn:
        assert conn.execute(sa.text(
            "UPDATE workflow_schedules SET automatic_backfill = :no, last_fired_at = :at "
            "WHERE schedule_name = 'deja-sec'"), {"no": False, "at": added.isoformat()}
        ).rowcount == 1
    wait_for("two occurrences to pass with no worker up",
             lambda: datetime.now(UTC) > added + timedelta(seconds=2.5))
    worker = workers.start("w1", "-j", "4")
    record = runs.store.worker("w1")
    assert record is not None
    started = datetime.fromtimestamp(record["started"], UTC)  # before the engine starts

    def every_second_from_the_start() -> dict[datetime, dict[str, Any]] | None:
        held = scheduled(runs, "sec")
        if not held or min(held) > started or max(held) < started + timedelta(seconds=3):
            return None  # the second before the engine's scheduler started is not there
        seconds = sorted(held)
        return held if seconds == [seconds[0] + timedelta(seconds=i)
                                   for i in range(len(seconds))] else None

    held = wait_for("every second's occurrence from the worker's start on to be submitted",
                    every_second_from_the_start,
                    show=lambda: (started, statuses(runs, "sec"), worker.output()))
    worker.stop()
    runs.remove_schedule("sec")
    assert min(held) > added  # none from before the engine's last firing


def test_an_absence_alert_with_no_worker_up_fires_once_from_the_database_alone(
        runs: service.Runs, tmp_path: Path) -> None:
    inbox = tmp_path / "inbox.jsonl"
    agent = write_agent(tmp_path, "report.py", REPORT_AGENT)
    runs.add_schedule("weekly", EVERY_3S, "UTC", "2s", f"(cat; echo) >> {inbox}",
                      payload(tmp_path, agent))
    row = runs.store.schedule("weekly")
    assert row is not None
    first = schedules.next_occurrence(row, datetime.fromtimestamp(row["created"], UTC))

    assert schedules.check(runs.store, now=first + timedelta(seconds=1.9)) == []
    due = first + timedelta(seconds=2)
    occ = first.astimezone(UTC).isoformat()
    raised = schedules.check(runs.store, now=first + timedelta(seconds=2.5))
    message = (f"no verified artefact for weekly ({occ}) by {due.isoformat()}: "
               "the run never started")
    assert raised == [{"kind": "absence", "schedule": "weekly", "occurrence": occ,
                       "run_id": None, "message": message}]
    assert schedules.check(runs.store, now=first + timedelta(seconds=2.5)) == []
    assert [json.loads(line) for line in inbox.read_text().splitlines()] == raised
    [stored] = runs.store.alerts(schedule="weekly")
    assert stored["delivery"] == "command exited 0"
    assert runs.schedule("weekly")["alerts"][0]["message"] == message

    # What ``deja check`` does from system cron: a process with the database only (the
    # engine is not even imported), no worker anywhere.
    later = first + STEP + timedelta(seconds=2.5)
    script = ("import json, sys\nfrom datetime import datetime\n"
              "from deja.runs import config, schedules\nfrom deja.runs.store import Store\n"
              "alerts = schedules.check(Store(config.database_url()), "
              "now=datetime.fromisoformat(sys.argv[1]))\n"
              "print(json.dumps({'alerts': alerts, 'engine': 'dbos' in sys.modules}))\n")
    done = subprocess.run([PYTHON, "-c", script, later.isoformat()], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["engine"] is False
    second = (first + STEP).astimezone(UTC).isoformat()
    assert [(a["kind"], a["occurrence"]) for a in out["alerts"]] == [("absence", second)]
    assert len(inbox.read_text().splitlines()) == 2
    assert schedules.check(runs.store, now=later) == []


def test_a_failed_scheduled_run_alerts_a_command_and_a_url(
        runs: service.Runs, workers: Workers, tmp_path: Path,
        alert_sink: AlertSink) -> None:
    agent = write_agent(tmp_path, "failing.py", FAILING_AGENT)
    inbox = tmp_path / "failure.json"
    runs.add_schedule("pay-url", NEVER_IN_A_TEST, "UTC", None, alert_sink.url,
                      payload(tmp_path, agent))
    runs.add_schedule("pay-cmd", NEVER_IN_A_TEST, "UTC", None, f"cat > {inbox}",
                      payload(tmp_path, agent))
    workers.start("w1", "-j", "2")
    for name in ("pay-url", "pay-cmd"):
        assert runs.run_now(name)["triggered"] is True

    def delivered() -> list[dict[str, Any]] | None:
        alerts = runs.store.alerts()
        return alerts if len(alerts) == 2 and all(a["delivery"] for a in alerts) else None

    alerts = {a["schedule"]: a for a in wait_for("both failure alerts", delivered)}
    assert alerts["pay-url"]["delivery"] == "posted (204)"
    assert alerts["pay-cmd"]["delivery"] == "command exited 0"
    for name, alert in alerts.items():
        run = runs.get(alert["run_id"])
        assert run["status"] == "failed" and run["schedule"] == name
        assert alert["run_id"] == schedules.occurrence_id(
            name, datetime.fromisoformat(run["occurrence"]))
        assert alert["kind"] == "failure"
        assert alert["message"] == (f"scheduled run {alert['run_id']} of {name} "
                                    f"({run['occurrence']}) ended failed: the ledger is locked")
    [posted] = alert_sink.received
    sent = json.loads(inbox.read_text())
    for got, name in ((posted, "pay-url"), (sent, "pay-cmd")):
        tail = got.pop("stderr_tail")  # why it failed, without a login on the worker
        assert "the ledger is locked" in tail and "Traceback" in tail, tail
        assert got == {"kind": "failure", "schedule": name,
                       "occurrence": alerts[name]["occurrence"],
                       "run_id": alerts[name]["run_id"], "message": alerts[name]["message"],
                       "exit_status": 1}
        assert runs.get(alerts[name]["run_id"])["stderr_tail"] == tail  # and in its record
    assert schedules.check(runs.store) == []  # each alert fires once
    assert len(alert_sink.received) == 1


def test_a_failure_is_alerted_by_the_live_worker_writing_its_end_or_once_it_is_dead(
        runs: service.Runs, tmp_path: Path) -> None:
    """A scheduled run's end line says failed and its row still says working under a live
    worker: that worker raises the alert once it has written the error and the launcher's
    last lines, and a check in between raises nothing. With its worker dead, a check
    raises it, with the error its end line gives."""
    agent = write_agent(tmp_path, "failing.py", FAILING_AGENT)
    runs.add_schedule("pay", NEVER_IN_A_TEST, "UTC", None, None, payload(tmp_path, agent))
    spec = schedules.occurrence(runs.store, "pay", "2026-12-01T05:00:00+00:00")
    assert spec is not None
    done = subprocess.run([PYTHON, "-m", "deja", "record", "-o", spec["cassette"], "--",
                           PYTHON, agent.name], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "the ledger is locked" in done.stderr, done.stderr
    runs.store.update_run(spec["run_id"], status="working", worker="w1")
    runs.store.beat("w1", "here", 1, first=True)
    assert runs.get(spec["run_id"])["status"] == "failed"  # the end line says so
    assert schedules.check(runs.store) == []  # its worker is about to say more

    with runs.store.begin() as conn:  # w1 died before writing the run's end
        conn.execute(sa.text("UPDATE deja_workers SET beat = beat - 60"))
    [alert] = schedules.check(runs.store)
    assert alert["message"] == (f"scheduled run {spec['run_id']} of pay "
                                "(2026-12-01T05:00:00+00:00) ended failed: the ledger is "
                                "locked")
    assert schedules.check(runs.store) == []  # once


def test_a_changed_artefact_is_no_verified_artefact(
        runs: service.Runs, workers: Workers, tmp_path: Path) -> None:
    agent = write_agent(tmp_path, "report.py", REPORT_AGENT)
    runs.add_schedule("daily", EVERY_3S, "UTC", "30s", None, payload(tmp_path, agent))
    worker = workers.start("w1", "-j", "4")

    def two_completed() -> dict[datetime, dict[str, Any]] | None:
        done = {w: r for w, r in scheduled(runs, "daily").items() if r["status"] == "completed"}
        return done if len(done) >= 2 else None

    held = wait_for("two completed occurrences", two_completed)
    worker.stop()
    kept, changed = sorted(held)[:2]
    for when in (kept, changed):
        [artefact] = held[when]["artefacts"]
        assert artefact["path"] == f"report-{held[when]['run_id']}.txt"
    assert runs.schedule("daily")["last_verified_artefact"]["run_id"] in \
        {r["run_id"] for r in held.values()}

    report = tmp_path / held[changed]["artefacts"][0]["path"]
    report.write_text("edited by hand after the run\n")
    now = changed + timedelta(seconds=30)
    raised = {a["occurrence"]: a for a in schedules.check(runs.store, now=now)}
    assert kept.isoformat() not in raised  # its file still has the recorded hash
    alert = raised[changed.isoformat()]
    assert alert["kind"] == "absence" and alert["run_id"] == held[changed]["run_id"]
    assert alert["message"].endswith(
        f"the run {held[changed]['run_id']} completed without a verified artefact")
    assert schedules.check(runs.store, now=now) == []

    # Judged once: a file overwritten after its occurrence was judged pages nobody.
    (tmp_path / held[kept]["artefacts"][0]["path"]).write_text("next week's report\n")
    assert schedules.check(runs.store, now=now + timedelta(seconds=1)) == []


def test_bad_schedules_are_named_with_the_fix(runs: service.Runs, tmp_path: Path) -> None:
    command = payload(tmp_path, tmp_path / "report.py")
    cron_fix = ("five fields, minute hour day-of-month month day-of-week "
                "(e.g. \"0 6 * * 1\": Mondays at 06:00), or six with seconds first")
    for cron in ("61 * * * *", "* * * *", "every monday", "*/3 * * * * * * *"):
        with pytest.raises(BadSchedule) as caught:
            runs.add_schedule("weekly", cron, "UTC", "07:00", None, command)
        assert str(caught.value) == f"{cron!r} is not a cron expression: {cron_fix}"
    with pytest.raises(BadSchedule, match="'Mars/Olympus' is not a time zone; use an IANA "
                                          "name such as UTC or Europe/Paris"):
        runs.add_schedule("weekly", "0 6 * * 1", "Mars/Olympus", "07:00", None, command)
    for deadline in ("7am", "25:00", "2d", ""):
        with pytest.raises(BadSchedule, match=f"'{deadline}' is not a deadline: a time of "
                                              r"day \(07:00\) or a delay after the "
                                              r"occurrence \(90m, 2h, 30s\)"):
            runs.add_schedule("weekly", "0 6 * * 1", "UTC", deadline, None, command)
    with pytest.raises(BadSchedule, match="'weekly report' is not a schedule name"):
        runs.add_schedule("weekly report", "0 6 * * 1", "UTC", "07:00", None, command)
    assert runs.schedules() == [] and runs.store.schedules() == []

    for call in (runs.schedule, runs.remove_schedule, runs.run_now):
        with pytest.raises(NoSuchSchedule, match="no schedule 'nightly'; `deja schedule ls` "
                                                 "lists them"):
            call("nightly")

    made = runs.add_schedule("weekly", "0 6 * * 1", "Europe/Paris", "07:00", None, command)
    assert re.search(r"T06:00:00\+0[12]:00$", made["next"])  # 06:00 in Paris
    assert datetime.fromisoformat(made["next"]).weekday() == 0
    with pytest.raises(BadRunRequest, match="a schedule named 'weekly' exists; "
                                            "`deja schedule rm weekly` first"):
        runs.add_schedule("weekly", "0 7 * * 1", "UTC", None, None, command)
    assert runs.remove_schedule("weekly") == {"name": "weekly", "removed": True}
    with pytest.raises(NoSuchSchedule):
        runs.schedule("weekly")
