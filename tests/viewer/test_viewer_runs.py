"""The Submitted runs page (viewer/submitted_page.py) over a real runs database.

The runs are made the real way: small agents (``recorder.ask``, ``recorder.now``,
``recorder.artefact``) submitted through :class:`deja.runs.service.Runs` and run by a real
``deja worker`` subprocess; a queued run is one submitted with no worker up. The page is
driven with AppTest (``?page=submitted``), and once in headless Chromium through
``deja view``, where the answer is typed and sent as a person would.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from playwright.sync_api import expect
from streamlit.testing.v1 import AppTest
from test_viewer_browser import (
    button,
    chromium_missing,
    chromium_page,
    grid,
    open_page,
    serve_viewer,
    shot,
)

from deja.runs import config, engine, schedules
from deja.runs.service import Runs
from deja.runs.store import Store
from viewer import submitted, submitted_page
from viewer.safe import unescape

APP = Path(__file__).resolve().parents[2] / "viewer" / "app.py"
QUESTION = "Pay invoice INV-7 twice?"
ASK_AGENT = f'''
import pathlib
import recorder

answer = recorder.ask({QUESTION!r})
pathlib.Path("answer.txt").write_text(f"{{answer}} at {{recorder.now()}}")
'''
REPORT_AGENT = '''
import pathlib
import recorder

pathlib.Path("report.csv").write_text(f"week,total\\n1,{recorder.now()}\\n")
recorder.artefact("report.csv")
'''
TIMEOUT = 30.0


# ---------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, scope="module")
def _release_connections() -> Iterator[None]:
    """The page keeps one runs service per database; close them when the module ends."""
    yield
    submitted_page.connection.clear()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "ask_agent.py").write_text(ASK_AGENT)
    (folder / "report_agent.py").write_text(REPORT_AGENT)
    return folder


@pytest.fixture
def runs(deja_home: Path) -> Iterator[Runs]:
    """The runs service over this test's database (the embedded SQLite under DEJA_HOME)."""
    url = config.database_url()
    service = Runs(Store(url), engine.Client(url))
    yield service
    submitted.close(service)


@contextmanager
def worker(log: Path, worker_id: str = "w1") -> Iterator[subprocess.Popen[bytes]]:
    """``deja worker --id W`` with this test's environment, up until the block ends."""
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "deja", "worker", "--id", worker_id],
                                   stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT
        while b"is up" not in log.read_bytes():
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the worker did not come up:\n{log.read_text()}")
            time.sleep(0.1)
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_status(runs: Runs, run_id: str, status: str, log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT
    while True:
        record = runs.get(run_id)
        if record["status"] == status:
            return record
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} is {record['status']}, not {status}:\n"
                                 f"{log.read_text()}")
        time.sleep(0.1)


def app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AppTest:
    folder = tmp_path / "cassettes"
    folder.mkdir(exist_ok=True)
    monkeypatch.setenv("DEJA_VIEW_DIR", str(folder))
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params["page"] = "submitted"
    return ok(at.run())


def ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    return at


def texts(elements: Any) -> list[str]:
    """The elements' text as it reads (a run's words are escaped in their Markdown)."""
    return [unescape(str(e.value)) for e in elements]


# Each table by a column only it has: the active runs, the ended ones, the schedules.
TABLES = {"active_runs": "updated", "ended_runs": "ended", "schedules": "cron"}


def table(at: AppTest, key: str) -> Any:
    frames = [d.value for d in at.dataframe if TABLES[key] in d.value.columns]
    assert frames, f"no table {key!r} on the page"
    return frames[0]


