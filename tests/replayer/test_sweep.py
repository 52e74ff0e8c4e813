"""deja sweep: fork one recorded run once per perturbed observation and see which
perturbations change how it ends.

The agent reads ten pages through a ``search`` tool, one per model turn, against the stub
model, whose rules answer by what the last tool result says: an error at the fifth
search makes it give up, and the final answer (after the tenth) depends on that search's
result alone. So of the twenty forks of ``tool=search:error,empty`` exactly three change
the final answer. Real ``deja`` processes, the real anthropic SDK and the stub server; the
forks run two at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xmlschema

from recorder.cassette import load
from recorder.errors import ConfigError, EditError, NoSuchStep
from recorder.testing.server import StubServer
from replayer import edit, suite_summary
from replayer.sweep import SweepRule, final_answer, plan_sweep, provider_error

AGENT = """\
import os

import anthropic

import recorder

TOOLS = [{"name": "search", "description": "Read page N.",
          "input_schema": {"type": "object", "properties": {"page": {"type": "integer"}},
                           "required": ["page"]}}]


@recorder.tool
def search(page):
    return f"{os.environ.get('FOUND', 'hit')} {page}: doc{page}.md"


client = anthropic.Anthropic(api_key="sk-stub", max_retries=int(os.environ.get("RETRIES", "2")))
messages = [{"role": "user", "content": "Read all ten pages."}]
while True:
    reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=256, tools=TOOLS,
                                   messages=messages)
    messages.append({"role": "assistant",
                     "content": [b.model_dump(exclude_none=True) for b in reply.content]})
    if reply.stop_reason != "tool_use":
        print("answer:", "".join(b.text for b in reply.content if b.type == "text"))
        break
    results = []
    for block in reply.content:
        if block.type == "tool_use":
            try:
                out, failed = search(**block.input), False
            except Exception as exc:
                out, failed = f"{type(exc).__name__}: {exc}", True
            results.append({"type": "tool_result", "tool_use_id": block.id,
                            "content": str(out), "is_error": failed})
    messages.append({"role": "user", "content": results})
"""

DONE = "Done: all ten pages read."
GAVE_UP = "Gave up: the fifth search failed."
INCOMPLETE = "Incomplete: the last search failed."
NOTHING = "Done, but page 10 had nothing."
# Turn p (p assistant replies so far) searches page p + 1; after ten, the rules answer.
SCRIPT = {
    "select": "conversation",
    "rules": [
        {"when": {"position": 5, "tool_result_is_error": True}, "text": GAVE_UP},
        {"when": {"position": 10, "tool_result_is_error": True}, "text": INCOMPLETE},
        {"when": {"position": 10, "tool_result_contains": "hit 10"}, "text": DONE},
        {"when": {"position": 10}, "text": NOTHING},
    ],
    "turns": [{"text": f"Reading page {k}.",
               "tool_use": {"name": "search", "input": {"page": k}}} for k in range(1, 11)],
}
JUNIT_SCHEMA = Path(__file__).resolve().parents[1] / "cli" / "junit-10.xsd"
# seq 2k - 1 is the k-th search; model steps are the even seqs 0-20
SEARCHES = [2 * k - 1 for k in range(1, 11)]


def deja(*args: str, cwd: Path, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def model() -> Iterator[StubServer]:
    """The stub model, for the recording and every fork's live part."""
    server = StubServer(SCRIPT).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str],
             model: StubServer) -> Path:
    """The ten-search run, recorded once."""
    root = tmp_path_factory.mktemp("recorded")
    (root / "agent.py").write_text(AGENT)
    done = subprocess.run([sys.executable, "-m", "deja", "record", "-o", "run.jsonl", "--",
                           sys.executable, "agent.py"], cwd=root, capture_output=True,
                          text=True, timeout=300,
                          env={**module_env, "ANTHROPIC_BASE_URL": model.url})
    assert done.returncode == 0, done.stderr
    assert f"answer: {DONE}" in done.stdout
    return root


