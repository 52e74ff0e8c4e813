"""The viewer end to end in a real browser: `deja view` served on localhost, driven in
headless Chromium (Debian's /usr/bin/chromium) with Playwright.

One test walks what a person does: open the viewer, search, open a run, open a tool
step, fork it with an edited tool result against a live stub model, watch the fork
finish (the edit stays, for a variation), open its diff against the parent, and cancel a
live run. Every stage leaves a screenshot under the test's tmp_path; the assertions are
on the page's text, never on pixels. Another runs ``docs/make_screenshots.py``, which
takes the README's pictures of the run, step, diff and fork pages the same way. Nothing is
mocked: `deja record`, `deja view`, `deja fork`, the index and the signatures are real.

The helpers (:func:`serve_viewer`, :func:`sign_in`, :func:`chromium_page`, :func:`shot`) are
used by ``docs/make_screenshots.py`` too.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Locator, Page, expect, sync_playwright
from test_viewer_queries import AFTER_FORK, FOUND, GOOD, SPIRAL, SPIRAL_SCRIPT, build_corpus

from recorder.cassette import load
from recorder.testing.server import StubServer

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ("viewer-run.png", "viewer-step.png", "viewer-diff.png", "viewer-fork.png",
               "viewer-submitted.png")
CHROMIUM = Path("/usr/bin/chromium")
# As root, in a closed network: no sandbox, no GPU, no background connections.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
VIEWPORT = {"width": 1400, "height": 800}
WAIT_MS = 30_000  # one page or widget update; generous, but bounded

# A live run that stops between its first model call and its next tool call until the
# test lets it go on: the cancel is read at that boundary.
LIVE_AGENT = '''
import os, pathlib, time
import anthropic
import recorder

@recorder.tool
def step(n: int) -> int:
    return n

def main() -> int:
    client = anthropic.Anthropic(api_key="sk-stub")
    client.messages.create(model="claude-sonnet-4-6", max_tokens=64,
                           messages=[{"role": "user", "content": "first"}])
    pathlib.Path(os.environ["LIVE_READY"]).write_text("ready")
    go = pathlib.Path(os.environ["LIVE_GO"])
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        step(1)
    except recorder.RunStopped as stop:
        print(f"stopped: {stop}")
        return 3
    return 0

raise SystemExit(main())
'''


# ---------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _health(port: int) -> bytes | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/_stcore/health")
        return conn.getresponse().read()
    except OSError:
        return None
    finally:
        conn.close()


SIGN_IN: dict[str, str] = {}  # a served viewer's base URL -> the address it printed


def printed_address(log: str) -> str:
    """The address with the token that ``deja view`` printed in ``log``."""
    found = re.search(r"at (http://127\.0\.0\.1:\d+/\?token=\S+) ", log)
    assert found, f"deja view printed no address with a token:\n{log}"
    return found.group(1)


def sign_in(page: Page, base: str) -> None:
    """Open the address ``deja view`` printed: the viewer sets its cookie and sends the
    browser on to the same page without the token."""
    response = page.goto(SIGN_IN[base])
    assert response is not None and response.ok and page.url == base + "/", page.url
    assert any(c["name"] == "deja_view" and c["httpOnly"] and c["sameSite"] == "Strict"
               for c in page.context.cookies(base))


@contextmanager
def serve_viewer(folder: Path, log_path: Path, *, timeout: float = 40.0,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> Iterator[str]:
    """``deja view FOLDER`` (run in ``cwd``) on a free port; yields its base URL, stops it
    on exit. :func:`open_page` signs in with the address it printed first."""
    port = free_port()
    environ = dict(os.environ if env is None else env)
    environ.pop("ANTHROPIC_BASE_URL", None)  # the fork's live target is set in the page
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "deja", "view", str(folder),
                                    "--port", str(port)], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=environ, cwd=cwd)
        try:
            deadline = time.monotonic() + timeout
            while _health(port) != b"ok":
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"deja view did not start:\n{log_path.read_text()}")
                time.sleep(0.2)
            base = f"http://127.0.0.1:{port}"
            SIGN_IN[base] = printed_address(log_path.read_text())
            yield base
        finally:
            SIGN_IN.pop(f"http://127.0.0.1:{port}", None)
            process.terminate()  # deja view stops the Streamlit server with it
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def chromium_missing() -> str | None:
    if CHROMIUM.exists():
        return None
    return (f"Chromium is not installed ({CHROMIUM} is missing): run `make test`, which "
            "installs Debian's chromium for the browser test (Playwright never downloads "
            "a browser)")


@contextmanager
def chromium_page(viewport: dict[str, int] | None = None) -> Iterator[Page]:
    """A page of a fresh headless Chromium (a new, empty profile)."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=viewport or VIEWPORT)
            page.set_default_timeout(WAIT_MS)
            expect.set_options(timeout=WAIT_MS)
            yield page
        finally:
            browser.close()


