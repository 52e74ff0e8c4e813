"""The viewer's Suites page (``?page=suites``): the summaries ``deja suite`` left in the
viewed folder, and one suite's verdict table whose cells link to its runs.

Two incidents of ``tests/suite_incidents.py`` (one the fix leaves identical, one it makes
complete), judged once for the module by real ``deja suite`` processes: replayed then
live against the stub into ``out`` (whose viewer shows the suite, each row linking the
incident through its new run's fork tree, the new run and their diff), and as a plain
replay (whose summary is beside the incidents). AppTest opens every link the table makes;
a summary written by someone else (markup, wrong types, not JSON, too large, paths
outside the folder) renders as text and opens nothing. Headless Chromium clicks a suite
in the list and a run's link in the table: the run opens.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import pytest
from playwright.sync_api import expect
from streamlit.testing.v1 import AppTest
from suite_incidents import deja, make_incidents, record_project, suite_env
from test_viewer_browser import chromium_missing, chromium_page, grid, open_page, serve_viewer, shot
from test_viewer_diff_many import app
from test_viewer_safety import bait, fetching, page_text, rendered_markdown

from recorder.cassette import load
from replayer import suite_summary
from viewer.safe import unescape
from viewer.suite_page import INCIDENT_WIDTH, RUN_WIDTH

SUITE = "fix-1"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]) -> Path:
    """The incidents and two suites of them: the fix replayed then live into ``out``, and
    the agent as a plain replay."""
    root = record_project(tmp_path_factory.mktemp("suite-page") / "project", module_env)
    make_incidents(root, ("nothing", "refund-all"))
    env = suite_env(module_env)
    fixed = deja("suite", "incidents", "--inline", "--id", SUITE, "--then", "stub",
                 "live.stub.json", "-o", "out", "--", "python", "fixed.py", cwd=root, env=env)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    plain = deja("suite", "incidents", "--inline", "--id", "plain", "--", "python", "agent.py",
                 cwd=root, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    return root


def frame(at: AppTest, column: str) -> Any:
    [found] = [d.value for d in at.dataframe if column in d.value.columns]
    return found


def opened(monkeypatch: pytest.MonkeyPatch, folder: Path, link: str) -> AppTest:
    """The page a table's link opens (its address is its query alone)."""
    assert link.startswith("?")
    return app(monkeypatch, folder, **dict(parse_qsl(link[1:])))


def title(at: AppTest) -> str:
    return unescape(str(at.title[0].value))


