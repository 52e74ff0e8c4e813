"""Effects (uuid, time, random, custom values) are served by call site, and refusals replay.

``tests/effects_agent.py`` asks for one uuid in ``plan`` and one in ``act``. Recorded in one
order and replayed with the calls swapped, each function must get back its own value (by
name alone, in recorded order, they would trade values and the replay would still say
"identical"). A call site the recording never saw is served in recorded order, with a note
in the result and in `deja replay`'s output. Cassettes from before effects named their
site (the golden one) replay by name, silently. A value the cassette refuses leaves an
effect line with the error, and a replay raises the same error at the same point.

Through ``recorder.record`` / ``replayer.replay`` in this process and through real `deja`
processes; nothing is mocked.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import effects_agent
import pytest
from conftest import golden_agent, read_lines

import recorder
import replayer
from recorder.cassette import load
from recorder.effects import Site, call_site
from replayer import edit

ROOT = Path(__file__).resolve().parents[2]
AGENT = "tests/effects_agent.py"
GOLDEN = Path(__file__).parents[1] / "golden"


def deja(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=ROOT, timeout=120)


def by_call(output: str) -> dict[str, str]:
    """The agent's printed lines as {"plan": uuid, "act": uuid, ...}."""
    out = {}
    for line in output.splitlines():
        call, _, value = line.partition(" ")
        if call in ("plan", "act", "refused"):
            out[call] = value
    return out


def line_of(func: Any, text: str) -> int:
    """The line number of the first source line of ``func`` containing ``text``."""
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(lines) if text in line)


def effect_lines(path: Path) -> list[dict[str, Any]]:
    return [line for line in read_lines(path)[1:] if line["kind"] == "effect"]