def shot(page: Page, path: Path, **options: Any) -> Path:
    """A screenshot once Streamlit has nothing left to run (its status widget gone)."""
    page.wait_for_load_state("networkidle")
    expect(page.get_by_test_id("stStatusWidget")).to_have_count(0)
    page.screenshot(path=str(path), **options)
    return path


def grid(page: Page, nth: int = 0) -> Locator:
    """The ``nth`` dataframe's cells: a canvas, with its visible cells as a table inside
    (for screen readers), which is what the text assertions read."""
    return page.get_by_test_id("stDataFrame").nth(nth).locator("table")


def button(page: Page, name: str | re.Pattern[str]) -> Locator:
    """A Streamlit button (not a selectbox's "Open" toggle) by its label."""
    return page.get_by_test_id("stButton").get_by_role("button", name=name, exact=True)


def open_page(page: Page, url: str) -> None:
    """Open a viewer's page, signing in first when the browser has no cookie yet."""
    base = next((b for b in SIGN_IN if url.startswith(b + "/")), None)
    if base is not None and all(c["name"] != "deja_view" for c in page.context.cookies(base)):
        sign_in(page, base)
    page.goto(url)
    expect(page.get_by_test_id("stApp")).to_be_visible()


def select_option(page: Page, label: str, option: str) -> None:
    """Pick ``option`` (text it starts with) in the Streamlit selectbox labelled ``label``."""
    box = page.get_by_role("combobox", name=label)
    item = page.get_by_role("option").filter(has_text=re.compile("^" + re.escape(option)))
    for attempt in range(3):  # the list can be redrawn under the pointer: try again
        box.focus()
        box.press("ArrowDown")  # opens the list (a mouse click on the box may not)
        try:
            item.click(timeout=5_000)
            return
        except PlaywrightError:
            if attempt == 2:
                raise
            box.press("Escape")


