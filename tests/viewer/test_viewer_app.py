"""The viewer's page script (viewer/app.py), driven with streamlit.testing.v1.AppTest.

The cassette directory comes from DEJA_VIEW_DIR; pages are chosen by query parameters,
as a browser's URL would. The corpus is recorded by the queries tests' builder; the fork
and the live run are real (a `deja fork` process, a recording in a background thread).
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import pytest
from click.testing import CliRunner
from conftest import MODEL
from streamlit.testing.v1 import AppTest
from test_viewer_queries import (
    AFTER_FORK,
    GOOD,
    GREETING,
    KEY,
    Corpus,
    build_corpus,
    weather,
)

import recorder
from deja.cli import main as cli
from recorder.cassette import load
from recorder.harness.progress import cancel_requested
from recorder.testing.server import StubServer
from viewer.safe import unescape

APP = Path(__file__).resolve().parents[2] / "viewer" / "app.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEJA_KEY", KEY)
        mp.setenv("DEJA_HOME", str(tmp_path_factory.mktemp("app-corpus-home")))
        return build_corpus(tmp_path_factory.mktemp("app-corpus"))


def app(monkeypatch: pytest.MonkeyPatch, folder: Path, **params: str) -> AppTest:
    monkeypatch.setenv("DEJA_VIEW_DIR", str(folder))
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params.update(params)
    return at.run()


def ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    return at


def texts(elements: Any) -> list[str]:
    """The elements' text as it reads (a run's words are escaped in their Markdown)."""
    return [unescape(str(e.value)) for e in elements]


def table(at: AppTest, column: str, nth: int = 0) -> Any:
    """The ``nth`` dataframe on the page that has ``column``."""
    frames = [d.value for d in at.dataframe if column in d.value.columns]
    return frames[nth]


def listed(at: AppTest) -> set[str]:
    return set(table(at, "parent")["name"]) if at.dataframe else set()


def test_runs_page_lists_every_run_and_the_unreadable_one(corpus: Corpus,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    at = ok(app(monkeypatch, corpus.runs))
    assert at.title[0].value == "Runs"
    runs = table(at, "parent")
    readable = ("spiral", "fixed", "budget", "rich", "big", "torn")
    assert set(runs["name"]) == {corpus.ids[s] for s in readable} | {"tampered.jsonl"}
    bad = runs[runs["name"] == "tampered.jsonl"].iloc[0]
    assert bad["status"] == "error" and "SignatureError" in bad["error"]
    assert any("could not be read" in w for w in texts(at.warning))
    assert any("tampered.jsonl" in e and "signature check failed" in e for e in texts(at.error))
    spiral = runs[runs["name"] == corpus.ids["spiral"]].iloc[0]
    assert spiral["status"] == "stopped" and spiral["steps"] > 0
    assert spiral["file"] == "spiral.jsonl" and spiral["labels"] == "case=spiral"
    caption = texts(at.caption)[0]
    assert caption == f"Every run recorded in the folder `{corpus.runs}`, newest first"
    # An empty cell (a run without a parent, an error) reads "—", never "None".
    assert at.dataframe[0].proto.placeholder == "—"


def test_filters_narrow_the_runs(corpus: Corpus, monkeypatch: pytest.MonkeyPatch) -> None:
    at = ok(app(monkeypatch, corpus.runs))
    at.text_input(key="q").input("grüße, 東京").run()
    assert listed(ok(at)) == {corpus.ids["rich"]}
    # The search is bound to the URL (?q=...): a reload, or a shared link, restores it.
    reloaded = ok(app(monkeypatch, corpus.runs, q="東京"))
    assert reloaded.text_input(key="q").value == "東京"
    assert listed(reloaded) == {corpus.ids["rich"]}
    reloaded.button(key="open_run_btn").click().run()  # a run, then back: the same search
    assert ok(reloaded).query_params["run"] == corpus.ids["rich"]
    reloaded.button(key="back").click().run()
    assert ok(reloaded).title[0].value == "Runs" and listed(reloaded) == {corpus.ids["rich"]}
    at.text_input(key="q").input("").run()
    at.multiselect(key="f_status").select("exhausted").run()
    assert listed(ok(at)) == {corpus.ids["budget"]}
    at.multiselect(key="f_status").unselect("exhausted").run()
    at.multiselect(key="f_tool").select("search").run()
    assert listed(ok(at)) == {corpus.ids[s] for s in ("spiral", "fixed", "budget")}
    at.number_input(key="f_min_tokens").set_value(1500).run()
    assert listed(ok(at)) == {corpus.ids["spiral"]}


def test_run_page_shows_totals_timeline_and_charts(corpus: Corpus,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    at = ok(app(monkeypatch, corpus.runs, run=corpus.ids["rich"]))
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Status"] == "completed" and metrics["Steps"] == "3"
    assert metrics["Tokens"] == "352" and metrics["Model calls"] == "2"
    timeline = table(at, "mark")
    assert list(timeline["seq"]) == [0, 1, 2]
    assert list(timeline["kind"]) == ["model", "tool", "model"]
    assert list(timeline["name"]) == ["claude-haiku-4-5", "weather", "claude-haiku-4-5"]
    assert timeline["tokens"].sum() == 352
    assert metrics["Cost"] == f"${timeline['cost'].sum():,.6f}"
    charts = [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]
    assert len(charts) == 3  # tokens so far, cost so far, the waterfall
    assert [c["encoding"]["y"]["field"] for c in charts[:2]] == ["tokens", "cost"]
    assert charts[2]["encoding"]["x"]["field"] == "start_ms"
    assert charts[2]["encoding"]["x2"]["field"] == "drawn_end_ms"
    assert not at.chat_message  # no step opened: no payload loaded
    budget = ok(app(monkeypatch, corpus.runs, run=corpus.ids["budget"]))
    marks = list(table(budget, "mark")["mark"])
    assert "⚑ budget_exhausted" in marks
    # One model call: the usage chart still draws a line, from 0 to the call's end.
    assert len(budget.get("vega_lite_chart")) == 3


def test_opening_a_step_renders_its_conversation(corpus: Corpus,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    at = ok(app(monkeypatch, corpus.runs, run=corpus.ids["rich"], step="0"))
    assert [c.name for c in at.chat_message] == ["system", "user", "assistant"]
    markdown, text = texts(at.markdown), texts(at.text)  # a run's words: text, not markup
    assert GREETING in text and "Let me look that up for you." in text
    assert any("tool call** `weather`" in m for m in markdown)
    assert ":material/psychology: Thinking" in [e.label for e in at.expander]
    assert len(at.get("image")) == 1  # the user's image, as a thumbnail
    assert any("streamed" in c and "stop: tool_use" in c for c in texts(at.caption))
    # Another step, picked in the page: the URL follows, so a reload shows it again.
    at.selectbox(key="step_select").select(2).run()
    assert ok(at).query_params["step"] == "2"
    markdown = texts(at.markdown)
    assert any("tool result" in m for m in markdown)
    assert "東京: sunny, 22°C" in texts(at.code)
    assert "Sunny in 東京 today. Schöne Grüße!" in texts(at.text)
    assert "Earlier messages of the conversation (1)" in [e.label for e in at.expander]
    big = ok(app(monkeypatch, corpus.runs, run=corpus.ids["big"], step="0"))
    assert any("over 100 KB" in w for w in texts(big.warning))
    assert len(big.code[0].value) < 101_000
    big.button(key="show_full").click().run()
    assert not ok(big).warning and len(big.code[0].value) > 150_000


def test_diff_page_highlights_the_first_divergence(corpus: Corpus,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    at = ok(app(monkeypatch, corpus.runs, run=corpus.ids["fixed"]))
    assert any(f"Forked from run **{corpus.ids['spiral']}** at step 1" in i
               for i in texts(at.info))
    at.button(key="diff_parent").click().run()
    assert ok(at).query_params == {"a": corpus.ids["spiral"], "a_file": "spiral.jsonl",
                                   "b": corpus.ids["fixed"], "b_file": "fixed.jsonl"}
    assert at.title[0].value == "Diff"
    assert "First divergence: step 1" in texts(at.error)
    assert "Step 0: identical" in [e.label for e in at.expander]
    rows = table(at, "changed", nth=1)  # after the collapsed identical prefix
    first = rows[rows["first"]]
    assert list(first["step"]) == [1] and "/result" in first.iloc[0]["changed"]
    assert list(rows.columns[:6]) == ["step", "A seq", "A kind", "A name", "A status", "B seq"]
    assert first.iloc[0]["verdict"] == "differs"  # words, not a checkbox
    opened = [e for e in at.expander if e.label.startswith("▶ first divergence")]
    assert opened and opened[0].proto.expanded


def test_fork_button_launches_a_fork_that_completes(corpus: Corpus, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    shutil.copytree(corpus.project, project)
    runs = project / "runs"
    spiral = corpus.ids["spiral"]
    with StubServer(AFTER_FORK) as live:
        at = ok(app(monkeypatch, runs, run=spiral, step="1"))
        assert at.text_area[0].label == "Edited document (JSON)"
        # The live target defaults to where the run went (its model request URL).
        recorded = load(runs / "spiral.jsonl").observations[0]["url"]
        assert recorded.endswith("/v1/messages")
        assert at.text_input(key=f"live_url:{runs / 'spiral.jsonl'}").value == \
            recorded.removesuffix("/v1/messages")
        at.text_area[0].input('{"result": "unterminated').run()
        assert any("not valid JSON" in e for e in texts(ok(at).error))
        assert at.button(key="fork_btn").disabled
        at.text_area[0].input(json.dumps({"result": GOOD})).run()
        assert "The edit is valid." in texts(ok(at).success)
        target = f"live_url:{runs / 'spiral.jsonl'}"
        at.text_input(key=target).input(live.url).run()
        ok(at.button(key="fork_btn").click().run())
        deadline = time.monotonic() + 90
        while not any("finished" in s for s in texts(at.success)):
            assert time.monotonic() < deadline, texts(at.info) + texts(at.error)
            assert not any("exited with status" in e for e in texts(at.error)), texts(at.code)
            time.sleep(0.3)
            ok(at.run())
        assert len(live.requests) == 1
        # The edit and the target outlast the fork: the user can try a variation at once.
        assert at.text_area[0].value == json.dumps({"result": GOOD})
        assert at.text_input(key=target).value == live.url
        assert "The edit is valid." in texts(at.success)
        assert not at.button(key="fork_btn").disabled
    [fork_file] = [p for p in runs.glob("spiral-fork1-*.jsonl")]
    fork = load(fork_file)
    assert fork.header["parent"]["run"] == spiral and fork.end["status"] == "completed"
    runs_page = ok(app(monkeypatch, runs))
    assert fork.run in listed(runs_page)
    at.button(key=f"open_fork:{fork_file}").click().run()
    assert ok(at).query_params == {"run": fork.run, "file": fork_file.name}
    assert any(f"Forked from run **{spiral}** at step 1" in i for i in texts(at.info))
    at.button(key="open_parent").click().run()
    assert ok(at).query_params == {"run": spiral, "file": "spiral.jsonl"}
    assert any(fork.run in unescape(b.label) for b in at.button)  # its new fork is listed


def test_a_failed_fork_says_why_in_one_line_with_the_log_below(
        corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    shutil.copytree(corpus.project, project)
    runs = project / "runs"
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    at = ok(app(monkeypatch, runs, run=corpus.ids["spiral"], step="1"))
    at.text_area[0].input(json.dumps({"result": GOOD})).run()
    at.text_input(key=f"live_url:{runs / 'spiral.jsonl'}").input(dead).run()
    ok(at.button(key="fork_btn").click().run())
    deadline = time.monotonic() + 90
    while not any("failed" in e for e in texts(at.error)):
        assert time.monotonic() < deadline, texts(at.info) + texts(at.success)
        time.sleep(0.3)
        ok(at.run())
    [failed] = [e for e in texts(at.error) if "Fork of step 1" in e]
    assert failed == f"Fork of step 1 failed: connection refused to {dead}"
    [log] = [e for e in at.expander if e.label.startswith("Full log (exit status ")]
    assert "Traceback" in log.code[0].value and "APIConnectionError" in log.code[0].value
    assert at.text_area[0].value == json.dumps({"result": GOOD})  # kept for another try


def test_two_copies_of_one_run_are_told_apart_by_file(
        corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copy(corpus.path("spiral"), runs / "spiral.jsonl")
    shutil.copy(corpus.path("spiral"), runs / "spiral-copy.jsonl")  # the same run id
    spiral = corpus.ids["spiral"]
    at = ok(app(monkeypatch, runs))
    rows = table(at, "parent")
    assert list(rows["name"]) == [spiral, spiral]
    assert sorted(rows["file"]) == ["spiral-copy.jsonl", "spiral.jsonl"]
    at.selectbox(key="open_run").select("spiral-copy.jsonl").run()
    at.button(key="open_run_btn").click().run()
    assert ok(at).query_params == {"run": spiral, "file": "spiral-copy.jsonl"}
    assert any(str(runs / "spiral-copy.jsonl") in c for c in texts(at.caption))
    other = ok(app(monkeypatch, runs, run=spiral, file="spiral.jsonl"))
    assert any(f"`{runs / 'spiral.jsonl'}`" in c for c in texts(other.caption))
    diffed = ok(app(monkeypatch, runs, a=spiral, a_file="spiral.jsonl", b=spiral,
                    b_file="spiral-copy.jsonl"))
    assert "Same: every step means the same in both runs." in texts(diffed.success)


def test_cancel_button_stops_a_live_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "live-runs"
    runs.mkdir()
    first_done, go_on = threading.Event(), threading.Event()
    info: dict[str, Any] = {}

    def agent(base_url: str) -> None:
        try:
            with recorder.record(runs / "live.jsonl") as rec:
                info["run"] = rec.run_id
                with anthropic.Anthropic(api_key="sk-stub", base_url=base_url) as client:
                    client.messages.create(model=MODEL, max_tokens=64,
                                           messages=[{"role": "user", "content": "first"}])
                first_done.set()
                go_on.wait(60)
                weather(city="Paris")  # the cancel flag is read before this call
        except recorder.Cancelled as exc:
            info["stopped"] = exc
        except Exception as exc:  # noqa: BLE001 - reported below, never lost in the thread
            info["error"] = exc
        finally:
            first_done.set()

    with StubServer({"turns": [{"text": "one"}]}) as server:
        thread = threading.Thread(target=agent, args=(server.url,), daemon=True)
        thread.start()
        try:
            assert first_done.wait(30) and "error" not in info, info
            run = info["run"]
            at = ok(app(monkeypatch, runs, run=run, step="0"))
            assert "● Live" in texts(at.subheader)
            assert any("Running:" in i for i in texts(at.info))
            assert [c.name for c in at.chat_message] == ["user", "assistant"]
            assert at.button(key="cancel_btn").disabled  # not before it is confirmed
            at.checkbox(key="cancel_confirm").check().run()
            ok(at.button(key="cancel_btn").click().run())
            assert cancel_requested(run) is not None
            assert any("Cancel requested" in w for w in texts(at.warning))
            # The open step stays open through the refreshes.
            assert at.query_params["step"] == "0" and len(at.chat_message) == 2
        finally:
            go_on.set()
            thread.join(30)
    assert "error" not in info, info
    assert isinstance(info.get("stopped"), recorder.Cancelled)
    assert load(runs / "live.jsonl").end["status"] == "cancelled"
    ok(at.run())
    assert {m.label: m.value for m in at.metric}["Status"] == "cancelled"
    assert "● Live" not in texts(at.subheader)
    assert "⚑ cancelled" in list(table(at, "mark")["mark"])  # its new steps are listed


def _get(port: int, path: str) -> bytes | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    except OSError:
        return None
    finally:
        conn.close()


def test_deja_view_serves_the_app_on_localhost(corpus: Corpus, tmp_path: Path) -> None:
    missing = CliRunner().invoke(cli, ["view", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "no directory" in missing.output
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path / "view.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "deja", "view", str(corpus.runs),
                                "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 40
        while (health := _get(port, "/_stcore/health")) != b"ok":
            assert process.poll() is None, (tmp_path / "view.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "view.log").read_text()
            time.sleep(0.3)
        assert health == b"ok"
    finally:
        process.terminate()  # deja view stops the server with it
        assert process.wait(timeout=20) is not None
        log.close()
    with socket.socket() as again, pytest.raises(OSError):
        again.connect(("127.0.0.1", port))
    assert f"http://127.0.0.1:{port}" in (tmp_path / "view.log").read_text()


def test_an_unverified_run_is_refused_or_marked_not_verified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run signed with a key this machine does not have: an error row by default; with
    unverified runs allowed (`deja view --allow-unverified`), listed and marked on every
    page."""
    folder = tmp_path / "runs"
    with recorder.record(folder / "foreign.jsonl",
                         keyring=recorder.Keyring.of("somebody else's key")) as run:
        recorder.uuid4()
    refused = ok(app(monkeypatch, folder))
    rows = table(refused, "parent")
    assert list(rows["status"]) == ["error"]
    assert "UnverifiedCassette" in rows["error"][0]

    monkeypatch.setenv("DEJA_ALLOW_UNVERIFIED", "1")
    listed_page = ok(app(monkeypatch, folder))
    rows = table(listed_page, "parent")
    assert list(rows["signed"]) == ["NOT VERIFIED"] and list(rows["status"]) == ["completed"]
    assert "1 run(s) NOT VERIFIED: their signatures were not checked, so what they say is " \
        "unchecked." in texts(listed_page.error)  # its column is right of the labels
    page = ok(app(monkeypatch, folder, run=run.run_id))
    errors = texts(page.error)
    assert any(e.startswith("NOT VERIFIED") and "unchecked" in e for e in errors), errors