def record_agent(path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
                 **env: str) -> dict[str, str]:
    for name in ("EFFECTS_ORDER", "EFFECTS_MOVED", "EFFECTS_REFUSE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    with recorder.record(path):
        assert effects_agent.main() == 0
    return by_call(capsys.readouterr().out)


def replay_agent(path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
                 **env: str) -> tuple[dict[str, str], replayer.ReplayResult]:
    for name in ("EFFECTS_ORDER", "EFFECTS_MOVED", "EFFECTS_REFUSE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    ctx = replayer.replay(path, require_signature=True)
    with ctx:
        assert effects_agent.main() == 0
    assert ctx.result is not None
    return by_call(capsys.readouterr().out), ctx.result


# ------------------------------------------------------------------------- the call site


def test_each_effect_line_names_its_call_site_without_a_machine_path(
        tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.jsonl"
    record_agent(path, capsys, monkeypatch)
    sites = [line["site"] for line in effect_lines(path)]
    assert sites == [f"effects_agent.py:plan:{line_of(effects_agent.plan, 'uuid4')}",
                     f"effects_agent.py:act:{line_of(effects_agent.act, 'uuid4')}"]
    text = "".join(json.dumps(line) for line in effect_lines(path))
    assert str(ROOT) not in text and str(tmp_path) not in text


def test_call_site_names_the_caller_outside_deja_with_its_qualname() -> None:
    class Planner:
        def plan(self) -> Any:
            return call_site()

    site = Planner().plan()
    assert site is not None
    assert site.file == "test_effects.py"  # as imported: relative to its sys.path entry
    assert site.function.endswith("Planner.plan")
    assert site.line == line_of(Planner.plan, "call_site()")
    assert Site.parse(site.record()) == site
    # a colon in the file name still splits: qualnames and lines never hold one
    assert Site.parse("odd:name.py:f.<locals>.g:12") == Site("odd:name.py", "f.<locals>.g", 12)
    assert Site.parse("no line") is None and Site.parse(None) is None


# ------------------------------------------------------------- replay serves by call site


def test_swapped_effects_get_their_own_values_back(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.jsonl"
    recorded = record_agent(path, capsys, monkeypatch)
    assert recorded["plan"] != recorded["act"]
    replayed, result = replay_agent(path, capsys, monkeypatch, EFFECTS_ORDER="act-first")
    assert replayed == recorded  # by name in recorded order, act would get plan's uuid
    assert result.identical and result.notes == ()
    assert "note" not in result.report()


def test_an_effect_from_a_new_call_site_is_served_in_order_with_a_note(
        tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.jsonl"
    recorded = record_agent(path, capsys, monkeypatch)
    replayed, result = replay_agent(path, capsys, monkeypatch, EFFECTS_MOVED="1",
                                    EFFECTS_ORDER="act-first")
    assert replayed == recorded  # act by its site; draft gets plan's, the one left of "uuid"
    assert result.identical
    note = (f"effect 'uuid' asked for at effects_agent.py:draft (line "
            f"{line_of(effects_agent.draft, 'uuid4')}) but recorded at effects_agent.py:plan "
            f"(line {line_of(effects_agent.plan, 'uuid4')}, seq 0): the order of effects "
            "changed (or the call moved); served in recorded order")
    assert result.notes == (note,)
    assert f"  note:       {note}" in result.report().splitlines()
    assert result.to_dict()["notes"] == [note]


def test_an_effect_no_site_and_no_name_can_answer_still_diverges(
        tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.jsonl"
    record_agent(path, capsys, monkeypatch)
    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        effects_agent.main()
        effects_agent.act()  # a third uuid
    assert "no more effect" in str(info.value)
    assert f'"site": "effects_agent.py:act:{line_of(effects_agent.act, "uuid4")}"' \
        in info.value.diff


def test_golden_cassette_without_sites_replays_by_name_silently(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_KEY", "golden-key-deja-v1")
    path = GOLDEN / "v1_tool_agent.jsonl"
    assert all("site" not in line for line in effect_lines(path))
    agent = golden_agent()
    with replayer.replay(path, require_signature=True) as run:
        assert agent.agent("http://127.0.0.1:9") == "It is 18 degrees and clear in Paris."
    result = run.result
    assert result is not None and result.identical and result.verified
    assert result.notes == ()



# ----------------------------------------------------------------- a refused effect value


def test_a_refused_value_is_written_with_its_error_and_raised_again_on_replay(
        tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.jsonl"
    recorded = record_agent(path, capsys, monkeypatch, EFFECTS_REFUSE="1")
    assert recorded["refused"].startswith("UnserializableValue: effect 'handle': ")
    lines = effect_lines(path)
    assert [line["name"] for line in lines] == ["uuid", "handle", "uuid"]
    refusal = lines[1]
    assert "value" not in refusal
    assert refusal["error"] == {"type": "UnserializableValue", "module": "recorder.errors",
                                "message": recorded["refused"].split(": ", 1)[1]}
    assert refusal["site"].startswith("effects_agent.py:refused:")
    end = read_lines(path)[-1]
    assert end["status"] == "completed" and end["totals"]["errors"] == 1

    replayed, result = replay_agent(path, capsys, monkeypatch, EFFECTS_REFUSE="1")
    assert replayed == recorded
    assert result.identical and result.steps_served == 3


def test_a_refusal_the_agent_does_not_catch_replays_as_the_same_error(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with pytest.raises(recorder.UnserializableValue) as live, recorder.record(path):
        recorder.value("started", lambda: {1, 2})  # a set: no cassette holds it
    assert [line["kind"] for line in read_lines(path)[1:]] == ["effect", "end"]
    assert read_lines(path)[-1]["status"] == "error"
    with pytest.raises(recorder.UnserializableValue) as again, replayer.replay(path) as run:
        recorder.value("started", lambda: pytest.fail("a replay never produces a value"))
    assert str(again.value) == str(live.value)
    assert run.result is not None and run.result.identical


# ------------------------------------------------------------------- fork and then-replay


def test_a_fork_serves_its_prefix_by_call_site(tmp_path: Path, capsys: pytest.CaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    parent = tmp_path / "parent.jsonl"
    recorded = record_agent(parent, capsys, monkeypatch)
    edited = "00000000-0000-4000-8000-000000000001"
    monkeypatch.setenv("EFFECTS_ORDER", "act-first")
    out = tmp_path / "fork.jsonl"
    with replayer.fork(parent, at=1, sets=[f"value={edited}"], out=out):  # act's uuid
        effects_agent.main()
    assert by_call(capsys.readouterr().out) == {"act": edited, "plan": recorded["plan"]}
    replayed, result = replay_agent(out, capsys, monkeypatch, EFFECTS_ORDER="act-first")
    assert replayed == {"act": edited, "plan": recorded["plan"]}
    assert result.identical and result.notes == ()


def test_then_replay_copies_effects_with_this_runs_site_and_refusals(
        tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    parent = tmp_path / "parent.jsonl"
    recorded = record_agent(parent, capsys, monkeypatch, EFFECTS_REFUSE="1")
    edited = "00000000-0000-4000-8000-000000000002"
    out = tmp_path / "fork.jsonl"
    with replayer.fork(parent, at=0, sets=[f"value={edited}"], out=out, then_replay=parent):
        effects_agent.main()
    assert by_call(capsys.readouterr().out) == {**recorded, "plan": edited}
    lines = read_lines(out)[1:]
    assert [line["kind"] for line in lines] == ["effect", "control", "effect", "effect", "end"]
    source = effect_lines(parent)
    assert lines[2]["error"] == source[1]["error"] and "value" not in lines[2]
    assert lines[3]["value"] == source[2]["value"]
    assert [lines[2]["site"], lines[3]["site"]] == [
        f"effects_agent.py:refused:{line_of(effects_agent.refused, 'handle')}",
        f"effects_agent.py:act:{line_of(effects_agent.act, 'uuid4')}"]
    assert lines[-1]["totals"]["effects"] == 3 and lines[-1]["totals"]["errors"] == 1
    replayed, result = replay_agent(out, capsys, monkeypatch, EFFECTS_REFUSE="1")
    assert replayed == {**recorded, "plan": edited}
    assert result.identical and result.notes == ()


def test_a_fork_can_give_a_refused_effect_a_value(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    parent = tmp_path / "parent.jsonl"
    record_agent(parent, capsys, monkeypatch, EFFECTS_REFUSE="1")
    plan = replayer.plan_fork(parent, 1, replace={"value": "a handle"})
    assert edit.view(plan.original) == {"error": effect_lines(parent)[1]["error"]}
    out = tmp_path / "fork.jsonl"
    with replayer.fork(parent, at=1, replace={"value": "a handle"}, out=out):
        effects_agent.main()
    assert "not refused" in capsys.readouterr().out.splitlines()
    edited = read_lines(out)[2]
    assert edited["value"] == "a handle" and "error" not in edited and edited["edited"]


# ------------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def cli_recorded(tmp_path_factory: pytest.TempPathFactory,
                 module_env: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """effects_agent.py recorded by `deja record`, plan first, with its refusal (once)."""
    path = tmp_path_factory.mktemp("effects") / "cli.jsonl"
    proc = deja("record", "-o", str(path), "--", "python", AGENT,
                env={**module_env, "EFFECTS_REFUSE": "1", "EFFECTS_ORDER": "plan-first",
                     "EFFECTS_MOVED": "0"})
    assert proc.returncode == 0, proc.stderr
    recorded = by_call(proc.stdout)
    assert set(recorded) == {"plan", "act", "refused"}
    return path, recorded


@pytest.fixture
def cli_cassette(tmp_path: Path,
                 cli_recorded: tuple[Path, dict[str, str]]) -> tuple[Path, dict[str, str]]:
    """The recording, copied for this test; what the agent printed."""
    path, recorded = cli_recorded
    return Path(shutil.copyfile(path, tmp_path / "cli.jsonl")), recorded


def test_deja_replay_serves_swapped_effects_by_call_site(
        cli_cassette: tuple[Path, dict[str, str]]) -> None:
    path, recorded = cli_cassette
    proc = deja("replay", str(path), env={"EFFECTS_REFUSE": "1", "EFFECTS_ORDER": "act-first"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert by_call(proc.stdout) == recorded
    assert "identical" in proc.stdout and "note:" not in proc.stdout
    assert proc.stdout.splitlines()[0].startswith("act ")  # the calls really were swapped


def test_deja_replay_prints_the_note_of_an_effect_from_a_new_call_site(
        cli_cassette: tuple[Path, dict[str, str]]) -> None:
    path, recorded = cli_cassette
    env = {"EFFECTS_REFUSE": "1", "EFFECTS_MOVED": "1"}
    proc = deja("replay", str(path), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert by_call(proc.stdout) == recorded
    notes = [line for line in proc.stdout.splitlines() if line.lstrip().startswith("note:")]
    assert len(notes) == 1
    assert ("effect 'uuid' asked for at effects_agent.py:draft" in notes[0]
            and "recorded at effects_agent.py:plan" in notes[0]
            and "the order of effects changed" in notes[0])
    as_json = json.loads(deja("replay", str(path), "--json", env=env).stdout)  # JSON only
    assert as_json["identical"] is True
    assert len(as_json["notes"]) == 1 and as_json["notes"][0] in notes[0]


def test_a_cassette_recorded_by_deja_record_replays_in_process_by_call_site(
        cli_cassette: tuple[Path, dict[str, str]], capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored site is portable: `python tests/effects_agent.py` and `import
    effects_agent` name the same file."""
    path, recorded = cli_cassette
    replayed, result = replay_agent(path, capsys, monkeypatch, EFFECTS_REFUSE="1",
                                    EFFECTS_ORDER="act-first")
    assert replayed == recorded
    assert result.identical and result.notes == ()
    assert load(path).observations[0]["site"].startswith("effects_agent.py:plan:")
