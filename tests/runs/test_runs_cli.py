"""The commands around runs that need no worker: schedules and ``deja check`` on the
database itself, an answer left for a ``deja record`` run of this machine, every
command's help, and the named errors of a database that cannot be reached."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner
from test_api import Deja, api, deja, free_port, wait_for  # noqa: F401 (the deja fixture)

from deja.cli import main
from recorder.harness.progress import read_status


def next_monday_0600(after: datetime) -> datetime:
    day = after.replace(hour=6, minute=0, second=0, microsecond=0)
    day += timedelta(days=(7 - day.weekday()) % 7)
    return day if day > after else day + timedelta(days=7)


def test_a_schedule_is_added_listed_alerted_on_by_check_and_removed(deja: Deja) -> None:  # noqa: F811
    added = deja("schedule", "add", "weekly-report", "--cron", "0 6 * * 1", "--tz", "UTC",
                 "--deadline", "07:00", "--label", "team=billing", "--max-turns", "20",
                 "--", "python", "ask_agent.py")
    assert added.returncode == 0, added.stderr
    occurrence = next_monday_0600(datetime.now(UTC))
    assert "schedule weekly-report added" in added.stdout
    assert occurrence.isoformat() in added.stdout and "artefact due 07:00" in added.stdout
    twice = deja("schedule", "add", "weekly-report", "--cron", "0 6 * * 1", "--", "true")
    assert twice.returncode == 2 and "exists" in twice.stderr
    bad_cron = deja("schedule", "add", "other", "--cron", "61 * * * *", "--", "python", "a.py")
    assert bad_cron.returncode == 2 and "BadSchedule" in bad_cron.stderr
    assert "five fields" in bad_cron.stderr and "Traceback" not in bad_cron.stderr
    for bad, says in ((["--tz", "Mars/Olympus"], "not a time zone"),
                      (["--deadline", "noonish"], "not a deadline"),
                      (["--label", "nokey"], "not KEY=VALUE")):  # refused before any database
        done = CliRunner().invoke(main, ["schedule", "add", "other", "--cron", "0 6 * * 1",
                                         *bad, "--", "python", "a.py"])
        assert done.exit_code == 2 and says in done.output, done.output

    listed = json.loads(deja("schedule", "ls", "--json").stdout)
    assert [s["name"] for s in listed] == ["weekly-report"]
    assert listed[0]["command"] == ["python", "ask_agent.py"]
    assert listed[0]["next"] == occurrence.isoformat() and listed[0]["alerts"] == []
    table = deja("schedule", "ls")
    assert table.returncode == 0 and "weekly-report" in table.stdout
    spaced = deja("schedule", "add", "spaced", "--cron", "0 7 * * 1", "--", "python",
                  "my agent.py", "--note", "it's")
    assert spaced.returncode == 0, spaced.stderr
    table = deja("schedule", "ls")  # a command as a shell would take it
    assert """python 'my agent.py' --note 'it'"'"'s'""" in table.stdout, table.stdout
    assert deja("schedule", "rm", "spaced").returncode == 0

    server = deja.serve()
    status, body = api("GET", f"{server.url}/schedules")
    assert status == 200 and [s["name"] for s in body["schedules"]] == ["weekly-report"]

    # no worker is alive: deja check alone raises the absence alert, once
    before = deja("check", "--now", (occurrence + timedelta(minutes=30)).isoformat())
    assert before.returncode == 0 and before.stdout == ""
    late = (occurrence + timedelta(hours=1, minutes=30)).isoformat()
    alerted = deja("check", "--now", late)
    assert alerted.returncode == 1, alerted.stderr
    assert "ALERT absence" in alerted.stdout and "the run never started" in alerted.stdout
    again = deja("check", "--now", late, "--json")
    assert again.returncode == 0 and json.loads(again.stdout) == []
    shown = json.loads(deja("schedule", "ls", "--json").stdout)[0]["alerts"]
    assert [a["kind"] for a in shown] == ["absence"]
    naive = CliRunner().invoke(main, ["check", "--now", "2026-12-07T07:30:00"])
    assert naive.exit_code == 2 and "no time zone" in naive.output

    now = deja("schedule", "run-now", "weekly-report")  # no worker ever started here
    assert now.returncode == 0 and "deja runs --schedule weekly-report" in now.stdout
    assert re.search(r"run s_weekly-report_\d{8}T\d{6}Z is queued", now.stdout), now.stdout
    deja.worker("w1")  # the queued occurrence runs once a worker is up

    def scheduled(status: str) -> dict | None:
        found = api("GET", f"{server.url}/runs?schedule=weekly-report")[1]["runs"]
        return found[0] if found and found[0]["status"] == status else None

    waiting = wait_for(lambda: scheduled("input_required"), 30)
    assert waiting["run_id"].startswith("s_weekly-report_")
    assert waiting["labels"]["team"] == "billing"
    assert waiting["question"] == "Ship the weekly report?"
    assert deja("answer", waiting["run_id"], "on schedule").returncode == 0
    done = wait_for(lambda: scheduled("completed"), 30)
    assert [a["path"] for a in done["artefacts"]] == ["report.txt"]
    listed = deja("runs", "--schedule", "weekly-report", "--json")
    assert [r["run_id"] for r in json.loads(listed.stdout)["runs"]] == [waiting["run_id"]]
    for verb in ("rm", "run-now"):
        missing = deja("schedule", verb, "nightly")
        assert missing.returncode == 2 and "NoSuchSchedule" in missing.stderr
    removed = deja("schedule", "rm", "weekly-report")
    assert removed.returncode == 0 and "removed" in removed.stdout
    assert json.loads(deja("schedule", "ls", "--json").stdout) == []


def test_an_answer_for_a_recorded_run_of_this_machine_is_left_for_it(deja: Deja) -> None:  # noqa: F811
    deja.env["DEJA_SERVER"] = f"http://127.0.0.1:{free_port()}"  # no server at all
    cassette = deja.tmp / "ask.jsonl"
    with (deja.tmp / "record.log").open("wb") as log:
        recording = subprocess.Popen(
            [sys.executable, "-m", "deja", "record", "-o", str(cassette), "--run-id",
             "r_localask000000001", "--", "python", "ask_agent.py"], cwd=deja.work,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (read_status("r_localask000000001") or {}).get("status") ==
                 "input_required", 30, lambda: (deja.tmp / "record.log").read_text())
        answered = deja("answer", "r_localask000000001", "locally")
        assert answered.returncode == 0, answered.stderr
        assert "answer left for run r_localask000000001" in answered.stdout
        assert recording.wait(timeout=30) == 0, (deja.tmp / "record.log").read_text()
    finally:
        if recording.poll() is None:
            recording.kill()
            recording.wait()
    assert (deja.work / "report.txt").read_text().startswith("shipped: locally")
    done = json.loads(deja("status", "r_localask000000001", "--json").stdout)
    assert done["status"] == "completed"
    bad = deja("answer", "../etc", "x")
    assert bad.returncode == 2 and "not a run id" in bad.stderr


def test_a_crashed_run_of_this_machine_is_shown_though_another_homes_server_refuses(
        deja: Deja) -> None:  # noqa: F811
    """A run recorded here whose processes were killed outright leaves its status record
    behind. `deja status` and `deja cancel` ask deja serve in case it ran the run; a
    server of another DEJA_HOME refuses them (its token is not this home's): this
    machine's record is shown, and nothing fails."""
    import os
    import signal

    deja.serve(env={"DEJA_HOME": str(deja.tmp / "other-home")})
    cassette = deja.tmp / "ask.jsonl"
    run = "r_killedask00000001"
    with (deja.tmp / "record.log").open("wb") as log:
        recording = subprocess.Popen(
            [sys.executable, "-m", "deja", "record", "-o", str(cassette), "--run-id", run,
             "--", "python", "ask_agent.py"], cwd=deja.work, start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (read_status(run) or {}).get("status") == "input_required", 30,
                 lambda: (deja.tmp / "record.log").read_text())
    finally:
        os.killpg(recording.pid, signal.SIGKILL)  # the launcher and the program at once
        recording.wait(timeout=30)
    shown = deja("status", run)
    assert shown.returncode == 0, shown.stderr
    assert f"run {run}: crashed: its process" in shown.stdout and "deja resume" in shown.stdout
    assert "refused to say whether it ran" in shown.stderr and "Unauthorized" in shown.stderr
    cancelled = deja("cancel", run)
    assert cancelled.returncode == 2 and "is gone (it crashed)" in cancelled.stderr, \
        cancelled.stderr
    assert "Traceback" not in shown.stderr + cancelled.stderr


def test_a_database_that_cannot_be_reached_is_a_named_error(deja: Deja) -> None:  # noqa: F811
    blocker = deja.tmp / "a-file"
    blocker.write_text("not a directory\n")
    url = f"sqlite:///{blocker}/runs.sqlite"
    t0 = time.monotonic()
    for args in (["serve", "--port", "0", "--db", url], ["check", "--db", url],
                 ["schedule", "ls", "--db", url]):
        done = deja(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert "DatabaseUnavailable" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("command", [
    ["serve"], ["worker"], ["submit"], ["runs"], ["answer"], ["status"], ["cancel"],
    ["check"], ["schedule"], ["schedule", "add"], ["schedule", "ls"], ["schedule", "rm"],
    ["schedule", "run-now"]])
def test_every_command_says_what_it_does(command: list[str]) -> None:
    result = CliRunner().invoke(main, [*command, "--help"])
    assert result.exit_code == 0, result.output
    summary = result.output.split("\n\n")[1].strip()
    assert len(summary) > 20, result.output