@pytest.fixture
def project(recorded: Path, tmp_path: Path, model: StubServer,
            monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the recorded project, the stub model as its base URL."""
    root = tmp_path / "project"
    root.mkdir()
    for name in ("agent.py", "run.jsonl"):
        (root / name).write_bytes((recorded / name).read_bytes())
    monkeypatch.setenv("ANTHROPIC_BASE_URL", model.url)
    return root


def rows_by(report: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(row["step"], row["kind"]): row for row in report["rows"]}


# ------------------------------------------------------------------- the acceptance


def test_a_sweep_over_ten_tool_calls_reports_which_change_the_final_answer(
        project: Path) -> None:
    parent = load(project / "run.jsonl")
    assert [o["seq"] for o in parent.observations if o["kind"] == "tool"] == SEARCHES
    assert final_answer(parent) == DONE

    done = deja("sweep", "run.jsonl", "--perturb", "tool=search:error,empty", "-j", "2",
                "--json", "--junit", "junit.xml", "-o", "sweep", cwd=project)
    assert done.returncode == 1, done.stderr  # some perturbation changed the outcome
    report = json.loads(done.stdout)
    rows = rows_by(report)
    assert len(report["rows"]) == 20 and set(rows) == {
        (seq, kind) for seq in SEARCHES for kind in ("error", "empty")}
    assert report["recorded"] == {"status": "completed", "answer": DONE}
    changed = {key for key, row in rows.items() if row["changed"]}
    assert changed == {(9, "error"), (19, "error"), (19, "empty")}, changed
    assert rows[(9, "error")]["answer"] == GAVE_UP
    assert rows[(19, "error")]["answer"] == INCOMPLETE
    assert rows[(19, "empty")]["answer"] == NOTHING
    for key, row in rows.items():
        assert row["status"] == "completed" and row["exit_code"] == 0, row
        assert row["answer_changed"] is (key in changed) and not row["status_changed"]
        assert row["error"] is None and row["answer"] in (DONE, GAVE_UP, INCOMPLETE, NOTHING)
    # what ran live: after step 1, ten model calls and nine searches; after step 19, one
    assert rows[(1, "empty")]["live"]["model_calls"] == 10
    assert rows[(1, "empty")]["live"]["tool_calls"] == 9
    assert (rows[(19, "error")]["live"]["model_calls"],
            rows[(19, "error")]["live"]["tool_calls"]) == (1, 0)
    assert rows[(9, "error")]["live"]["model_calls"] == 1  # it gave up at once

    # Each fork: the edited step is what the agent saw, its fork_edit line the patch.
    fork = load(project / rows[(9, "error")]["cassette"])
    assert fork.header["parent"]["run"] == parent.run and fork.header["parent"]["step"] == 9
    step = fork.observations[9]
    assert step["edited"] is True and step["error"]["type"] == "RuntimeError"
    assert step["error"]["message"] == "injected by deja sweep"
    edit_line = fork.observations[10]
    assert edit_line["event"] == "fork_edit" and edit_line["detail"]["step"] == 9
    assert {op["path"] for op in edit_line["detail"]["patch"]} == {"/result", "/error"}
    empty = load(project / rows[(19, "empty")]["cassette"]).observations[19]
    assert empty["edited"] is True and empty["result"] == ""
    assert (project / "sweep" / "s019-search-empty.edit.json").is_file()
    assert "answer: Done, but page 10 had nothing." in (
        project / "sweep" / "s019-search-empty.log").read_text()

    xmlschema.XMLSchema(str(JUNIT_SCHEMA)).validate(str(project / "junit.xml"))
    suite = ET.parse(project / "junit.xml").getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("20", "3", "0")
    failed = [case.get("name") for case in suite.iter("testcase")
              if case.find("failure") is not None]
    assert failed == ["step 9 tool search error", "step 19 tool search error",
                      "step 19 tool search empty"]
    assert "20/20" in done.stderr  # the progress, as each fork ended


def test_the_table_and_the_summary_say_which_changed(project: Path) -> None:
    done = deja("sweep", "run.jsonl", "--perturb", "step=19:malformed,empty", "-j", "2",
                "-o", "out", cwd=project)
    assert done.returncode == 1, done.stderr
    text = done.stdout
    assert "2 fork(s), 1 changed the outcome" in text
    assert f'recorded: completed; final answer: "{DONE}"' in text
    rows = [line.split() for line in text.splitlines() if line.startswith("19 ")]
    assert [row[:10] for row in rows] == [
        ["19", "tool", "search", "malformed", "completed", "0", "same", "1", "model,", "0"],
        ["19", "tool", "search", "empty", "completed", "0", "changed", "1", "model,", "0"]]
    assert rows[1][-1] == str(Path("out") / "s019-search-empty.jsonl")
    assert text.split("changed the outcome:\n", 1)[1].strip() == (
        f'step 19 search empty: completed; final answer "{NOTHING}"')
    # malformed: the recorded text cut in half, which still says "hit 10"
    fork = load(project / "out" / "s019-search-malformed.jsonl")
    assert fork.observations[19]["result"] == "hit 10: "
    # the summary it left with its forks, for deja view out: a row per fork
    [path] = (project / "out" / ".deja" / "suites").glob("run-sweep-*.json")
    summary = suite_summary.read(path)
    assert f"summary in {Path('out') / '.deja' / 'suites' / path.name}" in done.stderr
    assert (summary["suite"], summary["kind"], summary["mode"]) == (path.stem, "sweep", "sweep")
    assert summary["folder"] == str(project.resolve()) and summary["where"].startswith("inline")
    assert summary["totals"]["forks"] == 2 and summary["totals"]["exit_status"] == 1
    parent = load(project / "run.jsonl").run
    assert [(e["incident"], e["run"], e["verdict"], e["changed_at"], e["change"], e["new_run"])
            for e in summary["incidents"]] == [
        ("s019-search-malformed", parent, "same_outcome", 19, "tool search: malformed",
         fork.run),
        ("s019-search-empty", parent, "outcome_changed", 19, "tool search: empty",
         load(project / "out" / "s019-search-empty.jsonl").run)]


# ------------------------------------------------------------------ model steps


def test_a_429_on_a_model_step_is_retried_by_the_sdk_unless_it_may_not(project: Path) -> None:
    done = deja("sweep", "run.jsonl", "--perturb", "step=20:429,529", "-j", "2", "--json",
                "-o", "retried", cwd=project)
    assert done.returncode == 0, done.stderr  # the SDK asked again: nothing changed
    rows = rows_by(json.loads(done.stdout))
    for kind, error_type in (("429", "rate_limit_error"), ("529", "overloaded_error")):
        row = rows[(20, kind)]
        assert (row["status"], row["answer"], row["changed"]) == ("completed", DONE, False)
        assert row["live"]["model_calls"] == 1  # the retry, live
        fork = load(project / row["cassette"])
        step = fork.observations[20]
        assert step["response"]["status"] == int(kind) and step["edited"] is True
        assert step["api_error"]["type"] == error_type
        headers = dict(step["response"]["headers"])
        assert headers["content-type"] == "application/json"
        retried = fork.observations[22]
        assert retried["kind"] == "model" and retried["response"]["status"] == 200

    done = deja("sweep", "run.jsonl", "--perturb", "step=20:429", "--json", "-o", "no-retry",
                cwd=project, env={"RETRIES": "0"})
    assert done.returncode == 1, done.stderr
    [row] = json.loads(done.stdout)["rows"]
    assert (row["status"], row["exit_code"], row["status_changed"]) == ("failed", 1, True)
    assert row["answer"] == "Reading page 10." and row["answer_changed"]
    assert "RateLimitError" in (project / "no-retry" / "s020-claude-sonnet-4-6-429.log"
                                ).read_text()


def test_provider_error_bodies_have_each_providers_shape() -> None:
    line = {"kind": "model", "provider": "anthropic", "seq": 0}
    anthropic_429 = provider_error(line, 429)
    assert anthropic_429["status"] == 429
    assert anthropic_429["body"]["error"]["type"] == "rate_limit_error"
    assert provider_error(line, 529)["body"]["error"]["type"] == "overloaded_error"
    openai = provider_error({**line, "provider": "openai"}, 429)["body"]["error"]
    assert openai["code"] == "rate_limit_exceeded"
    gemini = provider_error({**line, "provider": "gemini"}, 429)["body"]["error"]
    assert (gemini["code"], gemini["status"]) == (429, "RESOURCE_EXHAUSTED")
    assert edit.is_response(anthropic_429) and not edit.is_response({"content": []})


# ------------------------------------------------------------ another recording


def test_other_takes_the_same_tools_result_from_another_recording(
        project: Path, model: StubServer) -> None:
    made = deja("record", "-o", "other.jsonl", "--", sys.executable, "agent.py",
                cwd=project, env={"FOUND": "nothing"})
    assert made.returncode == 0 and f"answer: {NOTHING}" in made.stdout, made.stderr
    done = deja("sweep", "run.jsonl", "--perturb", "step=17:other=other.jsonl",
                "--perturb", "step=19:other=other.jsonl", "-j", "2", "--json", "-o", "o",
                cwd=project)
    assert done.returncode == 1, done.stderr
    rows = rows_by(json.loads(done.stdout))
    assert rows[(17, "other")]["source"] == "other.jsonl step 17"
    assert not rows[(17, "other")]["changed"]
    assert rows[(19, "other")]["source"] == "other.jsonl step 19"
    assert rows[(19, "other")]["answer"] == NOTHING and rows[(19, "other")]["changed"]
    fork = load(project / rows[(19, "other")]["cassette"])
    assert fork.observations[19]["result"] == "nothing 10: doc10.md"


# ------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("rule", "said"), [
    ("tool=nosuch:error", "selects no step; the run's tools are: search"),
    ("tool=search:explode", "unknown perturbation 'explode'"),
    ("step=99:error", "the run has steps 0-20"),
    ("step=0:error", "step 0 is a model step: a model step takes 429 or 529"),
    ("model:empty", "a model step takes 429 or 529, not 'empty'"),
    ("tool=search:other=missing.jsonl", "other=missing.jsonl"),
    ("search", "write SELECTOR:PERTURBATION"),
])
def test_a_bad_rule_exits_2_and_writes_nothing(project: Path, rule: str, said: str) -> None:
    done = deja("sweep", "run.jsonl", "--perturb", "tool=search:empty", "--perturb", rule,
                "-o", "out", cwd=project)
    assert done.returncode == 2, done.stdout + done.stderr
    assert said in " ".join(done.stderr.split()), done.stderr
    assert not (project / "out").exists()


def test_an_existing_fork_file_is_refused_before_anything_runs(project: Path) -> None:
    (project / "out").mkdir()
    (project / "out" / "s019-search-error.jsonl").write_text("mine\n")
    done = deja("sweep", "run.jsonl", "--perturb", "tool=search:error", "-o", "out",
                cwd=project)
    assert done.returncode == 2 and "already exists" in done.stderr, done.stderr
    assert sorted(p.name for p in (project / "out").iterdir()) == ["s019-search-error.jsonl"]


def test_an_interrupted_sweep_goes_on_with_its_id_and_runs_no_fork_twice(
        project: Path) -> None:
    """Ctrl-C in the middle of a sweep, then the same command with the same --id: the
    forks it finished are judged again from their cassettes (not run: their bytes do not
    change), the one it cut is run again, and the report is the whole sweep's."""
    import hashlib
    import signal
    import time

    args = ["sweep", "run.jsonl", "--perturb", "step=9:error,empty", "--perturb",
            "step=19:error,empty", "-o", "out", "--id", "what-if-1", "--json"]
    # As from a terminal: Ctrl-C not ignored, even when these tests run in the background
    # of a shell (which starts them with SIGINT ignored, and a child inherits that).
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with (project / "first.err").open("wb") as err:
            first = subprocess.Popen([sys.executable, "-m", "deja", *args, "-j", "1"],
                                     cwd=project, stdout=subprocess.DEVNULL, stderr=err,
                                     start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, ignored)
    try:
        deadline = time.monotonic() + 300
        while "[1/4]" not in (project / "first.err").read_text():
            assert first.poll() is None and time.monotonic() < deadline, \
                (project / "first.err").read_text()
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
        assert first.wait(timeout=120) == 130, (project / "first.err").read_text()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    said = (project / "first.err").read_text()
    assert "deja sweep: interrupted; deja sweep run.jsonl ... --id what-if-1 -o out goes " \
        "on where it stopped" in said and "Traceback" not in said, said
    finished = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in (project / "out").glob("*.jsonl")
                if load(p, allow_incomplete=True, allow_torn=True).end not in (None,) and
                load(p, allow_incomplete=True, allow_torn=True).end.get("status")
                != "interrupted"}
    assert finished, said  # the first fork, at least

    other = deja(*[a if a != "what-if-1" else "what-if-2" for a in args], cwd=project)
    assert other.returncode == 2 and "already exists" in other.stderr and "--id" in \
        other.stderr, other.stderr  # another sweep's id: refused, nothing touched

    again = deja(*args, "-j", "2", cwd=project)
    assert again.returncode == 1, again.stderr
    assert "sweep what-if-1 (resumed)" in again.stderr
    logs = {p.name: p.read_text() for p in (project / "out").glob("*.log")}
    assert sorted(name for name, text in logs.items() if "judged again, nothing run" in text
                  ) == sorted(name.replace(".jsonl", ".log") for name in finished), logs
    for name in finished:  # what the fork printed the first time is kept above
        assert "answer:" in logs[name.replace(".jsonl", ".log")].split("judged again")[0]
    rows = rows_by(json.loads(again.stdout))
    assert {key for key, row in rows.items() if row["changed"]} == {
        (9, "error"), (19, "error"), (19, "empty")}
    assert all(row["error"] is None and row["exit_code"] == 0 for row in rows.values()), rows
    for name, sha in finished.items():  # judged again, not run again
        assert hashlib.sha256((project / "out" / name).read_bytes()).hexdigest() == sha, name
    assert len(list((project / "out").glob("*.jsonl"))) == 4