def row(at: AppTest, key: str, run_id: str) -> Any:
    frame = table(at, key)
    found = frame[frame["run"] == run_id]
    assert len(found) == 1, frame.to_string()
    return found.iloc[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# ---------------------------------------------------------------------- AppTest


def test_no_database_yet_says_how_to_start_and_creates_nothing(
        deja_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = app(monkeypatch, tmp_path)
    assert texts(at.title) == ["Submitted runs"]
    [info] = texts(at.info)
    assert info.startswith("No runs database yet") and str(deja_home / "runs.sqlite") in info
    assert any("`deja serve`" in m and "`deja worker`" in m for m in texts(at.markdown))
    assert not (deja_home / "runs.sqlite").exists()  # viewing does not create it
    assert not at.error


def test_a_postgres_server_that_does_not_answer_is_said_plainly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_DATABASE_URL",
                       f"postgresql://deja:hunter2@127.0.0.1:{free_port()}/deja")
    at = app(monkeypatch, tmp_path)
    [error] = texts(at.error)
    assert "cannot be reached" in error and "start the Postgres server" in error, error
    assert "hunter2" not in error
    assert any("`deja serve`" in m for m in texts(at.markdown))


def test_other_pages_never_import_the_engine(tmp_path: Path) -> None:
    """The engine (dbos) is slow to import: the cassette pages, and the Submitted runs page
    with no database yet, do without it."""
    (tmp_path / "cassettes").mkdir()
    probe = f'''
import sys
from streamlit.testing.v1 import AppTest
at = AppTest.from_file({str(APP)!r}, default_timeout=30).run()
assert not at.exception and at.title[0].value == "Runs", at.exception
loaded = [m for m in ("dbos", "deja.runs.engine") if m in sys.modules]
at.query_params["page"] = "submitted"
at.run()
assert not at.exception and at.title[0].value == "Submitted runs", at.exception
print(loaded, [m for m in ("dbos", "deja.runs.engine") if m in sys.modules])
'''
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, env={**os.environ,
                                           "DEJA_VIEW_DIR": str(tmp_path / "cassettes")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[] []", done.stdout


def test_a_queued_run_is_cancelled_from_the_page(
        runs: Runs, project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = runs.submit({"command": [sys.executable, "ask_agent.py"], "cwd": str(project),
                       "labels": {"team": "billing"}})["run_id"]  # no worker is up
    at = app(monkeypatch, tmp_path)
    queued = row(at, "active_runs", run)
    assert queued["status"] == "queued" and queued["labels"] == "team=billing"
    assert any(str(config.database_url()) in c for c in texts(at.caption))
    at.button(key=f"cancel_btn:{run}").click().run()  # asks once more; nothing yet
    assert runs.get(run)["status"] == "queued" and not texts(ok(at).success)
    at.button(key=f"cancel_keep:{run}").click().run()  # kept
    assert runs.get(run)["status"] == "queued"
    assert [b for b in at.button if b.key == f"cancel_btn:{run}"]
    at.button(key=f"cancel_btn:{run}").click().run()
    at.button(key=f"cancel_yes:{run}").click().run()
    assert runs.get(run)["status"] == "cancelled"
    assert f"Run {run} is cancelled (it was queued)." in texts(ok(at).success)
    assert row(at, "ended_runs", run)["status"] == "cancelled"
    assert not [b for b in at.button if b.key == f"cancel_btn:{run}"]
    assert "No run is queued, working or waiting." in texts(at.caption)


def test_a_schedule_shows_its_next_occurrence_and_alerts(
        runs: Runs, project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs.add_schedule("weekly-report", "0 6 * * 1", "Europe/Paris", "07:00", None,
                      {"command": [sys.executable, "report_agent.py"], "cwd": str(project)})
    runs.add_schedule("minutely", "* * * * *", "UTC", "30s", None,
                      {"command": [sys.executable, "report_agent.py"], "cwd": str(project)})
    # Three minutes on, with no run at all: the minutely schedule's occurrences are absent.
    alerts = schedules.check(runs.store, now=datetime.now(UTC) + timedelta(minutes=3))
    assert alerts and {a["schedule"] for a in alerts} == {"minutely"}
    at = app(monkeypatch, tmp_path)
    frame = table(at, "schedules").set_index("name")
    weekly = frame.loc["weekly-report"]
    expected = schedules.next_occurrence(runs.store.schedule("weekly-report"))
    assert weekly["next"] == expected.isoformat() and weekly["next"].endswith(
        ("+01:00", "+02:00"))  # in the schedule's zone
    assert datetime.fromisoformat(weekly["next"]).weekday() == 0  # a Monday, 06:00
    assert (weekly["cron"], weekly["tz"], weekly["deadline"]) == ("0 6 * * 1", "Europe/Paris",
                                                                  "07:00")
    assert weekly["command"].endswith("report_agent.py")
    assert pd.isna(weekly["latest alert"]) and pd.isna(weekly["last verified artefact"])
    latest = frame.loc["minutely"]["latest alert"]
    assert latest.startswith("absence at ") and "the run never started" in latest
    assert f"Alerts of minutely ({min(len(alerts), 5)})" in [e.label for e in at.expander]


def test_a_waiting_run_is_answered_from_the_page_and_completes(
        runs: Runs, project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "worker.log"
    with worker(log):
        run = runs.submit({"command": [sys.executable, "ask_agent.py"], "cwd": str(project),
                           "labels": {"team": "billing"}})["run_id"]
        wait_status(runs, run, "input_required", log)
        at = app(monkeypatch, tmp_path)
        waiting = row(at, "active_runs", run)
        assert waiting["status"] == "input_required" and waiting["worker"] == "w1"
        assert waiting["step"] == f"waiting for an answer: {QUESTION}"
        assert waiting["turn"] == "0/200" and waiting["spend"] == 0.0
        assert f"**Run `{run}` asks:** {QUESTION}" in texts(at.markdown)
        at.button(key=f"answer_btn:{run}").click().run()  # nothing typed yet
        assert f"Type an answer for run {run} first." in texts(ok(at).error)
        at.text_input(key=f"answer_text:{run}").input("yes\x00, once")  # the API's 400
        at.button(key=f"answer_btn:{run}").click().run()
        assert any("an answer cannot hold a NUL character" in t for t in texts(ok(at).error))
        assert runs.get(run)["status"] == "input_required"
        at.text_input(key=f"answer_text:{run}").input("yes, once")
        at.button(key=f"answer_btn:{run}").click().run()
        assert any(s.startswith(f"Answer sent to run {run}") for s in texts(ok(at).success))
        done = wait_status(runs, run, "completed", log)
        assert (project / "answer.txt").read_text().startswith("yes, once at ")
        assert done["worker"] == "w1" and "question" not in done
        at.run()
        assert row(ok(at), "ended_runs", run)["status"] == "completed"
        assert not [t for t in at.text_input if t.key == f"answer_text:{run}"]

        # A scheduled run fired now: its verified artefact shows on its schedule.
        runs.add_schedule("weekly-report", "0 6 * * 1", "UTC", "07:00", None,
                          {"command": [sys.executable, "report_agent.py"],
                           "cwd": str(project)})
        runs.run_now("weekly-report")
        deadline = time.monotonic() + TIMEOUT
        # completed comes from the end line at once; the worker's bookkeeping (the
        # verified artefacts) lands in the row a moment later
        while not (made := runs.list_runs(schedule="weekly-report")) or \
                made[0]["status"] != "completed" or not made[0]["artefacts"]:
            assert time.monotonic() < deadline, (made, log.read_text())
            time.sleep(0.2)
    want = f"report.csv ({made[0]['run_id']})"
    deadline = time.monotonic() + TIMEOUT
    while True:  # the page reads the schedule's row, written by the worker's bookkeeping
        at.run()
        weekly = table(ok(at), "schedules").set_index("name").loc["weekly-report"]
        if weekly["last verified artefact"] == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert weekly["last verified artefact"] == want
    assert made[0]["run_id"].startswith("s_weekly-report_")


# ---------------------------------------------------------------------- a real browser


def test_the_page_in_chromium_answers_a_waiting_run(
        runs: Runs, project: Path, tmp_path: Path) -> None:
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)
    log = tmp_path / "worker.log"
    folder = tmp_path / "cassettes"
    folder.mkdir()
    run = runs.submit({"command": [sys.executable, "ask_agent.py"], "cwd": str(project),
                       "labels": {"team": "billing"}})["run_id"]
    with worker(log), serve_viewer(folder, tmp_path / "view.log") as base:
        wait_status(runs, run, "input_required", log)  # it asked while the viewer started
        with chromium_page() as page:
            open_page(page, base + "/?page=submitted")
            expect(page.get_by_role("heading", name="Submitted runs", exact=True)
                   ).to_be_visible()
            expect(page.get_by_text(QUESTION)).to_be_visible()
            expect(grid(page)).to_contain_text("input_required")
            expect(grid(page)).to_contain_text(run)
            expect(grid(page)).to_contain_text("team=billing")
            page.get_by_label("Answer", exact=True).fill("yes, once")
            picture = shot(page, tmp_path / "submitted-runs.png", full_page=True)
            button(page, "Answer").click()  # its message is brief: the page refreshes
            wait_status(runs, run, "completed", log)
            assert (project / "answer.txt").read_text().startswith("yes, once at ")
            # The page refreshes itself: the run moves to the ended ones.
            expect(page.get_by_text("No run is queued, working or waiting.")).to_be_visible()
            expect(grid(page)).to_contain_text("completed")
            shot(page, tmp_path / "submitted-runs-answered.png", full_page=True)
    data = picture.read_bytes()
    width, height = struct.unpack(">II", data[16:24])
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert width == 1400 and height >= 400, (width, height)
