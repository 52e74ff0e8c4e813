"""A side effect never fires by accident in a fork: the tool policy of a run's live part.

The agent looks an order up and refunds it into a SQLite ledger (a ``side_effect=True``
tool). Forked after the lookup, the refund is never written unless ``--live-tool refund``
names it, and then exactly once; the same arguments as recorded are served the recorded
answer, other arguments are refused (the agent sees ``recorder.ToolRefused``); ``--tool``
sets any tool's rule; the cassette marks each call the policy answered and the report
lists it; a resumed fork keeps its policy; a replay of the fork is identical. Real
``deja`` processes.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import recorder
import replayer
from recorder.cassette import load
from recorder.errors import ConfigError
from replayer.tool_policy import Rule, ToolPolicy, ToolRule
from viewer import queries

AGENT = """\
import json, os, sqlite3, sys

import recorder

LEDGER = os.environ["LEDGER"]


@recorder.tool
def lookup(order):
    return {"order": order, "amount": 30}


@recorder.tool(side_effect=True)
def refund(order, amount):
    with sqlite3.connect(LEDGER) as db:
        db.execute("CREATE TABLE IF NOT EXISTS refunds (ord TEXT, amount INTEGER)")
        db.execute("INSERT INTO refunds VALUES (?, ?)", (order, amount))
    return {"refunded": amount, "order": order}


found = lookup("A7")
if os.environ.get("CRASH_BEFORE_REFUND"):
    os._exit(3)
try:
    print("refund", json.dumps(refund(found["order"], found["amount"])), flush=True)
except recorder.ToolRefused as exc:
    print("refused", exc, flush=True)