def test_a_fork_that_could_not_run_is_an_error_row_and_exit_2(project: Path) -> None:
    done = deja("sweep", "run.jsonl", "--perturb", "step=19:error", "--json", "--junit",
                "junit.xml", "-o", "out", "--", "false", cwd=project)  # no program deja records
    assert done.returncode == 2, done.stderr
    [row] = json.loads(done.stdout)["rows"]
    assert row["error"].startswith("no fork was written") and not row["changed"], row
    suite = ET.parse(project / "junit.xml").getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("1", "0", "1")


def test_dry_run_lists_the_forks_and_writes_nothing(project: Path) -> None:
    done = deja("sweep", "run.jsonl", "--perturb", "model:429", "--dry-run", "--json",
                "-o", "out", cwd=project)
    assert done.returncode == 0, done.stderr
    planned = json.loads(done.stdout)
    assert [p["step"] for p in planned] == list(range(0, 21, 2))
    assert planned[0]["fork_argv"][:5] == ["deja", "fork", "run.jsonl", "--at", "0"]
    # the job that runs it, as a job of a suite: its record is its last line of output
    assert planned[0]["argv"][:5] == ["deja", "sweep", "run.jsonl", "--job",
                                      "s000-claude-sonnet-4-6-429"]
    assert not (project / "out").exists()


