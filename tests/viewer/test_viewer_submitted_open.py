"""A submitted run opened from Submitted runs: its id opens its page (``?submitted=R``), whose
cassette is the one the runs database names, outside the folder the viewer shows.

The runs are real (a ``deja worker`` subprocess runs them, or ``deja record`` writes the
cassette a queued run's record names). AppTest drives the page: what it shows, a fork of
it written to the viewed folder and its diff against its parent, a queued or waiting
run's status from the database, and the rules that keep it safe: only a cassette the
database names opens from outside the folder, never a path from the URL, and it is
verified before it is shown. Headless Chromium clicks a run's id on Submitted runs, then
cancels the live run with ``deja cancel``: its header ends ``cancelled``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

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
from test_viewer_runs import ASK_AGENT, REPORT_AGENT, TIMEOUT, ok, texts, wait_status, worker

from deja.runs import config, engine
from deja.runs.service import Runs
from deja.runs.store import Store
from recorder.cassette import load
from viewer import submitted, submitted_page
from viewer.safe import unescape

APP = Path(__file__).resolve().parents[2] / "viewer" / "app.py"
# A live run that waits after its first tool step until the test lets it go on: a cancel
# asked meanwhile is read at its next boundary.
SLOW_AGENT = '''
import pathlib, sys, time
import recorder

@recorder.tool
def step(n: int) -> int:
    return n

step(0)
pathlib.Path(sys.argv[1]).write_text("ready")
go, deadline = pathlib.Path(sys.argv[2]), time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
try:
    step(1)
except recorder.RunStopped as stop:
    print(f"stopped: {stop}")
    raise SystemExit(3)
'''


@pytest.fixture(autouse=True, scope="module")
def _release_connections() -> Iterator[None]:
    yield
    submitted_page.connection.clear()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    for name, text in (("report_agent.py", REPORT_AGENT), ("ask_agent.py", ASK_AGENT),
                       ("slow_agent.py", SLOW_AGENT)):
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def runs(deja_home: Path) -> Iterator[Runs]:
    url = config.database_url()
    service = Runs(Store(url), engine.Client(url))
    yield service
    submitted.close(service)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The folder the viewer shows: not where submitted runs record."""
    viewed = tmp_path / "viewed"
    viewed.mkdir()
    return viewed


def page(monkeypatch: pytest.MonkeyPatch, folder: Path, **params: str) -> AppTest:
    monkeypatch.setenv("DEJA_VIEW_DIR", str(folder))
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params.update(params)
    return ok(at.run())


def status(at: AppTest) -> str:
    return next(unescape(str(m.value)) for m in at.metric if m.label == "Status")


def submit(runs: Runs, project: Path, agent: str, *args: str) -> str:
    return str(runs.submit({"command": [sys.executable, agent, *args],
                            "cwd": str(project)})["run_id"])