def record_spiral(project: Path, env: dict[str, str]) -> Path:
    """`deja record` the retry-spiral tool agent against the stub model: a forkable run."""
    (project / "runs").mkdir(parents=True)
    (project / "agent.py").write_text(SPIRAL.read_text())
    with StubServer(SPIRAL_SCRIPT) as model:
        done = subprocess.run([sys.executable, "-m", "deja", "record", "-o",
                               "runs/spiral.jsonl", "--", "python", "agent.py"],
                              cwd=project, env={**env, "ANTHROPIC_BASE_URL": model.url},
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr  # the loop guard stopped it
    return project / "runs" / "spiral.jsonl"


def run_id(path: Path) -> str:
    with path.open("rb") as f:
        return json.loads(f.readline())["run"]


def wait_for(path: Path, what: str, process: subprocess.Popen[Any], log: Path,
             timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what} never came:\n{log.read_text()}")
        time.sleep(0.05)


# ---------------------------------------------------------------------- the test


def test_viewer_in_chromium_fork_diff_and_cancel(tmp_path: Path) -> None:
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    env = dict(os.environ)  # DEJA_HOME and DEJA_KEY of this test (conftest)
    project = tmp_path / "project"
    spiral_path = record_spiral(project, env)
    runs = spiral_path.parent
    spiral = run_id(spiral_path)
    (project / "live_agent.py").write_text(LIVE_AGENT)
    ready, go = tmp_path / "live.ready", tmp_path / "live.go"
    live_log = tmp_path / "live.log"

    with serve_viewer(runs, tmp_path / "view.log", env=env) as base, \
            StubServer(AFTER_FORK) as fork_model, \
            StubServer({"turns": [{"text": "one"}]}) as live_model, \
            chromium_page() as page:
        # 1. The runs page.
        open_page(page, base + "/")
        page.screenshot(path=str(shots / "00-warm-up.png"))  # the first one can be blank
        expect(page.get_by_role("heading", name="Runs", exact=True)).to_be_visible()
        expect(page.get_by_text("1 run(s)")).to_be_visible()
        expect(grid(page)).to_contain_text(spiral)
        expect(grid(page)).to_contain_text("stopped")
        expect(grid(page)).not_to_contain_text("None")  # empty cells are "—"
        expect(page.get_by_text(f"Every run recorded in the folder {runs}, newest first")
               ).to_be_visible()
        # No developer toolbar: no Deploy button (client.toolbarMode = viewer).
        expect(page.get_by_test_id("stAppDeployButton")).to_have_count(0)
        expect(page.get_by_role("button", name="Deploy")).to_have_count(0)
        # The search is kept in the URL: a reload restores it.
        search = page.get_by_label("Search messages and tool content")
        search.fill("session refresh")
        search.press("Enter")
        expect(page.get_by_text("1 run(s)")).to_be_visible()
        page.wait_for_url(re.compile(r"[?&]q=session(\+|%20)refresh"))
        page.reload()
        expect(page.get_by_label("Search messages and tool content")).to_have_value(
            "session refresh")
        expect(grid(page)).to_contain_text(spiral)
        search = page.get_by_label("Search messages and tool content")
        search.fill("no such words anywhere")
        search.press("Enter")
        expect(page.get_by_text("0 run(s)")).to_be_visible()
        search.fill("")
        search.press("Enter")
        expect(page.get_by_text("1 run(s)")).to_be_visible()
        shot(page, shots / "01-runs.png")

        # 2. Open the run: its header and timeline.
        button(page, "Open").click()
        expect(page.get_by_role("heading", name=f"Run {spiral}")).to_be_visible()
        assert f"run={spiral}" in page.url and "file=spiral.jsonl" in page.url
        expect(page.get_by_test_id("stMetric").filter(has_text="Status")).to_contain_text(
            "stopped")
        expect(page.get_by_role("heading", name="Timeline")).to_be_visible()
        timeline = grid(page)
        expect(timeline).to_contain_text("search")
        expect(timeline).to_contain_text("⚑ loop_detected")
        shot(page, shots / "02-run.png")

        # 3. Open the tool step: the call, its recorded (malformed) result, the editor.
        select_option(page, "Open step", "1 · tool · search")
        expect(page.get_by_role("heading", name="Step 1: tool search")).to_be_visible()
        assert "step=1" in page.url
        expect(page.get_by_test_id("stChatMessage").first).to_contain_text("session refresh")
        expect(page.get_by_test_id("stCode").first).to_contain_text("def refresh_tok")
        expect(page.get_by_role("heading", name="Fork at step 1")).to_be_visible()
        expect(page.get_by_text("The document is unchanged")).to_be_visible()
        shot(page, shots / "03-tool-step.png")

        # 4. Fork it: an edited result, a live target, the Fork button; the fork finishes.
        editor = page.get_by_label("Edited document (JSON)")
        editor.fill('{"result": "unterminated')
        editor.press("Control+Enter")
        expect(page.get_by_text("not valid JSON")).to_be_visible()
        expect(button(page, "Fork")).to_be_disabled()
        editor.fill(json.dumps({"result": GOOD}))
        editor.press("Control+Enter")
        expect(page.get_by_text("The edit is valid.")).to_be_visible()
        target = page.get_by_label(re.compile("^Live target"))
        recorded = load(spiral_path).observations[0]["url"].removesuffix("/v1/messages")
        expect(target).to_have_value(recorded)  # where the run went, by default
        target.fill(fork_model.url)
        target.press("Enter")
        expect(target).to_have_value(fork_model.url)
        shot(page, shots / "04-fork-edit.png")
        button(page, "Fork").click()
        finished = page.get_by_text(re.compile(r"Fork of step 1 finished: run r_\w+"))
        expect(finished).to_be_visible(timeout=60_000)
        fork = re.search(r"run (r_\w+)", finished.inner_text()).group(1)
        [fork_path] = runs.glob("spiral-fork1-*.jsonl")
        fork_cassette = load(fork_path)
        assert fork_cassette.run == fork and fork_cassette.end["status"] == "completed"
        assert fork_cassette.header["parent"]["run"] == spiral
        assert len(fork_model.requests) == 1  # only the step after the fork went live
        # The edit and the target stay: the user can try a variation at once.
        expect(editor).to_have_value(json.dumps({"result": GOOD}))
        expect(target).to_have_value(fork_model.url)
        expect(page.get_by_text("The edit is valid.")).to_be_visible()
        expect(button(page, "Fork")).to_be_enabled()
        shot(page, shots / "05-fork-finished.png")

        # 5. The fork's diff against its parent: the first divergent step is shown.
        button(page, "Diff fork against parent").click()
        expect(page.get_by_role("heading", name="Diff", exact=True)).to_be_visible()
        assert f"a={spiral}" in page.url and f"b={fork}" in page.url
        assert "a_file=spiral.jsonl" in page.url and f"b_file={fork_path.name}" in page.url
        expect(page.get_by_text("First divergence: step 1", exact=True)).to_be_visible()
        expect(page.get_by_text("Step 0: identical", exact=True)).to_be_visible()
        expect(page.get_by_text(re.compile(r"▶ first divergence · Step 1: A seq 1 tool"))
               ).to_be_visible()
        expect(page.get_by_test_id("stExpander").filter(has_text="▶ first divergence")
               ).to_contain_text("/result")
        shot(page, shots / "06-diff.png")
        # The fork, opened from the diff, names its parent and ends as the stub said.
        button(page, "Open B").click()
        expect(page.get_by_text(f"Forked from run {spiral} at step 1")).to_be_visible()
        select_option(page, "Open step", "3 · model")
        expect(page.get_by_test_id("stChatMessage").last).to_contain_text(FOUND)

        # 6. A live run: the Live panel, Cancel with its confirmation, the run ends cancelled.
        live_path = runs / "live.jsonl"
        with live_log.open("wb") as log:
            agent = subprocess.Popen(
                [sys.executable, "-m", "deja", "record", "-o", str(live_path), "--",
                 "python", "live_agent.py"], cwd=project, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**env, "ANTHROPIC_BASE_URL": live_model.url, "LIVE_READY": str(ready),
                     "LIVE_GO": str(go)})
        try:
            wait_for(ready, "the live run's first model call", agent, live_log)
            live = run_id(live_path)
            open_page(page, f"{base}/?run={live}")
            expect(page.get_by_role("heading", name="● Live")).to_be_visible()
            expect(page.get_by_text("Running:")).to_be_visible()
            cancel = button(page, "Cancel run")
            expect(cancel).to_be_disabled()  # not before it is confirmed
            shot(page, shots / "07-live.png")
            page.get_by_text("Yes, stop this run at its next boundary").click()
            expect(cancel).to_be_enabled()
            cancel.click()
            expect(page.get_by_text("Cancel requested")).to_be_visible()
            shot(page, shots / "08-cancel-requested.png")
            go.write_text("go")  # the agent reaches its next boundary and stops there
            assert agent.wait(timeout=30) == 3, live_log.read_text()
        finally:
            go.write_text("go")
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        status = page.get_by_test_id("stMetric").filter(has_text="Status")
        expect(status).to_contain_text("cancelled")
        expect(page.get_by_role("heading", name="● Live")).to_have_count(0)
        expect(grid(page)).to_contain_text("⚑ cancelled")
        shot(page, shots / "09-cancelled.png")
    assert load(live_path).end["status"] == "cancelled"
    taken = sorted(shots.glob("[0-9][1-9]-*.png"))  # all but the warm-up
    assert len(taken) == 9 and all(p.stat().st_size > 20_000 for p in taken)  # not blank