def test_plan_sweep_in_python(project: Path) -> None:
    planned = plan_sweep(project / "run.jsonl", ["tool=*:timeout,malformed", "step=19:empty"])
    assert [(p.step, p.kind) for p in planned][:3] == [(1, "timeout"), (1, "malformed"),
                                                       (3, "timeout")]
    assert len(planned) == 21 and planned[-1].document == {"result": ""}
    assert planned[0].document["error"]["type"] == "TimeoutError"
    assert planned[0].target == "search" and planned[0].step_kind == "tool"
    with pytest.raises(NoSuchStep):
        plan_sweep(project / "run.jsonl", ["step=21:error"])
    with pytest.raises(EditError):
        plan_sweep(project / "run.jsonl", ["step=2:timeout"])
    with pytest.raises(ConfigError):
        SweepRule.parse("tool=search")


# ------------------------------------------------------------------ side effects

CHARGE_AGENT = """\
import os

import recorder


@recorder.tool
def price(item):
    return 30


@recorder.tool(side_effect=True)
def charge(amount):
    with open(os.environ["LEDGER"], "a") as ledger:
        ledger.write(f"{amount}\\n")
    return "charged"


try:
    amount = price("book") or 0
except Exception:
    amount = 0
try:
    print("charge", charge(amount))
except recorder.ToolRefused as exc:
    print("refused", exc)
"""


