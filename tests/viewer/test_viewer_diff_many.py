"""The viewer's diff of many runs and a run's fork tree, across folders.

The corpus: in ``incidents/``, the four runs of tests/replayer/test_diff_many.py (A, the
base; B, the same; C, with one inserted tool step; D, with a changed search result), all
recorded with the real anthropic SDK against the stub server. In ``fixes/``, runs made from
A: a fork with an edited search result (and a fork of that fork), a replay-then-live of a
program that calls one tool more (it goes live at that step) and one of the unchanged
program (it never leaves A). The pages are driven with Streamlit's AppTest and, for the
4-run diff and the tree, in headless Chromium (``deja view`` served for real): the
screenshots are left under the test's tmp_path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import test_viewer_browser as browser
from conftest import MODEL, _collect_clients
from playwright.sync_api import expect
from streamlit.testing.v1 import AppTest
from test_viewer_queries import _load_module

import replayer
from recorder.cassette import load
from recorder.testing.server import StubServer
from viewer import queries, tree
from viewer.index import RunIndex
from viewer.safe import unescape

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "viewer" / "app.py"


many = _load_module(ROOT / "tests" / "replayer" / "test_diff_many.py",
                    "deja_test_viewer_many_runs")  # its four runs and their agent


@dataclass(frozen=True)
class Family:
    incidents: Path  # a, b, c, d
    fixes: Path  # a-fix, a-fix2 (forked from a-fix), a-live, a-same
    ids: dict[str, str]  # file stem -> run id

    def path(self, stem: str) -> Path:
        folder = self.incidents if len(stem) == 1 else self.fixes
        return folder / f"{stem}.jsonl"


def build_family(root: Path) -> Family:
    """Record the corpus under ``root``; the caller has set the signing key and key home."""
    incidents, fixes = root / "incidents", root / "fixes"
    incidents.mkdir(parents=True)
    fixes.mkdir()
    many.record_runs(incidents)
    with StubServer(many.SCRIPT) as server:
        with replayer.fork(incidents / "a.jsonl", at=1, out=fixes / "a-fix.jsonl",
                           replace={"result": ["auth/fixed.py"]}):
            many.agent(server.url)
        with replayer.fork(fixes / "a-fix.jsonl", at=1, out=fixes / "a-fix2.jsonl",
                           replace={"result": ["auth/other.py"]}):
            many.agent(server.url)
        with replayer.replay(incidents / "a.jsonl", on_divergence="live",
                             out=fixes / "a-live.jsonl"):
            many.agent(server.url, audit_first=True)  # goes live at its audit, step 2
        with replayer.replay(incidents / "a.jsonl", on_divergence="live",
                             out=fixes / "a-same.jsonl"):
            many.agent(server.url)  # asks what A asked: never leaves it
    _collect_clients()
    ids = {p.stem: load(p).run for folder in (incidents, fixes) for p in folder.glob("*.jsonl")}
    return Family(incidents, fixes, ids)


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]
           ) -> Iterator[Family]:
    with pytest.MonkeyPatch.context() as mp:
        for name in ("DEJA_HOME", "DEJA_KEY"):
            mp.setenv(name, module_env[name])
        yield build_family(tmp_path_factory.mktemp("family"))


@pytest.fixture
def opened() -> Iterator[Any]:
    """``open_index(folder)`` as a page has it: each folder's index, refreshed; all closed
    when the test ends."""
    indexes: list[RunIndex] = []

    def open_index(folder: Path) -> RunIndex:
        index = RunIndex(folder)
        index.refresh()
        indexes.append(index)
        return index

    yield open_index
    for index in indexes:
        index.close()


def diff_params(family: Family, *stems: str) -> dict[str, str]:
    params = {}
    for tag, stem in zip("abcdefgh", stems, strict=False):
        params.update({tag: family.ids[stem], f"{tag}_file": f"{stem}.jsonl"})
    return params


def app(monkeypatch: pytest.MonkeyPatch, folder: Path, **params: str) -> AppTest:
    monkeypatch.setenv("DEJA_VIEW_DIR", str(folder))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update(params)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def texts(elements: Any) -> list[str]:
    return [unescape(str(e.value)) for e in elements]


# ---------------------------------------------------------------------- queries


def test_the_diff_of_four_runs_aligns_the_rest_after_an_inserted_step(
        family: Family, opened: Any) -> None:
    index = opened(family.incidents)
    view = queries.diff(index, *(family.ids[s] for s in "abcd"))
    assert view.tags == list("abcd") and [r["steps"] for r in view.runs] == [5, 5, 6, 5]
    assert view.same_prefix == 2
    seqs = [[row[f"seq_{t}"] for t in "abcd"] for row in view.rows]
    assert seqs == [[0] * 4, [1] * 4, [None, None, 2, None], [2, 2, 3, 2], [3, 3, 4, 3],
                    [4, 4, 5, 4], [5, 5, 6, 5]]
    inserted, after = view.rows[2], view.rows[3]
    assert inserted["first"] and inserted["first_c"] and not inserted["first_d"]
    assert (inserted["kind_c"], inserted["name_c"]) == ("tool", "audit")
    assert after["same"] and not after["first"]
    assert view.rows[4]["first_d"] and list(view.changed[4]) == ["d"]
    assert view.changed[4]["d"].changes[0].path == "/result/0"
    assert "first divergence at row 2" in view.text  # the text of `deja diff` of 4 runs
    two = queries.diff(index, family.ids["a"], family.ids["c"])  # aligned the same way
    assert [r["seq_b"] for r in two.rows] == [0, 1, 2, 3, 4, 5, 6]
    assert two.first_divergence == 2 and "only in B: 1 step(s), 2 tool" in two.text


def test_the_fork_tree_follows_the_parent_into_its_folder(family: Family,
                                                          opened: Any) -> None:
    index = opened(family.fixes)
    root = tree.fork_tree(index, "a-fix.jsonl", opened)
    assert root is not None
    drawn = [(node.file, depth, node.how, node.here, node.current)
             for node, depth in tree.walk(root)]
    left = load(family.path("a-live")).header["parent"]["step"]  # the step of A it left at
    assert drawn == [("a.jsonl", 0, "", False, False),
                     ("a-fix.jsonl", 1, "forked at step 1", True, True),
                     ("a-fix2.jsonl", 2, "forked at step 1", True, False),
                     ("a-live.jsonl", 1, f"replay-then-live, left at step {left}", True, False),
                     ("a-same.jsonl", 1, "replay-then-live, never left its parent", True,
                      False)]
    assert root.path == str(family.path("a")) and root.status == "completed"
    # The same tree from any of its runs; a run of another folder is found through it.
    again = tree.fork_tree(index, family.ids["a-same"], opened)
    assert again is not None and [n.file for n, _ in tree.walk(again)] == [
        f for f, *_ in drawn]
    assert tree.locate(index, "a-fix.jsonl", family.ids["a"], "a.jsonl", opened) == \
        family.path("a")
    # ... and only a run of the tree: never a path, never a run of the folder beside it.
    for run, file in ((family.ids["b"], "b.jsonl"), (None, "../incidents/a.jsonl"),
                      (family.ids["a"], str(family.path("a")))):
        assert tree.locate(index, "a-fix.jsonl", run, file, opened) is None
    alone = opened(family.incidents)  # viewed from the incidents, no fork is in reach
    base = tree.fork_tree(alone, "a.jsonl", opened)
    assert base is not None and base.children == [] and base.current


def test_a_parent_that_is_not_found_is_the_root_by_its_id(family: Family, opened: Any,
                                                          tmp_path: Path) -> None:
    gone, moved = tmp_path / "gone", tmp_path / "moved"
    gone.mkdir()
    moved.mkdir()
    (gone / "a.jsonl").write_bytes(family.path("a").read_bytes())
    with StubServer(many.SCRIPT) as server, \
            replayer.fork(gone / "a.jsonl", at=1, out=moved / "a-fix.jsonl",
                          replace={"result": ["auth/fixed.py"]}):
        many.agent(server.url)
    _collect_clients()
    (gone / "a.jsonl").unlink()  # the parent is deleted: the fork still names it
    root = tree.fork_tree(opened(moved), "a-fix.jsonl", opened)
    assert root is not None and root.path is None and root.run == family.ids["a"]
    assert [n.file for n in root.children] == ["a-fix.jsonl"]


# ---------------------------------------------------------------------- pages


def test_the_diff_page_shows_a_column_per_run(family: Family,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    at = app(monkeypatch, family.incidents, **diff_params(family, *"abcd"))
    assert at.title[0].value == "Diff"
    said = texts(at.error)[0]
    assert said.startswith("First divergence from A — B: the same as A · C: row 2: its step 2")
    assert "D: row 4: step 3" in said
    frames = [d for d in at.dataframe if "changed" in d.value.columns]
    table = frames[-1].value  # after the identical prefix, folded
    columns = [c for c in table.columns if c[:4] in ("A · ", "B · ", "C · ", "D · ")]
    assert columns == [f"{s.upper()} · {s}.jsonl" for s in "abcd"]
    helps = {name: json.loads(frames[-1].proto.columns)[name].get("help") for name in columns}
    assert list(helps.values()) == [family.ids[s] for s in "abcd"]  # each run's id
    cells = table[columns].values.tolist()
    model = f"model {MODEL}"
    assert cells[0] == ["—", "—", "▶ 2 tool audit", "—"]
    assert cells[1] == [f"2 {model}", f"2 {model}", f"3 {model}", f"2 {model}"]
    assert cells[2] == ["3 tool find", "3 tool find", "4 tool find", "▶ 3 tool find"]
    assert list(table["changed"])[:3] == ["C added", "", "D /result/0, /result/1"]
    labels = [e.label for e in at.expander]
    assert "Steps 0-1: identical (2 steps)" in labels
    assert any(label.startswith("▶ first divergence · Step 2: A has no such step · B has "
                                "no such step · C seq 2 tool") for label in labels)
    # Take D out; add it back from the folder's runs.
    at.button(key="remove_D").click().run()
    assert dict(at.query_params) == diff_params(family, *"abc")
    at.selectbox(key="diff_add").select("d.jsonl").run()
    at.button(key="diff_add_btn").click().run()
    assert dict(at.query_params) == diff_params(family, *"abcd")
    two = app(monkeypatch, family.incidents, **diff_params(family, "a", "b"))
    assert "Same: every step means the same in both runs." in texts(two.success)


def test_a_runs_page_draws_its_fork_tree_with_a_link_to_each_run(
        family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    at = app(monkeypatch, family.fixes, run=family.ids["a-fix"], file="a-fix.jsonl")
    [panel] = [e for e in at.expander if e.label == "Fork tree (5 runs)"]
    assert panel.proto.expanded
    markdown = texts(at.markdown)
    assert f"● **{family.ids['a-fix']}** · a-fix.jsonl (this run)" in markdown
    captions = texts(at.caption)
    assert f"completed · in {family.incidents}" in captions  # the root, in its folder
    left = load(family.path("a-live")).header["parent"]["step"]
    for how in ("forked at step 1 · completed", f"replay-then-live, left at step {left} · "
                "completed", "replay-then-live, never left its parent · completed"):
        assert how in captions, captions
    root = at.button(key=f"tree:{family.path('a')}")
    assert unescape(root.label) == f"{family.ids['a']} · a.jsonl"
    root.click().run()  # a run of another folder: named through this one's file
    assert dict(at.query_params) == {"run": family.ids["a"], "file": "a.jsonl",
                                         "via": "a-fix.jsonl"}
    assert not at.exception and unescape(at.title[0].value) == f"Run {family.ids['a']}"
    assert any(str(family.path("a")) in c for c in texts(at.caption))
    assert f"● **{family.ids['a']}** · a.jsonl (this run)" in texts(at.markdown)
    at.button(key="tree_diff").click().run()  # the whole family, compared with its root
    assert at.query_params["a_via"] == "a-fix.jsonl" and at.query_params["e"]
    assert not at.exception and at.title[0].value == "Diff"
    assert any(e.startswith("First divergence from A") for e in texts(at.error))
    lost = app(monkeypatch, family.fixes, run=family.ids["b"], file="b.jsonl",
               via="a-fix.jsonl")  # a run beside the tree is not opened through it
    assert any("No run" in e for e in texts(lost.error))


# ---------------------------------------------------------------------- in a browser


def row_cells(table: Any, text: str) -> list[str]:
    """The cells of the grid's row holding ``text``, as the browser has them."""
    row = table.locator("tr").filter(has_text=text)
    assert row.count() == 1, f"{row.count()} rows with {text!r}"
    return [c.strip() for c in row.locator("td").all_inner_texts()]


