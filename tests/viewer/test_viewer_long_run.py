"""A long run's page: its first screen of steps comes from the index alone and is drawn
before the rest, so the first paint costs what a short run's does; the whole timeline
follows in the same grid, which scrolls to the last step; the step picker takes a number.

The runs are written line by line with the cassette writer (signed, as a recording is):
recording a hundred thousand steps through an SDK would take minutes. The page is driven
with streamlit's AppTest, and in headless Chromium (``deja view`` served for real).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect
from streamlit.testing.v1 import AppTest
from test_viewer_browser import chromium_missing, chromium_page, grid, open_page, serve_viewer

from recorder.canonical import digest
from recorder.cassette import CassetteWriter, load
from recorder.cassette.keys import load_keyring, require_signing_key
from recorder.launch import new_run_id
from viewer import queries
from viewer.index import RunIndex
from viewer.safe import unescape

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "viewer" / "app.py"
START = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def tool_line(i: int, t: float, **extra: Any) -> dict[str, Any]:
    args = {"i": i}
    return {"kind": "tool", "name": "lookup", "args": args,
            "fp": digest(["tool", "lookup", args]), "t": round(t, 3), "ms": 1.0,
            "result": f"row {i}", **extra}


def write_run(path: Path, lines: list[dict[str, Any]]) -> str:
    """A signed cassette of ``lines`` (tool and control lines); its run id."""
    run = new_run_id()
    header = {"run": run, "parent": None, "created": "2026-01-01T00:00:00.000Z",
              "argv": ["python", "agent.py"], "cwd": ".", "entry": None, "labels": {},
              "fsync": "exit"}
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = CassetteWriter(path, header, require_signing_key(load_keyring(create=False)),
                            "exit")
    for line in lines:
        writer.append(line)
    writer.close({"status": "completed", "totals": {}})
    return run


def long_run(path: Path, steps: int) -> str:
    """``steps`` tool steps, 2 ms apart."""
    return write_run(path, [tool_line(i, START + i * 0.002) for i in range(steps)])


def test_a_runs_first_steps_have_the_start_times_of_its_whole_timeline(
        tmp_path: Path) -> None:
    """The first screen is read from the index alone, and each of its start times is the
    one the whole timeline gives the step: a part of the run (after a fork's edit, a
    resume) is drawn from its earliest start, which a tool step written after the steps
    made in its body has before them, beyond the first screen."""
    lines = [tool_line(0, START), tool_line(1, START + 0.5),
             {"kind": "control", "event": "fork_edit", "t": START + 3600, "detail": {"at": 1}},
             tool_line(3, START + 3600.2), tool_line(4, START + 3600.4),
             tool_line(5, START + 3600.1),  # its body holds steps 3 and 4: it began first
             {"kind": "control", "event": "resumed", "t": START + 7200, "detail": {}},
             tool_line(7, START + 7200.3), tool_line(8, START + 7200.2)]
    run = write_run(tmp_path / "runs" / "parts.jsonl", lines)
    with RunIndex(tmp_path / "runs") as index:
        assert index.refresh()["errors"] == 0
        whole = queries.timeline(index, run)
        assert len(whole["seq"]) == len(lines)
        assert whole["start_ms"][3] != 0.0  # the part after the edit begins at step 5's start
        for first in range(1, len(lines) + 2):
            head = queries.timeline(index, run, first=first)
            assert head == {c: values[:first] for c, values in whole.items()}, first


def page(folder: Path, monkeypatch: pytest.MonkeyPatch, **params: str) -> AppTest:
    monkeypatch.setenv("DEJA_VIEW_DIR", str(folder))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update(params)
    return ran(at)


def ran(at: AppTest) -> AppTest:
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def rows(at: AppTest) -> list[int]:
    [timeline] = [d.value for d in at.dataframe if "mark" in d.value.columns]
    return list(timeline["seq"])


def test_a_long_run_sends_its_first_screen_then_the_whole_timeline_in_one_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from viewer.timeline import Timeline
    from viewer.widgets import FILLED

    folder = tmp_path / "runs"
    run = long_run(folder / "long.jsonl", 1200)
    # What the page has sent before its last step, the fill: the first screen alone.
    fill = Timeline.fill
    monkeypatch.setattr(Timeline, "fill", lambda self: None)
    first = page(folder, monkeypatch, run=run)
    assert rows(first) == list(range(60))
    assert "The first 60 of 1,200 steps; the rest follow." in [
        unescape(str(c.value)) for c in first.caption]
    assert FILLED not in first.session_state
    monkeypatch.setattr(Timeline, "fill", fill)
    # The same run of the page ends with the whole timeline in the first screen's place.
    at = page(folder, monkeypatch, run=run)
    assert rows(at) == list(range(1200))
    assert not [c for c in at.caption if "the rest follow" in str(c.value)]
    assert at.session_state[FILLED] == str(folder / "long.jsonl")
    assert not at.selectbox  # no list of 1,200 labels: the picker takes a number
    [picker] = at.number_input
    assert unescape(str(picker.label)) == "Open step (0 to 1,199)"
    picker = at.number_input[0].set_value(1199)
    ran(picker.run())  # the whole timeline stays, without a first screen again
    assert at.query_params["step"] == "1199"
    assert any(unescape(str(h.value)) == "Step 1199: tool lookup" for h in at.subheader)
    assert rows(at) == list(range(1200))

    opened = page(folder, monkeypatch, run=run, step="7")  # a link to a step of a long run
    assert opened.number_input[0].value == 7
    assert any(unescape(str(h.value)) == "Step 7: tool lookup" for h in opened.subheader)


def test_a_short_run_is_drawn_whole_with_every_step_listed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "runs"
    run = long_run(folder / "short.jsonl", 1000)
    at = page(folder, monkeypatch, run=run)
    assert rows(at) == list(range(1000))
    assert not at.number_input
    assert len(at.selectbox(key="step_select").options) == 1001  # "—" and every step


STEPS = 100_000


def test_a_100k_step_run_opens_and_scrolls_to_its_last_step_in_chromium(
        tmp_path: Path) -> None:
    """A hundred thousand steps in a real browser: the first screen is in the page before
    the whole timeline (the grid's accessible table says how many rows it has), then the
    grid holds every step and scrolls to the last one."""
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)
    folder = tmp_path / "runs"
    run = long_run(folder / "huge.jsonl", STEPS)
    assert len(load(folder / "huge.jsonl").observations) == STEPS
    with serve_viewer(folder, tmp_path / "view.log", timeout=600) as base, \
            chromium_page() as browser:
        # What the page showed of the timeline, in order, from its start: the caption
        # under the first screen, the grid's table of every row.
        browser.add_init_script("""
            window.seen = [];
            const look = () => {
                const said = [...document.querySelectorAll('[data-testid="stCaptionContainer"]')]
                    .some(c => c.textContent.includes('The first 60 of 100,000 steps'));
                const all = document.querySelector('table[aria-rowcount="100001"]') !== null;
                const now = all ? 'whole' : said ? 'first screen' : null;
                if (now && window.seen.at(-1) !== now) window.seen.push(now);
            };
            new MutationObserver(look).observe(document, {subtree: true, childList: true,
                                                          attributes: true});""")
        open_page(browser, f"{base}/?run={run}")
        table = grid(browser)
        browser.locator(f'table[aria-rowcount="{STEPS + 1}"]').wait_for(state="attached",
                                                                        timeout=120_000)
        assert browser.evaluate("window.seen") == ["first screen", "whole"]
        expect(browser.get_by_text("the rest follow")).to_have_count(0)
        canvas = browser.get_by_test_id("stDataFrame").first.get_by_test_id(
            "data-grid-canvas")
        box = canvas.bounding_box()
        assert box is not None
        browser.mouse.click(box["x"] + 20, box["y"] + 36 + 17)  # a cell of the first row
        browser.keyboard.press("Control+End")  # the grid scrolls to its last row
        last = table.locator("tr").filter(has_text=re.compile(r"^\D*99,?999\D")).filter(
            has_text="lookup")
        last.first.wait_for(state="attached", timeout=60_000)