def charges(ledger: Path) -> list[str]:
    return ledger.read_text().split()


def test_a_side_effect_never_runs_in_a_sweep_unless_named(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text(CHARGE_AGENT)
    ledger = tmp_path / "ledger.txt"
    env = {"LEDGER": str(ledger)}
    made = deja("record", "-o", "run.jsonl", "--", sys.executable, "agent.py", cwd=tmp_path,
                env=env)
    assert made.returncode == 0, made.stderr
    assert charges(ledger) == ["30"]

    done = deja("sweep", "run.jsonl", "--perturb", "tool=price:error,empty", "-j", "2",
                "--json", "-o", "safe", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert "In this fork they do not run" in done.stderr
    assert charges(ledger) == ["30"]  # neither fork charged
    for row in json.loads(done.stdout)["rows"]:
        assert row["policy_calls"] == 1 and row["status"] == "completed", row
        [line] = [o for o in load(tmp_path / row["cassette"]).observations if o.get("policy")]
        assert (line["name"], line["policy"], line["args"]) == ("charge", "refuse",
                                                                 {"amount": 0})

    done = deja("sweep", "run.jsonl", "--perturb", "tool=price:error", "--live-tool",
                "charge", "--json", "-o", "live", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert charges(ledger) == ["30", "0"]  # named: it ran, once
    [row] = json.loads(done.stdout)["rows"]
    assert row["policy_calls"] == 0 and row["live"]["tool_calls"] == 1


def test_an_other_recording_that_does_not_verify_is_refused(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """other= answers are signed into each fork: a file signed with a key this machine does
    not have is refused, even where unverified cassettes are otherwise allowed."""
    from recorder.cassette import CassetteWriter, load

    run = load(project / "run.jsonl")
    foreign = project / "foreign.jsonl"  # the same run, signed by another machine's key
    writer = CassetteWriter(foreign, {k: v for k, v in run.header.items()
                                      if k not in ("format", "key_id")}, b"k" * 32)
    for obs in run.observations:
        writer.append_copy(obs, run.requests.get(obs["seq"]))
    writer.abandon()
    monkeypatch.setenv("DEJA_ALLOW_UNVERIFIED", "1")
    with pytest.raises(ConfigError, match="other="):
        plan_sweep(project / "run.jsonl", [f"tool=search:other={foreign}"])