def test_the_runs_table_shows_parent_and_labels_at_1400_px(tmp_path: Path) -> None:
    """In a 1400 px wide window every column of the runs table up to the labels is seen
    without scrolling: moving the selection right, cell by cell, scrolls the grid (which
    brings the selected cell into view) only past the labels."""
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)
    corpus = build_corpus(tmp_path / "corpus")
    with serve_viewer(Path("runs"), tmp_path / "view.log", cwd=corpus.project) as base, \
            chromium_page() as page:
        assert page.viewport_size == {"width": 1400, "height": 800}
        open_page(page, base + "/")
        runs = page.get_by_test_id("stDataFrame").first
        expect(runs.locator("table")).to_contain_text(corpus.ids["fixed"])
        headers = runs.locator("th").all_inner_texts()  # the columns drawn, and one more
        columns = ["run", "status", "started (UTC)", "steps", "tokens", "cost", "parent",
                   "labels"]
        assert headers[:8] == columns, headers
        fork = runs.locator("tr").filter(has_text=corpus.ids["fixed"])
        expect(fork).to_contain_text(corpus.ids["spiral"])  # its parent, the whole id
        expect(fork).to_contain_text("case=spiral")
        shot(page, tmp_path / "runs-table.png")
        # the page has finished drawing (the script ran, the grid keeps its size): on a busy
        # machine a grid clicked while it is still laid out scrolls on its own
        expect(page.locator('[data-testid="stApp"][data-test-script-state="notRunning"]')
               ).to_be_visible()
        grid = runs.get_by_test_id("data-grid-canvas")
        canvas, before = grid.bounding_box(), None
        for _ in range(100):  # until two looks 200 ms apart agree
            if canvas == before:
                break
            before = canvas
            page.wait_for_timeout(200)
            canvas = grid.bounding_box()
        assert canvas is not None and canvas["x"] + canvas["width"] <= 1400
        page.mouse.click(canvas["x"] + 20, canvas["y"] + 36 + 17)  # the first run's id
        scroller = runs.locator(".dvn-scroller")
        assert scroller.evaluate("e => e.scrollLeft") == 0
        for column in columns[1:]:
            page.keyboard.press("ArrowRight")
            page.wait_for_timeout(100)
            assert scroller.evaluate("e => e.scrollLeft") == 0, column
        page.keyboard.press("ArrowRight")  # the first column right of the labels: scrolled to
        page.wait_for_function("e => e.scrollLeft > 0", arg=scroller.element_handle())


def test_the_readme_screenshots_are_made_in_chromium(tmp_path: Path) -> None:
    """docs/make_screenshots.py, as `make` would run it: the run, step, diff and fork pages
    and Submitted runs, 1400 px wide, each a real picture (not blank) and small enough for
    the README."""
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)
    out = tmp_path / "docs"
    made = subprocess.run([sys.executable, str(ROOT / "docs" / "make_screenshots.py"),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    for name in SCREENSHOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < len(data) <= 400_000, name
        width, height = struct.unpack(">II", data[16:24])
        assert width == 1400 and height >= 400, (name, width, height)