def test_a_suites_verdict_table_links_each_incident_its_new_run_and_their_diff(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = project / "out"
    listed = frame(app(monkeypatch, out, page="suites"), "verdicts")
    assert listed[["suite", "mode", "incidents", "verdicts", "exit status", "where"]
                  ].values.tolist() == [[SUITE, "then stub", 2, "1 identical, 1 now completes", 0,
                                         "inline"]]
    at = app(monkeypatch, out, page="suites", suite=SUITE)
    assert title(at) == f"Suite {SUITE}"
    assert [c.value for c in at.code] == ["python fixed.py"]
    table = frame(at, "verdict")
    rows = {r["incident"]: r for r in table.to_dict("records")}
    assert list(rows) == ["00-nothing.jsonl", "01-refund-all.jsonl"]
    fixed = rows["01-refund-all.jsonl"]
    assert [fixed[c] for c in ("verdict", "recorded", "now", "live calls")] == [
        "now completes (changed at step 1, extra_call)", "failed, exit 1", "completed",
        "1 model, 1 tool"]
    assert fixed["cost"].startswith("$0.0000") and fixed["cost"] != "$0.000000"
    assert [rows["00-nothing.jsonl"][c] for c in ("verdict", "live calls", "cost")] == [
        "identical", "0", "$0.000000"]
    incident = load(project / "incidents" / "01-refund-all.jsonl").run
    new = load(out / "01-refund-all.jsonl").run
    # the incident, in another folder: reached through its new run's fork tree
    assert dict(parse_qsl(fixed["run"][1:])) == {
        "run": incident, "file": "01-refund-all.jsonl", "via": "01-refund-all.jsonl"}
    assert title(opened(monkeypatch, out, fixed["run"])) == f"Run {incident}"
    assert title(opened(monkeypatch, out, fixed["new run"])) == f"Run {new}"
    diff = opened(monkeypatch, out, fixed["diff"])
    assert title(diff) == "Diff"
    assert "First divergence: step 1" in [unescape(str(e.value)) for e in diff.error]


def test_a_plain_replays_summary_is_beside_its_incidents(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = project / "incidents"
    at = app(monkeypatch, folder, page="suites", suite="plain")
    assert unescape(str(at.caption[0].value)).startswith("replay · 2 incident(s) of ")
    table = frame(at, "verdict")
    assert table["verdict"].tolist() == ["identical", "identical"]
    assert table["new run"].isna().all() and table["diff"].isna().all()
    for link, name in zip(table["run"], table["incident"], strict=True):
        assert title(opened(monkeypatch, folder, link)) == f"Run {load(folder / name).run}"


def test_a_summary_written_by_someone_else_is_shown_as_text_and_opens_nothing(
        project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copyfile(project / "out" / "00-nothing.jsonl", folder / "00-nothing.jsonl")
    suites = folder / ".deja" / "suites"
    suites.mkdir(parents=True)
    leak = "http://127.0.0.1:9"
    good = load(folder / "00-nothing.jsonl").run
    hostile = {
        "format": suite_summary.FORMAT, "suite": bait("suite", leak), "kind": "suite",
        "mode": bait("mode", leak), "when": bait("when", leak), "folder": bait("folder", leak),
        "where": bait("where", leak), "command": ["python", bait("command", leak), 7],
        "totals": {"exit_status": "<b>0</b>", "seconds": "NaN"},
        "incidents": [
            {"incident": bait("incident", leak), "verdict": "changed", "change": bait("change",
                                                                                     leak),
             "changed_at": "three", "live": "lots", "seconds": [], "error": bait("error", leak),
             "recorded": {"status": bait("recorded", leak), "exit_code": True},
             # a path outside the folder, and a run of the folder under another id
             "cassette": str(project / "incidents" / "00-nothing.jsonl"), "run": "r_nope",
             "new_cassette": "/etc/passwd", "new_run": good},
            "not an entry", None]}
    (suites / "hostile.json").write_text(json.dumps(hostile))
    (suites / "junk.json").write_text("{not json")
    (suites / "other.json").write_text(json.dumps({"format": "something else"}))
    with (suites / "huge.json").open("wb") as f:
        f.truncate(suite_summary.MAX_BYTES + 1)
    (suites / ".hidden.json.tmp").write_text("half a summary")
    listing = app(monkeypatch, folder, page="suites")
    listed = frame(listing, "verdicts").set_index("suite")
    assert sorted(listed.index) == ["hostile", "huge", "junk", "other"]
    assert listed.loc["junk", "error"] == "not a summary: the file is not JSON"
    assert "is over 8 MB" in listed.loc["huge", "error"]
    assert "is not a suite's summary" in listed.loc["other", "error"]
    shown = [listing]
    for suite_id in ("hostile", "junk", "../hostile", ".hidden", "missing"):
        shown.append(app(monkeypatch, folder, page="suites", suite=suite_id))
    at = shown[1]
    [row] = frame(at, "verdict").to_dict("records")
    assert row["incident"] == bait("incident", leak) and row["error"] == bait("error", leak)
    assert row["verdict"] == f"changed at the end ({bait('change', leak)})"
    assert row["run"] is None and row["new run"] is None and row["diff"] is None
    assert row["live calls"] == "0" and row["seconds"] == "0.00"
    text = "\n".join(page_text(page) for page in shown)
    for place in ("mode", "when", "folder", "where", "command"):
        assert bait(place, leak) in text, place
    assert "No suite ../hostile in" in text and "No suite .hidden in" in text
    assert "is not JSON" in text
    for page in shown:
        for source in rendered_markdown(page):
            assert fetching(source) == [], source


def test_in_chromium_a_suites_row_opens_its_run(project: Path, tmp_path: Path) -> None:
    """Click the suite in the list, then a new run's link in its table: a new tab opens
    the run's page."""
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)
    out = project / "out"
    new = load(out / "01-refund-all.jsonl").run
    with serve_viewer(out, tmp_path / "view.log", env=dict(os.environ)) as base, \
            chromium_page() as page:
        open_page(page, base + "/?page=suites")
        expect(page.get_by_role("heading", name="Suites", exact=True)).to_be_visible()
        expect(grid(page)).to_contain_text(SUITE)
        listed = page.get_by_test_id("stDataFrame").first.get_by_test_id("data-grid-canvas")
        box = listed.bounding_box()
        assert box is not None
        page.mouse.click(box["x"] + 40, box["y"] + 36 + 17)  # the suite's id, below the header
        expect(page.get_by_role("heading", name=f"Suite {SUITE}")).to_be_visible()
        assert page.url.endswith(f"/?page=suites&suite={SUITE}"), page.url
        table = grid(page)
        expect(table).to_contain_text("now completes (changed at step 1, extra_call)")
        expect(table).to_contain_text("1 model, 1 tool")
        expect(table).to_contain_text("identical")
        expect(page.locator('[data-testid="stApp"][data-test-script-state="notRunning"]')
               ).to_be_visible()
        picture = shot(page, tmp_path / "suite.png")
        canvas = page.get_by_test_id("stDataFrame").first.get_by_test_id("data-grid-canvas")
        box = canvas.bounding_box()
        assert box is not None
        # the new run's link of the second row: right of the incident and run columns
        where = (box["x"] + INCIDENT_WIDTH + RUN_WIDTH + 40, box["y"] + 36 + 35 + 17)
        page.mouse.move(*where)
        with page.context.expect_page() as opening:
            page.mouse.click(*where)
        run_page = opening.value
        expect(run_page.get_by_role("heading", name=f"Run {new}")).to_be_visible()
        assert "file=01-refund-all.jsonl" in run_page.url and f"run={new}" in run_page.url
        shot(run_page, tmp_path / "suite-run.png")
    assert picture.stat().st_size > 20_000