def record_queued(runs: Runs, project: Path) -> tuple[str, Path]:
    """A queued run (no worker is up) whose cassette ``deja record`` wrote where its record
    says: the runs database names a cassette that exists."""
    run = submit(runs, project, "report_agent.py")
    cassette = Path(runs.get(run)["cassette"])
    done = subprocess.run([sys.executable, "-m", "deja", "record", "-o", str(cassette),
                           "--run-id", run, "--", sys.executable, "report_agent.py"],
                          cwd=project, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return run, cassette


# ---------------------------------------------------------------------- AppTest


def test_a_submitted_run_opens_by_its_id_and_forks_into_the_viewed_folder(
        runs: Runs, project: Path, folder: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "worker.log"
    with worker(log):
        run = submit(runs, project, "report_agent.py")
        wait_status(runs, run, "completed", log)
    cassette = config.cassette_dir() / f"{run}.jsonl"
    assert cassette.is_file() and folder not in cassette.parents
    at = page(monkeypatch, folder, submitted=run)
    assert texts(at.title) == [f"Run {run}"] and status(at) == "completed"
    assert any(f"`{cassette}`" in c for c in texts(at.caption))
    assert not at.error  # verified: nothing says otherwise
    at.button(key="back").click().run()
    assert ok(at).query_params == {"page": "submitted"}

    # Fork its clock reading: the fork is written to the viewed folder, where it opens.
    at = page(monkeypatch, folder, submitted=run, step="0")
    assert f"The fork is written to `{folder}`, the folder this viewer shows." in \
        texts(at.caption)
    at.text_area[0].input(json.dumps({"value": 42.0})).run()
    assert "The edit is valid." in texts(ok(at).success)
    ok(at.button(key="fork_btn").click().run())
    deadline = time.monotonic() + 90
    while not any("finished" in s for s in texts(at.success)):
        assert time.monotonic() < deadline, texts(at.info) + texts(at.error) + texts(at.code)
        time.sleep(0.3)
        ok(at.run())
    [fork_file] = folder.glob(f"{run}-fork0-*.jsonl")
    fork = load(fork_file)
    assert fork.header["parent"]["run"] == run and fork.end["status"] == "completed"
    at.button(key=f"diff_fork:{fork_file}").click().run()
    assert ok(at).query_params == {"a_submitted": run, "b": fork.run, "b_file": fork_file.name}
    assert texts(at.title) == ["Diff"] and "First divergence: step 0" in texts(at.error)
    at.button(key="open_A").click().run()
    assert ok(at).query_params == {"submitted": run}
    assert texts(at.title) == [f"Run {run}"]
    at = page(monkeypatch, folder, run=fork.run, file=fork_file.name)
    assert any(f"Forked from run **{run}** at step 0 (not in this directory)." in i
               for i in texts(at.info))


def test_outside_the_folder_only_a_cassette_the_runs_database_names_opens(
        runs: Runs, project: Path, folder: Path, deja_home: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    run, cassette = record_queued(runs, project)
    shown = page(monkeypatch, folder, submitted=run)
    assert texts(shown.title) == [f"Run {run}"] and status(shown) == "completed"
    # A path, or a run the database does not hold, opens nothing.
    for given in (str(cassette), cassette.name, f"../{cassette.name}", "r_nope"):
        refused = page(monkeypatch, folder, submitted=given)
        assert not refused.title and not refused.metric, given
        assert any("no run" in e and "in the runs database" in e
                   for e in texts(refused.error)), (given, texts(refused.error))
    # Nor does a path given as a run of the folder, or as a side of a diff.
    refused = page(monkeypatch, folder, run=str(cassette))
    assert texts(refused.error) == [f"No run '{cassette}' in `{folder}`."]
    refused = page(monkeypatch, folder, a=str(cassette), b=str(cassette))
    assert any(e.startswith("Cannot compare") and "no run" in e for e in texts(refused.error))
    # The cassette the database names is read as any other: a line edited after it was
    # signed, and it is refused, not shown.
    lines = cassette.read_text().splitlines(keepends=True)
    lines[1] = lines[1].replace('"time"', '"tune"')
    cassette.write_text("".join(lines))
    tampered = page(monkeypatch, folder, submitted=run)
    assert any(e.startswith("This cassette cannot be read: SignatureError")
               for e in texts(tampered.error)), texts(tampered.error)
    assert not tampered.metric


def test_without_a_runs_database_a_run_id_opens_nothing_and_creates_nothing(
        folder: Path, deja_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(monkeypatch, folder, submitted="r_0123")
    assert any("does not exist yet" in e for e in texts(at.error))
    assert not (deja_home / "runs.sqlite").exists() and not at.title


def test_a_queued_or_waiting_run_shows_what_the_database_says_until_it_ends(
        runs: Runs, project: Path, folder: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run with no cassette yet (queued), or with one left open (waiting for an answer):
    its page shows the database's status, and ``cancelled`` once it is cancelled."""
    queued = submit(runs, project, "report_agent.py")  # no worker is up
    at = page(monkeypatch, folder, submitted=queued)
    assert texts(at.title) == [f"Run {queued}"] and status(at) == "queued"
    assert any(i.startswith("No cassette yet") for i in texts(at.info))
    runs.cancel(queued)
    ok(at.run())
    assert status(at) == "cancelled"
    assert "The run ended cancelled with no cassette: nothing of it was recorded." in \
        texts(at.info)

    log = tmp_path / "worker.log"
    with worker(log):
        waiting = submit(runs, project, "ask_agent.py")
        wait_status(runs, waiting, "input_required", log)
    at = page(monkeypatch, folder, submitted=waiting)
    assert status(at) == "input_required"  # its cassette has no end line, nobody writes it
    runs.cancel(waiting)  # as Submitted runs' Cancel does
    ok(at.run())
    assert status(at) == "cancelled"


# ---------------------------------------------------------------------- a real browser


def test_in_chromium_a_run_id_opens_its_page_whose_header_ends_cancelled(
        runs: Runs, project: Path, folder: Path, tmp_path: Path) -> None:
    """Click a working run's id on Submitted runs: its page, live. ``deja cancel`` it: the
    header says ``cancelled`` once it stopped, and the Live panel is gone."""
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)
    ready, go = tmp_path / "ready", tmp_path / "go"
    log = tmp_path / "worker.log"
    with worker(log), serve_viewer(folder, tmp_path / "view.log") as base, \
            chromium_page() as page_:
        run = submit(runs, project, "slow_agent.py", str(ready), str(go))
        deadline = time.monotonic() + TIMEOUT
        while not ready.exists():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        open_page(page_, base + "/?page=submitted")
        expect(grid(page_)).to_contain_text("working")
        shot(page_, tmp_path / "submitted-runs.png")
        # The run's id is a button in the table's first column: click its cell.
        table = page_.get_by_test_id("stDataFrame").first.get_by_test_id("data-grid-canvas")
        box = table.bounding_box()
        assert box is not None
        page_.mouse.click(box["x"] + 60, box["y"] + 36 + 17)  # below the header row
        expect(page_.get_by_role("heading", name=f"Run {run}")).to_be_visible()
        assert page_.url.endswith(f"/?submitted={run}"), page_.url
        expect(page_.get_by_role("code").filter(  # the caption: the file the database names
            has_text=str(config.cassette_dir() / f"{run}.jsonl")).first).to_be_visible()
        header = page_.get_by_test_id("stMetric").filter(has_text="Status")
        expect(header).to_contain_text("running")
        expect(page_.get_by_role("heading", name="● Live")).to_be_visible()
        shot(page_, tmp_path / "submitted-run-live.png")
        done = subprocess.run([sys.executable, "-m", "deja", "cancel", run],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        expect(page_.get_by_text("Cancel requested")).to_be_visible()
        go.write_text("go")  # the agent reaches its next boundary and stops there
        expect(header).to_contain_text("cancelled")
        expect(page_.get_by_role("heading", name="● Live")).to_have_count(0)
        expect(grid(page_)).to_contain_text("⚑ cancelled")
        picture = shot(page_, tmp_path / "submitted-run-cancelled.png")
        wait_status(runs, run, "cancelled", log)
        button(page_, "← Submitted runs").click()
        expect(page_.get_by_text("No run is queued, working or waiting.")).to_be_visible()
        expect(grid(page_)).to_contain_text("cancelled")
    assert load(config.cassette_dir() / f"{run}.jsonl").end["status"] == "cancelled"
    assert picture.stat().st_size > 20_000