def test_a_long_runs_charts_are_drawn_on_request(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of more steps than the charts label one by one paints its timeline first; the
    charts come with a toggle, the waterfall then a dense overview by seq."""
    folder = tmp_path / "long"

    @recorder.tool
    def tick(i: int) -> int:
        return i

    with recorder.record(folder / "long.jsonl") as session:
        for i in range(250):
            tick(i)
    at = ok(app(monkeypatch, folder, run=session.run_id))
    assert len(table(at, "mark")) == 250 and not at.get("vega_lite_chart")
    at.toggle(key="charts").set_value(True).run()
    charts = [json.loads(c.proto.spec) for c in ok(at).get("vega_lite_chart")]
    assert charts and charts[-1]["encoding"]["y"]["field"] == "seq"


def test_a_change_shows_what_changed_in_a_long_value_and_says_what_is_missing() -> None:
    from replayer.diff import FieldChange
    from viewer import widgets

    before = "x" * 500 + " the search failed: malformed response " + "y" * 500
    after = "x" * 500 + " the search found auth/session.py " + "y" * 500
    [long] = widgets.changes_table([FieldChange("/result", "replace", before, after)])
    assert "the search failed: malformed response" in long["A"]
    assert "the search found auth/session.py" in long["B"]
    assert long["A"].startswith("…x") and long["A"].endswith("y…")  # cut around the change
    assert len(long["A"]) < 300 and len(long["B"]) < 300
    removed, added = widgets.changes_table([FieldChange("/usage", "remove", {"n": 1}, None),
                                            FieldChange("/note", "add", None, "new")])
    assert (removed["A"], removed["B"]) == ('{"n": 1}', "(removed)")  # not "null"
    assert (added["A"], added["B"]) == ("(not there)", "new")
