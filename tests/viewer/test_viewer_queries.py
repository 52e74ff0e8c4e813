"""The viewer's queries (viewer.queries) on cassettes recorded here, through the real SDK.

The corpus: the retry-spiral agent (stopped by the loop guard), a fork of it with a fixed
search result, a run stopped by its turn budget, a streamed run with thinking, a tool,
a non-ASCII message and an image, a run with a 150 KB tool result and an image result, a
torn file and a tampered one. Nothing is mocked: files, signatures, the DuckDB index and
the `deja fork` process are real.
"""

from __future__ import annotations

import base64
import gc
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import anthropic
import duckdb
import pytest

import recorder
import replayer
from recorder.cassette import load
from recorder.errors import NoSuchRun, NoSuchStep, UsageError
from recorder.harness.progress import Progress, cancel_path
from recorder.testing.server import StubServer
from viewer import queries
from viewer.index import RunIndex, index_path

ROOT = Path(__file__).resolve().parents[2]
SPIRAL = ROOT / "examples" / "retry_spiral.py"
SPIRAL_SCRIPT = json.loads((ROOT / "examples" / "retry_spiral.stub.json").read_text())
KEY = "test-key-0123456789abcdef"  # conftest's key: the corpus verifies in every test
GOOD = json.dumps({"results": [{"path": "auth/session.py",
                                "snippet": "def refresh_token(self): ..."}]})
FOUND = "Found it: auth/session.py defines refresh_token. Refactoring it now."
AFTER_FORK = {"select": "conversation",
              "turns": [{"text": "position 0 must be replayed, not asked"}, {"text": FOUND}]}
HAIKU = "claude-haiku-4-5"
GREETING = "Grüße, 東京! What is the weather like?"
PNG_B64 = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJ"
           "RU5ErkJggg==")
PNG = base64.b64decode(PNG_B64)
RICH_SCRIPT = {"turns": [
    {"thinking": "The user greets in German and asks about Tokyo.",
     "text": "Let me look that up for you.", "tool_use": {"name": "weather",
                                                         "input": {"city": "東京"}},
     "usage": {"input_tokens": 120, "output_tokens": 40}},
    {"text": "Sunny in 東京 today. Schöne Grüße!",
     "usage": {"input_tokens": 180, "output_tokens": 12}}]}