"""


def deja(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def refunds(ledger: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(ledger) as db:
        return list(db.execute("SELECT ord, amount FROM refunds ORDER BY rowid"))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str]) -> Path:
    """The incident, recorded once: lookup, then a refund of 30 written to the ledger."""
    root = tmp_path_factory.mktemp("recorded")
    (root / "agent.py").write_text(AGENT)
    env = {**module_env, "LEDGER": str(root / "ledger.db")}
    done = deja("record", "-o", "run.jsonl", "--", sys.executable, "agent.py", cwd=root,
                env=env)
    assert done.returncode == 0, done.stderr
    assert refunds(root / "ledger.db") == [("A7", 30)]
    return root


@pytest.fixture
def project(recorded: Path, tmp_path: Path) -> tuple[Path, dict[str, str], Path]:
    """A copy of the recorded project with a ledger of its own (the one refund)."""
    root = tmp_path / "project"
    root.mkdir()
    for name in ("agent.py", "run.jsonl", "ledger.db"):
        (root / name).write_bytes((recorded / name).read_bytes())
    ledger = root / "ledger.db"
    return root, {**os.environ, "LEDGER": str(ledger)}, ledger


def policy_lines(path: Path) -> list[dict]:
    return [o for o in load(path).observations if o.get("policy")]


def test_a_fork_with_other_arguments_refuses_the_refund(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    forked = deja("fork", "run.jsonl", "--at", "0", "--set", "result.amount=45", "-o",
                  "fork.jsonl", cwd=root, env=env)
    assert forked.returncode == 0, forked.stderr
    assert "refund (step 1). In this fork they do not run" in forked.stderr, forked.stderr
    assert "refused tool 'refund' was not run: it has side effects" in forked.stdout
    assert refunds(ledger) == [("A7", 30)]  # nothing written
    [line] = policy_lines(root / "fork.jsonl")
    assert (line["kind"], line["name"], line["policy"]) == ("tool", "refund", "refuse")
    assert line["error"]["type"] == "ToolRefused" and line["args"]["amount"] == 45
    assert "step 2: tool 'refund' refused: not run" in forked.stderr, forked.stderr
    assert load(root / "fork.jsonl").header["tools"] == {}

    # the fork replays identical: the refusal is served as the recorded error
    replayed = deja("replay", "fork.jsonl", cwd=root, env=env)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "refused tool 'refund' was not run" in replayed.stderr + replayed.stdout
    assert refunds(ledger) == [("A7", 30)]


def test_named_live_the_refund_is_written_exactly_once(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    forked = deja("fork", "run.jsonl", "--at", "0", "--set", "result.amount=45",
                  "--live-tool", "refund", "-o", "fork.jsonl", cwd=root, env=env)
    assert forked.returncode == 0, forked.stderr
    assert "This fork runs refund live, for real" in forked.stderr, forked.stderr
    assert 'refund {"refunded": 45, "order": "A7"}' in forked.stdout
    assert refunds(ledger) == [("A7", 30), ("A7", 45)]
    assert policy_lines(root / "fork.jsonl") == []
    assert [o["kind"] for o in load(root / "fork.jsonl").observations] == [
        "tool", "control", "intent", "outcome"]
    assert load(root / "fork.jsonl").header["tools"] == {"refund": "live"}


def test_the_same_arguments_are_served_the_recorded_answer(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    (root / "note.json").write_text('[{"op": "add", "path": "/result/note", "value": "x"}]')
    forked = deja("fork", "run.jsonl", "--at", "0", "--patch", "note.json", "-o",
                  "fork.jsonl", cwd=root, env=env)
    assert forked.returncode == 0, forked.stderr
    assert 'refund {"refunded": 30, "order": "A7"}' in forked.stdout
    assert refunds(ledger) == [("A7", 30)]
    [line] = policy_lines(root / "fork.jsonl")
    parent = load(root / "run.jsonl")
    assert (line["policy"], line["from"]) == ("recorded", {"run": parent.run, "seq": 1})
    assert "served the recorded answer (run" in forked.stderr


def test_tool_rules_static_and_refuse(project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    forked = deja("fork", "run.jsonl", "--at", "0", "--set", "result.amount=45",
                  "--tool", 'refund=static:{"refunded": 0, "order": "none"}', "-o",
                  "static.jsonl", cwd=root, env=env)
    assert forked.returncode == 0, forked.stderr
    assert 'refund {"refunded": 0, "order": "none"}' in forked.stdout
    assert [line["policy"] for line in policy_lines(root / "static.jsonl")] == ["static"]
    assert refunds(ledger) == [("A7", 30)]

    bad = deja("fork", "run.jsonl", "--at", "0", "--set", "result.amount=45",
               "--tool", "refund=sometimes", "-o", "bad.jsonl", cwd=root, env=env)
    assert bad.returncode == 2 and "one of live, recorded, refuse or static:JSON" in bad.stderr
    assert not (root / "bad.jsonl").exists()


def test_a_resumed_fork_keeps_its_policy(project: tuple[Path, dict[str, str], Path]) -> None:
    root, env, ledger = project
    for name, extra in (("safe.jsonl", []), ("live.jsonl", ["--live-tool", "refund"])):
        crashed = deja("fork", "run.jsonl", "--at", "0", "--set", "result.amount=45", *extra,
                       "-o", name, cwd=root, env={**env, "CRASH_BEFORE_REFUND": "1"})
        assert crashed.returncode == 3, crashed.stderr
        assert load(root / name, allow_incomplete=True).end is None
    resumed = deja("resume", "safe.jsonl", cwd=root, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "refused tool 'refund' was not run" in resumed.stdout
    assert refunds(ledger) == [("A7", 30)]
    resumed = deja("resume", "live.jsonl", cwd=root, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert refunds(ledger) == [("A7", 30), ("A7", 45)]


def test_in_process_fork_takes_the_policy(project: tuple[Path, dict[str, str], Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    root, _, ledger = project
    monkeypatch.setenv("LEDGER", str(ledger))
    agent = compile(AGENT, "agent.py", "exec")
    patch = [{"op": "replace", "path": "/result/amount", "value": 45}]
    with replayer.fork(root / "run.jsonl", at=0, patch=patch, out=root / "a.jsonl"):
        exec(agent, {"__name__": "agent"})
    assert refunds(ledger) == [("A7", 30)]
    with replayer.fork(root / "run.jsonl", at=0, patch=patch, out=root / "b.jsonl",
                       live_tools=["refund"]):
        exec(agent, {"__name__": "agent"})
    assert refunds(ledger) == [("A7", 30), ("A7", 45)]


def test_the_viewer_says_what_the_fork_will_do(
        project: tuple[Path, dict[str, str], Path]) -> None:
    root, _, _ = project
    [said] = queries.fork_warnings(root / "run.jsonl", 0)
    assert "refund (step 1). In this fork they do not run" in said


def test_parse_and_defaults() -> None:
    policy = ToolPolicy.parse(["*=refuse", "search=static:[1, 2]"], live=["refund"])
    assert policy.rule_for("refund", side_effect=True) == ToolRule(Rule.LIVE)
    assert policy.rule_for("search", side_effect=False) == ToolRule(Rule.STATIC, [1, 2])
    assert policy.rule_for("other", side_effect=False) == ToolRule(Rule.REFUSE)
    everything = ToolPolicy.parse(["*=live"])
    assert everything.rule_for("pay", side_effect=True).rule is Rule.RECORDED  # not named
    assert everything.rule_for("look", side_effect=False).rule is Rule.LIVE
    assert ToolPolicy().rule_for("look", side_effect=False).rule is Rule.LIVE
    assert ToolPolicy.from_header({"tools": policy.to_header()}) == policy
    assert ToolPolicy.from_header({"parent": {"run": "r"}}) == ToolPolicy()
    assert ToolPolicy.from_header({}) is None
    for bad, said in (("refund", "write NAME=RULE"), ("refund=live", "two rules"),
                      ("x=static", "needs a JSON value"), ("x=static:{", "not JSON"),
                      ("x=refuse:1", "only static takes a value")):
        with pytest.raises(ConfigError, match=said):
            ToolPolicy.parse([bad, "refund=refuse"] if said == "two rules" else [bad],
                             live=["refund"] if said == "two rules" else [])
    assert recorder.ToolRefused("no", tool="t").tool == "t"


def test_the_viewers_fork_panel_offers_the_same_choice(
        project: tuple[Path, dict[str, str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from streamlit.testing.v1 import AppTest

    from viewer.safe import unescape

    root, _, ledger = project
    monkeypatch.setenv("LEDGER", str(ledger))
    monkeypatch.setenv("DEJA_VIEW_DIR", str(root))
    run = load(root / "run.jsonl").run
    app = Path(__file__).resolve().parents[2] / "viewer" / "app.py"

    def fork(live: bool) -> None:
        at = AppTest.from_file(str(app), default_timeout=30)
        at.query_params.update(run=run, step="0")
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        box = at.checkbox(key=f"live_tool:{root / 'run.jsonl'}:0:refund")
        assert unescape(box.label) == "Run refund live, for real" and not box.value
        said = " ".join(unescape(str(w.value)) for w in at.warning)
        assert "In this fork they do not run" in said, said
        if live:
            box.check().run()
            said = " ".join(unescape(str(w.value)) for w in at.warning)
            assert "This fork runs refund live, for real" in said, said
        at.text_area[0].input(json.dumps({"result": {"order": "A7", "amount": 45}})).run()
        at.button(key="fork_btn").click().run()
        deadline = time.monotonic() + 90
        while not any("finished" in unescape(str(s.value)) for s in at.success):
            assert time.monotonic() < deadline, [unescape(str(e.value)) for e in at.error]
            time.sleep(0.3)
            at.run()

    fork(live=False)
    assert refunds(ledger) == [("A7", 30)]
    fork(live=True)
    assert refunds(ledger) == [("A7", 30), ("A7", 45)]