def test_four_runs_and_the_tree_in_chromium(family: Family, tmp_path: Path) -> None:
    missing = browser.chromium_missing()
    if missing:
        pytest.fail(missing)
    query = "&".join(f"{k}={v}" for k, v in diff_params(family, *"abcd").items())
    model = f"model {MODEL}"
    with browser.serve_viewer(family.incidents, tmp_path / "view.log") as base, \
            browser.chromium_page({"width": 1400, "height": 1100}) as page:
        browser.open_page(page, f"{base}/?{query}")
        expect(page.get_by_role("heading", name="Diff", exact=True)).to_be_visible()
        expect(page.get_by_text(re.compile("^First divergence from A"))).to_be_visible()
        table = browser.grid(page, 1)  # the aligned rows after the folded identical prefix
        expect(table).to_contain_text("▶ 2 tool audit")
        # A row of the page is a row of the table: each run's step in one <tr>.
        assert row_cells(table, "▶ 2 tool audit")[1:5] == ["—", "—", "▶ 2 tool audit", "—"]
        assert row_cells(table, f"3 {model}")[1:5] == [f"2 {model}", f"2 {model}",
                                                       f"3 {model}", f"2 {model}"]
        assert row_cells(table, "▶ 3 tool find")[1:5] == ["3 tool find", "3 tool find",
                                                          "4 tool find", "▶ 3 tool find"]
        headers = table.locator("th").all_inner_texts()
        assert [h.split(" · ")[0] for h in headers[1:5]] == list("ABCD"), headers
        browser.shot(page, tmp_path / "diff-four-runs.png", full_page=True)
    with browser.serve_viewer(family.fixes, tmp_path / "view-fixes.log") as base, \
            browser.chromium_page({"width": 1400, "height": 1000}) as page:
        browser.open_page(page, f"{base}/?run={family.ids['a-fix']}&file=a-fix.jsonl")
        expect(page.get_by_text("Fork tree (5 runs)")).to_be_visible()
        expect(page.get_by_text(re.compile(r"^replay-then-live, left at step \d+ · completed$"))
               ).to_be_visible()
        browser.shot(page, tmp_path / "fork-tree.png")
        page.get_by_role("button", name=f"{family.ids['a']} · a.jsonl").click()
        expect(page.get_by_role("heading", name=f"Run {family.ids['a']}")).to_be_visible()
        assert "via=a-fix.jsonl" in page.url
        expect(page.get_by_text(f"{family.ids['a']} · a.jsonl (this run)")).to_be_visible()