WEATHER_TOOL = {"name": "weather", "description": "Weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
BIG = "x" * 150_000 + " END-OF-LOG"


def _load_module(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


spiral = _load_module(SPIRAL, "deja_test_viewer_spiral")


@recorder.tool
def weather(city: str) -> str:
    return f"{city}: sunny, 22°C"


@recorder.tool
def read_log() -> str:
    return BIG


@recorder.tool
def screenshot() -> bytes:
    return PNG


def rich_agent(base_url: str) -> str:
    """Streams a reply with thinking and a tool call, runs the tool, asks again."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "text", "text": GREETING},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": PNG_B64}}]}]
    ask = {"model": HAIKU, "max_tokens": 512, "system": "You are a travel helper.",
           "tools": [WEATHER_TOOL]}
    with anthropic.Anthropic(api_key="sk-stub", base_url=base_url) as client:
        with client.messages.stream(**ask, messages=messages) as stream:
            reply = stream.get_final_message()
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": weather(**b.input)}
                   for b in reply.content if b.type == "tool_use"]
        messages.append({"role": "user", "content": results})
        final = client.messages.create(**ask, messages=messages)
    return final.content[0].text


@dataclass(frozen=True)
class Corpus:
    project: Path  # holds agent.py (the spiral) and runs/
    runs: Path
    ids: dict[str, str]  # file stem -> run id

    def path(self, stem: str) -> Path:
        return self.runs / f"{stem}.jsonl"


def build_corpus(root: Path) -> Corpus:
    """Record the corpus under ``root``; the caller has set DEJA_KEY and DEJA_HOME."""
    project = root / "project"
    runs = project / "runs"
    runs.mkdir(parents=True)
    (project / "agent.py").write_text(SPIRAL.read_text())
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project)  # as `cd project && deja record -o runs/... -- python agent.py`
        with StubServer(SPIRAL_SCRIPT) as server:
            mp.setenv("ANTHROPIC_BASE_URL", server.url)
            session = recorder.RecordSession("runs/spiral.jsonl", argv=["python", "agent.py"],
                                             labels={"case": "spiral"}).start()
            try:
                spiral.main()  # the loop guard stops it: status "stopped"
            finally:
                session.close()
        with StubServer(AFTER_FORK) as server:
            mp.setenv("ANTHROPIC_BASE_URL", server.url)
            with replayer.fork(runs / "spiral.jsonl", at=1, out=runs / "fixed.jsonl",
                               replace={"result": GOOD}):
                assert spiral.main() == 0
        with StubServer(SPIRAL_SCRIPT) as server:
            mp.setenv("ANTHROPIC_BASE_URL", server.url)
            with recorder.record(runs / "budget.jsonl", budgets={"turns": 1}):
                assert spiral.main() == 3  # BudgetExhausted before the second model call
        with StubServer(RICH_SCRIPT) as server, recorder.record(runs / "rich.jsonl"):
            assert "Schöne Grüße" in rich_agent(server.url)
        with recorder.record(runs / "big.jsonl"):
            read_log()
            screenshot()
        with recorder.record(runs / "torn.jsonl"):
            recorder.value("seed", lambda: 42)
            weather(city="Berlin")
    with warnings.catch_warnings():  # the example agent leaves its SDK clients open:
        warnings.simplefilter("ignore", ResourceWarning)  # let them go quietly, here
        gc.collect()
    torn = runs / "torn.jsonl"
    torn.write_bytes(torn.read_bytes()[:-40])  # the end line cut in the middle
    lines = (runs / "budget.jsonl").read_text().splitlines(keepends=True)
    lines[2] = lines[2].replace("refresh_tok", "refresh_TOK")  # edited after it was signed
    (runs / "tampered.jsonl").write_text("".join(lines))
    ids = {p.stem: json.loads(p.read_text().splitlines()[0])["run"] for p in runs.glob("*.jsonl")}
    return Corpus(project, runs, ids)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEJA_KEY", KEY)
        mp.setenv("DEJA_HOME", str(tmp_path_factory.mktemp("corpus-home")))
        return build_corpus(tmp_path_factory.mktemp("viewer-corpus"))


@pytest.fixture
def index(corpus: Corpus) -> Iterator[RunIndex]:
    with RunIndex(corpus.runs) as idx:
        idx.refresh()
        yield idx


def names(rows: list[dict[str, Any]]) -> set[str]:
    return {r["name"] for r in rows}


def test_every_run_is_listed_and_bad_files_are_error_rows(corpus: Corpus,
                                                          index: RunIndex) -> None:
    rows = {r["name"]: r for r in queries.list_runs(index)}
    ids = corpus.ids
    assert set(rows) == {ids["spiral"], ids["fixed"], ids["budget"], ids["rich"], ids["big"],
                         ids["torn"], "tampered.jsonl"}
    assert set(queries.RUN_COLUMNS) <= set(rows[ids["rich"]])
    tampered = rows["tampered.jsonl"]
    assert tampered["status"] == "error" and "SignatureError" in tampered["error"]
    assert "seq 1" in tampered["error"]
    torn = rows[ids["torn"]]
    assert torn["status"] == "torn" and "torn last line" in torn["error"]
    assert rows[ids["spiral"]]["status"] == "stopped"
    assert rows[ids["budget"]]["status"] == "exhausted"
    assert rows[ids["fixed"]]["parent"] == ids["spiral"]
    assert rows[ids["rich"]]["tokens"] == 120 + 40 + 180 + 12
    # Newest first: the corpus was recorded in file order spiral, fixed, budget, rich, ...
    order = [r["name"] for r in queries.list_runs(index) if r["status"] != "error"]
    assert order.index(ids["rich"]) < order.index(ids["budget"]) < order.index(ids["spiral"])
    assert len(queries.list_runs(index, limit=2)) == 2


def test_each_filter_narrows_the_list(corpus: Corpus, index: RunIndex) -> None:
    ids = corpus.ids
    assert names(queries.list_runs(index, status="exhausted")) == {ids["budget"]}
    assert names(queries.list_runs(index, status=["completed"])) == {ids["fixed"], ids["rich"],
                                                                     ids["big"]}
    assert names(queries.list_runs(index, status="error")) == {"tampered.jsonl"}
    assert names(queries.list_runs(index, model=HAIKU)) == {ids["rich"]}
    assert names(queries.list_runs(index, model="claude-sonnet-4-6")) == {
        ids["spiral"], ids["fixed"], ids["budget"]}
    assert names(queries.list_runs(index, tool="weather")) == {ids["rich"], ids["torn"]}
    assert names(queries.list_runs(index, tool=["read_log", "screenshot"])) == {ids["big"]}
    assert names(queries.list_runs(index, tool="search")) == {ids["spiral"], ids["fixed"],
                                                              ids["budget"]}
    # Tokens: the budget run made one model call (412 + 38), the rich one two (352 in all);
    # big and torn made none.
    assert names(queries.list_runs(index, min_tokens=400, max_tokens=500)) == {ids["budget"]}
    assert names(queries.list_runs(index, min_tokens=1, max_tokens=450)) == {ids["budget"],
                                                                            ids["rich"]}
    assert names(queries.list_runs(index, max_tokens=0)) == {ids["big"], ids["torn"]}
    assert names(queries.list_runs(index, min_tokens=1500)) == {ids["spiral"]}
    rich_cost = queries.run_header(index, ids["rich"])["cost"]
    assert 0 < rich_cost < queries.run_header(index, ids["budget"])["cost"]
    assert names(queries.list_runs(index, min_cost=0.000001, max_cost=rich_cost)) == {
        ids["rich"]}
    # Dates: everything was started today (UTC); a bare date covers its whole day.
    today = datetime.now(UTC).date()
    readable = names(queries.list_runs(index)) - {"tampered.jsonl"}
    assert names(queries.list_runs(index, since=today, until=today)) == readable
    assert queries.list_runs(index, since=today + timedelta(days=1)) == []
    assert queries.list_runs(index, until=date.fromisoformat("2001-01-01")) == []
    rich_started = queries.run_header(index, ids["rich"])["started"]
    later = names(queries.list_runs(index, since=rich_started))
    assert ids["rich"] in later and ids["spiral"] not in later and ids["budget"] not in later
    assert ids["spiral"] in names(queries.list_runs(index, until=rich_started))
    # Filters combine.
    assert names(queries.list_runs(index, tool="search", status="completed")) == {ids["fixed"]}


def test_text_search_finds_message_and_tool_content(corpus: Corpus, index: RunIndex) -> None:
    ids = corpus.ids

    def found(text: str) -> set[str]:
        return names(queries.list_runs(index, text=text))

    assert found("GRÜßE, 東京") == {ids["rich"]}  # case-insensitive, non-ASCII
    assert found("東京") == {ids["rich"]}
    assert found("schöne") == {ids["rich"]}  # the final reply
    assert found("look that up for") == {ids["rich"]}  # streamed: split across SSE events
    assert found("greets in german") == {ids["rich"]}  # thinking
    assert found("sunny, 22°C") == {ids["rich"], ids["torn"]}  # a tool result
    assert found("refresh_token(self)") == {ids["fixed"]}  # the fork's edited result
    assert found("END-OF-LOG") == {ids["big"]}  # 150 KB into a tool result
    assert found("TURNS_budget") == {ids["budget"]}  # a control line
    assert found("100%_no_such_words") == set()
    assert found("anthropic-version") == set()  # headers are not content


def test_header_totals_are_the_sums_of_the_step_rows(corpus: Corpus, index: RunIndex) -> None:
    for stem in ("spiral", "fixed", "budget", "rich", "big", "torn"):
        header = queries.run_header(index, corpus.ids[stem])
        steps = queries.run_steps(index, corpus.ids[stem])
        assert header is not None and steps
        assert header["steps"] == len(steps)
        assert header["tokens"] == sum(s["tokens"] or 0 for s in steps)
        assert header["input_tokens"] == sum(s["input_tokens"] or 0 for s in steps)
        assert header["cost"] == pytest.approx(sum(s["cost"] or 0 for s in steps))
        assert header["model_calls"] == sum(s["kind"] == "model" for s in steps)
        assert header["tool_calls"] == sum(s["kind"] == "tool" for s in steps)
        assert [s["seq"] for s in steps] == list(range(len(steps)))
        listed = next(r for r in queries.list_runs(index) if r["name"] == corpus.ids[stem])
        assert (listed["tokens"] or 0, listed["steps"]) == (header["tokens"], header["steps"])
    by_file = queries.run_header(index, "rich.jsonl")
    assert by_file is not None and by_file["run"] == corpus.ids["rich"]
    assert by_file["models"] == [HAIKU] and by_file["verified"]
    assert queries.run_header(index, "r_nope") is None
    assert queries.run_steps(index, "r_nope") == []


def test_timeline_marks_control_lines_and_edits(corpus: Corpus, index: RunIndex) -> None:
    budget = queries.run_steps(index, corpus.ids["budget"])
    control = [s for s in budget if s["kind"] == "control"]
    assert len(control) == 1 and control[0]["mark"] == "⚑ budget_exhausted"
    spiral_steps = queries.run_steps(index, corpus.ids["spiral"])
    assert any(s["mark"] == "⚑ loop_detected" for s in spiral_steps)
    fixed = queries.run_steps(index, corpus.ids["fixed"])
    assert fixed[1]["edited"] and "✎ edited" in fixed[1]["mark"]
    assert fixed[2]["mark"] == "⚑ fork_edit"
    assert not fixed[0]["edited"] and fixed[0]["mark"] == ""
    first = fixed[0]
    assert (first["kind"], first["name"], first["status"]) == ("model", "claude-sonnet-4-6",
                                                                "200")
    assert first["tokens"] == 450 and first["latency_ms"] > 0 and first["cost"] > 0


def test_step_detail_renders_a_streamed_conversation(corpus: Corpus) -> None:
    path = corpus.path("rich")
    detail = queries.step_detail(path, 0)
    assert (detail.kind, detail.name, detail.status) == ("model", HAIKU, "200")
    conv = detail.conversation
    assert conv is not None and not detail.truncated and detail.editable
    assert conv["system"] == [{"type": "text", "text": "You are a travel helper."}]
    [user] = conv["turns"]
    assert user["role"] == "user" and user["new"]
    text, image = user["blocks"]
    assert text == {"type": "text", "text": GREETING}
    assert image["type"] == "image" and image["data"] == PNG
    assert image["media_type"] == "image/png" and image["size"] == len(PNG)
    response = conv["response"]
    assert response["streamed"] and response["stop_reason"] == "tool_use"
    kinds = [b["type"] for b in response["blocks"]]
    assert kinds == ["thinking", "text", "tool_use"]
    assert response["blocks"][0]["text"] == "The user greets in German and asks about Tokyo."
    assert response["blocks"][1]["text"] == "Let me look that up for you."
    assert response["blocks"][2]["name"] == "weather"
    assert response["blocks"][2]["input"] == {"city": "東京"}
    # The full request is there; base64 never is, in any view of the step.
    assert detail.request["model"] == HAIKU and detail.request["stream"] is True
    for view in (detail.request, detail.observation, detail.response, conv):
        assert PNG_B64 not in json.dumps(view, ensure_ascii=False, default=str)
    assert "event: message_start" in detail.response["body"]

    second = queries.step_detail(path, 2)
    conv = second.conversation
    assert [m["new"] for m in conv["turns"]] == [False, True, True]
    assistant = conv["turns"][1]["blocks"]
    assert [b["type"] for b in assistant] == ["thinking", "text", "tool_use"]
    [result] = conv["turns"][2]["blocks"]
    assert result["type"] == "tool_result" and not result["is_error"]
    assert result["blocks"] == [{"type": "text", "text": "東京: sunny, 22°C"}]
    assert result["tool_use_id"] == assistant[2]["id"]
    assert not conv["response"]["streamed"]
    assert conv["response"]["blocks"] == [{"type": "text",
                                           "text": "Sunny in 東京 today. Schöne Grüße!"}]

    tool = queries.step_detail(path, 1)
    assert tool.tool == {"name": "weather", "args": {"city": "東京"},
                         "result": "東京: sunny, 22°C", "images": []}
    assert tool.editable and tool.conversation is None


def test_step_detail_truncates_large_payloads_and_shows_image_bytes(corpus: Corpus) -> None:
    path = corpus.path("big")
    cut = queries.step_detail(path, 0)
    assert cut.truncated
    assert len(cut.tool["result"]) < 100_200 and "more characters not shown" in cut.tool["result"]
    assert len(json.dumps(cut.observation)) < 101_000
    whole = queries.step_detail(path, 0, full=True)
    assert not whole.truncated and whole.tool["result"] == BIG
    shot = queries.step_detail(path, 1)
    assert not shot.truncated
    [image] = shot.tool["images"]
    assert image["data"] == PNG and image["media_type"] == "image/png"
    assert shot.tool["result"] == f"<{len(PNG)} bytes, image/png>"
    assert PNG_B64 not in json.dumps(shot.observation)
    control = queries.step_detail(corpus.path("budget"), 2)
    assert control.kind == "control" and control.control["event"] == "budget_exhausted"
    assert not control.editable
    with pytest.raises(NoSuchStep, match="no step 99"):
        queries.step_detail(path, 99)


def test_diff_names_the_first_divergence(corpus: Corpus, index: RunIndex) -> None:
    ids = corpus.ids
    view = queries.diff(index, ids["spiral"], ids["fixed"])
    assert view.first_divergence == 1 and view.result.same_prefix == 1
    assert view.rows[0]["same"] and not view.rows[0]["first"]
    first = view.rows[1]
    assert first["first"] and not first["same"]
    assert (first["kind_a"], first["kind_b"], first["seq_b"]) == ("tool", "tool", 1)
    assert "/result" in first["changed"]
    change = next(c for c in view.changes[1] if c.path == "/result")
    assert change.b == GOOD
    assert "first divergence: step 1" in view.text
    assert (view.a["run"], view.b["run"]) == (ids["spiral"], ids["fixed"])
    by_path = queries.diff(None, corpus.path("spiral"), corpus.path("fixed"))
    assert by_path.first_divergence == 1 and len(by_path.rows) == len(view.rows)
    assert queries.diff(index, ids["rich"], "rich.jsonl").result.same
    with pytest.raises(NoSuchRun, match="no run"):
        queries.diff(index, ids["rich"], "r_nope")


def test_lineage_finds_parent_and_children(corpus: Corpus, index: RunIndex) -> None:
    ids = corpus.ids
    fixed = queries.lineage(index, ids["fixed"])
    assert fixed["parent"]["run"] == ids["spiral"] and fixed["parent"]["step"] == 1
    assert fixed["parent"]["indexed"] and fixed["parent"]["path"] == str(corpus.path("spiral"))
    assert fixed["children"] == []
    parent = queries.lineage(index, ids["spiral"])
    assert parent["parent"] is None
    assert [(c["run"], c["step"]) for c in parent["children"]] == [(ids["fixed"], 1)]
    assert queries.lineage(index, "tampered.jsonl")["children"] == []


def test_live_status_and_cancel(deja_home: Path) -> None:
    assert queries.live("r_unknown")["record"] is None
    progress = Progress("r_live_1", {"turn_limit": 5})
    now = queries.live("r_live_1")
    assert now["running"] and now["alive"] and not now["ended"] and now["cancel"] is None
    flag = queries.cancel("r_live_1", reason="test")
    assert flag == cancel_path("r_live_1") and flag.exists()
    assert queries.live("r_live_1")["cancel"]["reason"] == "test"
    progress.update(status="cancelled", ended=True, force=True)
    ended = queries.live("r_live_1")
    assert ended["ended"] and not ended["running"]
    with pytest.raises(UsageError, match="already ended"):
        queries.cancel("r_live_1")
    with pytest.raises(NoSuchRun, match="no run"):
        queries.cancel("r_missing")
    # A record left "running" by a process that is gone: not running, and said so.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    Progress("r_crashed", {}).update(pid=int(dead.stdout), force=True)
    crashed = queries.live("r_crashed")
    assert crashed["alive"] is False and not crashed["running"] and not crashed["ended"]


def test_validate_edit_reports_problems_and_writes_nothing(corpus: Corpus,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    path = corpus.path("spiral")
    doc = queries.fork_document(path, 1)
    assert doc == {"result": load(path).observations[1]["result"]}
    before = sorted(p.name for p in corpus.runs.iterdir())
    assert queries.validate_edit(path, 1, json.dumps({"result": GOOD})) is None
    assert queries.validate_edit(path, 1, queries.document_text(doc)) is None  # unchanged
    patch = [{"op": "replace", "path": "/result", "value": GOOD}]
    assert queries.validate_edit(path, 1, json.dumps(patch)) is None
    bad_json = queries.validate_edit(path, 1, '{"result": "unterminated')
    assert bad_json and "not valid JSON" in bad_json
    bad_patch = queries.validate_edit(path, 1, json.dumps(
        [{"op": "replace", "path": "/results/0", "value": 1}]))
    assert bad_patch and "patch does not apply to step 1" in bad_patch and "/result" in bad_patch
    wrong_shape = queries.validate_edit(path, 1, json.dumps({"value": 1}))
    assert wrong_shape and 'a tool edit must leave {"result": ...}' in wrong_shape
    out_of_range = queries.validate_edit(path, 99, json.dumps({"result": 1}))
    assert out_of_range and "out of range" in out_of_range
    not_editable = queries.validate_edit(corpus.path("budget"), 2, "{}")
    assert not_editable and "editable kinds" in not_editable
    monkeypatch.setenv("DEJA_KEY", "another-key-entirely")  # the parent's key is gone
    missing = queries.validate_edit(path, 1, json.dumps({"result": GOOD}))
    assert missing and missing.startswith("UnverifiedCassette")
    assert "not one of this machine's keys" in missing
    assert sorted(p.name for p in corpus.runs.iterdir()) == before


def test_launch_fork_creates_a_fork_that_names_its_parent(corpus: Corpus, tmp_path: Path
                                                          ) -> None:
    project = tmp_path / "project"
    shutil.copytree(corpus.project, project)
    parent = project / "runs" / "spiral.jsonl"
    with StubServer(AFTER_FORK) as live:
        launched = queries.launch_fork(parent, 1, json.dumps({"result": GOOD}),
                                       live_url=live.url)
        assert launched.process.wait(timeout=90) == 0, launched.log.read_text()
        assert len(live.requests) == 1  # only the turn after the fork went live
    assert launched.path.parent == parent.parent and launched.path.exists()
    fork = load(launched.path, keyring=recorder.load_keyring(), require_signature=True)
    assert fork.header["parent"]["run"] == corpus.ids["spiral"]
    assert fork.header["parent"]["step"] == 1
    assert fork.end is not None and fork.end["status"] == "completed"
    assert fork.observations[1]["result"] == GOOD and fork.observations[1]["edited"]
    state = queries.fork_state(launched)
    assert not state["running"] and state["returncode"] == 0 and state["run"] == fork.run
    assert "forked run" in state["log"]
    assert not launched.log.parent.exists()  # its edit and log: removed once it ended
    assert queries.fork_state(launched)["log"] == state["log"]  # and the log still shown
    with RunIndex(project / "runs") as idx:
        idx.refresh()
        children = queries.lineage(idx, corpus.ids["spiral"])["children"]
        assert [c["run"] for c in children] == [corpus.ids["fixed"], fork.run]
    assert os.environ.get("ANTHROPIC_BASE_URL") != live.url  # set for the child only


def test_an_index_of_the_older_layout_is_rebuilt(corpus: Corpus, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copy(corpus.path("rich"), runs / "rich.jsonl")
    index_path(runs).parent.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(index_path(runs)))  # schema 1: steps without text
    con.execute("CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR);"
                "INSERT INTO meta VALUES ('schema', '1');"
                "CREATE TABLE files (path VARCHAR PRIMARY KEY, size BIGINT, mtime_ns BIGINT,"
                " run VARCHAR);"
                "CREATE TABLE steps (run VARCHAR, path VARCHAR, seq INTEGER, payload VARCHAR);")
    con.close()
    with RunIndex(runs) as idx:
        assert idx.refresh()["indexed"] == 1
        assert names(queries.list_runs(idx, text="東京")) == {corpus.ids["rich"]}
        assert "text" not in idx.steps(corpus.ids["rich"])[0]


def test_the_queries_never_import_streamlit() -> None:
    code = ("import json, sys\nimport viewer.queries\n"
            "print(json.dumps('streamlit' in {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True)
    assert json.loads(out.stdout) is False


def test_the_index_lives_under_deja_home_not_in_the_cassette_folder(
        corpus: Corpus, tmp_path: Path, deja_home: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copy(corpus.path("rich"), runs / "rich.jsonl")
    (runs / ".index.duckdb").write_bytes(b"an index an older deja left here")
    (runs / ".index.duckdb.wal").write_bytes(b"and its WAL")
    with RunIndex(runs) as idx:
        assert idx.refresh()["indexed"] == 1
        assert idx.db_path == index_path(runs)
    db = index_path(runs)
    assert db.parent == deja_home / "index"
    assert db.name.startswith("runs-") and db.suffix == ".duckdb"
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    assert sorted(p.name for p in runs.iterdir()) == ["rich.jsonl"]  # nothing else, ever
    # Another folder of the same name, or the same folder by another path, is told apart.
    other = tmp_path / "elsewhere" / "runs"
    assert index_path(other) != db and index_path(other).name.startswith("runs-")
    assert index_path(tmp_path / "." / "runs") == db
    # Incremental: a second refresh reads nothing again.
    with RunIndex(runs) as idx:
        assert idx.refresh() == {"indexed": 0, "unchanged": 1, "removed": 0, "errors": 0,
                                 "compacted": 0}


def test_refresh_reports_its_progress(corpus: Corpus, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    for stem in ("spiral", "rich", "big"):
        shutil.copy(corpus.path(stem), runs / f"{stem}.jsonl")
    calls: list[tuple[int, int]] = []
    with RunIndex(runs) as idx:
        idx.refresh(progress=lambda done, total: calls.append((done, total)))
        assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]
        calls.clear()
        shutil.copy(corpus.path("torn"), runs / "torn.jsonl")
        idx.refresh(progress=lambda done, total: calls.append((done, total)))
        assert calls == [(0, 1), (1, 1)]  # only the new file
        calls.clear()
        idx.refresh(progress=lambda done, total: calls.append((done, total)))
        assert calls == []  # nothing to read: no bar


def test_runs_are_told_apart_by_file_and_show_their_labels(corpus: Corpus,
                                                           tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copy(corpus.path("spiral"), runs / "spiral.jsonl")
    shutil.copy(corpus.path("spiral"), runs / "copy.jsonl")  # a copied file: the same id
    with RunIndex(runs) as idx:
        idx.refresh()
        rows = queries.list_runs(idx)
        assert [r["name"] for r in rows] == [corpus.ids["spiral"]] * 2
        assert sorted(r["file"] for r in rows) == ["copy.jsonl", "spiral.jsonl"]
        assert {r["labels"] for r in rows} == {"case=spiral"}
        assert "file" in queries.RUN_COLUMNS and "labels" in queries.RUN_COLUMNS
        assert queries.run_header(idx, "copy.jsonl")["path"] == str(runs / "copy.jsonl")
        assert queries.run_header(idx, "spiral.jsonl")["path"] == str(runs / "spiral.jsonl")
        assert queries.run_header(idx, "copy.jsonl")["labels"] == {"case": "spiral"}
        assert len(queries.run_steps(idx, str(runs / "copy.jsonl"))) == len(
            load(runs / "copy.jsonl").observations)


def test_a_run_without_an_end_line_is_running_crashed_or_incomplete(
        corpus: Corpus, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    live = recorder.start(runs / "live.jsonl")  # holds the writer lock until closed
    try:
        recorder.value("note", lambda: "first")
        cut = runs / "cut.jsonl"  # a copy of the live file: nobody writes it
        cut.write_bytes((runs / "live.jsonl").read_bytes())
        with RunIndex(runs) as idx:
            idx.refresh()
            status = {r["file"]: r["status"] for r in queries.list_runs(idx)}
        assert status == {"live.jsonl": "running", "cut.jsonl": "incomplete"}
        assert queries.writer_state(runs / "live.jsonl", live.run_id) == "running"
    finally:
        live.close()
    assert queries.writer_state(runs / "live.jsonl", live.run_id) is None
    # A status record that says running, left by a process that is gone: crashed.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    Progress("r_gone", {}).update(pid=int(dead.stdout), force=True)
    assert queries.writer_state(runs / "nobody.jsonl", "r_gone") == "crashed"
    Progress("r_here", {})  # this process: alive
    assert queries.writer_state(runs / "nobody.jsonl", "r_here") == "running"


def test_usage_over_time_and_the_waterfall(corpus: Corpus, index: RunIndex) -> None:
    budget = queries.run_steps(index, corpus.ids["budget"])  # one model call
    usage = queries.usage_over_time(budget)
    assert len(usage) == 2 and usage[0] == {"time_s": 0.0, "seq": None, "tokens": 0,
                                            "cost": 0.0}
    [model] = [s for s in budget if s["kind"] == "model"]
    assert usage[1]["tokens"] == model["tokens"] == 450
    assert usage[1]["cost"] == pytest.approx(model["cost"]) and usage[1]["cost"] > 0
    assert usage[1]["time_s"] == pytest.approx((model["start_ms"] + model["latency_ms"]) / 1000)
    rich = queries.run_steps(index, corpus.ids["rich"])
    assert rich[0]["start_ms"] == 0.0
    starts = [s["start_ms"] for s in rich]
    assert starts == sorted(starts)
    bars = queries.waterfall(rich)
    assert [b["step"] for b in bars] == ["0 · model · claude-haiku-4-5", "1 · tool · weather",
                                         "2 · model · claude-haiku-4-5"]
    assert all(b["end_ms"] == pytest.approx(b["start_ms"] + b["duration_ms"]) for b in bars)
    assert bars[1]["start_ms"] >= bars[0]["end_ms"] - 1  # the tool ran after the call
    cumulative = queries.usage_over_time(rich)
    assert [p["tokens"] for p in cumulative] == [0, 160, 352]
    assert queries.usage_over_time(queries.run_steps(index, corpus.ids["torn"])) == []


def test_the_live_target_defaults_to_where_the_run_went(corpus: Corpus) -> None:
    url = load(corpus.path("spiral")).observations[0]["url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1/messages")
    assert queries.recorded_base_url(corpus.path("spiral")) == url.removesuffix("/v1/messages")
    assert queries.recorded_base_url(corpus.path("big")) is None  # no model call


def test_a_fork_or_a_resume_is_drawn_from_its_own_start_not_across_the_gap() -> None:
    """A fork's prefix was recorded hours before its live part: each part is drawn from
    where the one before it ended, the boundary being the fork_edit (or resumed) line."""
    starts = [1000.0, 1000.5, 1000.9, 9000.0, 9000.1, None]
    kinds = ["model", "tool", "model", "control", "model", "control"]
    names = ["m", "search", "m", "fork_edit", "m", "loop_detected"]
    latencies = [100.0, 2.0, 300.0, None, 50.0, None]
    drawn = queries._part_times(starts, kinds, names, latencies)
    assert drawn == [0.0, 500.0, 900.0, 1200.0, 1300.0, None]
    whole = queries._part_times(starts[:3], kinds[:3], names[:3], latencies[:3])
    assert whole == [0.0, 500.0, 900.0]  # a run of one part: as recorded
