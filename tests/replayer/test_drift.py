"""``deja drift`` and :mod:`replayer.drift`: a recorded run against the same program run
live now, against a stub model whose answers stayed the same or changed.

The count agent (tests/count_agent.py) is recorded once for the module through ``deja
record`` against the stub; each test copies it. Its tool draws a ``uuid4()`` effect, a
value that differs in every live run: those steps are equivalent, the others the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from conftest import TEST_KEY

from recorder import providers
from recorder.cassette import load
from recorder.testing.server import StubServer
from replayer.drift import drift, volatile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from count_agent import SCRIPT  # noqa: E402
from tamper import Source, join, resign  # noqa: E402

# The provider, later: its second answer says something else.
CHANGED = {**SCRIPT, "turns": [SCRIPT["turns"][0],
                               {**SCRIPT["turns"][1], "text": "Narrowing it down further."},
                               *SCRIPT["turns"][2:]]}
TEXT = "/response/message/content/0/text"


@pytest.fixture(scope="module")
def stubs() -> Iterator[dict[str, StubServer]]:
    """The provider as recorded (``same``) and as it answers now (``changed``)."""
    with StubServer(SCRIPT) as same, StubServer(CHANGED) as changed:
        yield {"same": same, "changed": changed}


def _deja(*args: str, cwd: Path, env: dict[str, str] | None = None) -> \
        subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("ANTHROPIC_BASE_URL", "AGENT_PROMPT", "AGENT_TURNS")}
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=180, env={**base, **(env or {})})


@pytest.fixture(scope="module")
def recorded_once(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str],
                  stubs: dict[str, StubServer]) -> Path:
    """The count agent recorded through ``deja record`` against the stub, once; and the
    same program recorded against the changed stub beside it (``changed.jsonl``)."""
    folder = tmp_path_factory.mktemp("drift")
    shutil.copyfile(ROOT / "tests" / "count_agent.py", folder / "agent.py")
    for name, stub in (("run", "same"), ("changed", "changed")):
        done = subprocess.run(
            [sys.executable, "-m", "deja", "record", "-o", f"{name}.jsonl", "--", "python",
             "agent.py"], cwd=folder, capture_output=True, text=True, timeout=180,
            env={**module_env, "ANTHROPIC_BASE_URL": stubs[stub].url})
        assert done.returncode == 0, done.stderr
    return folder


@pytest.fixture
def project(tmp_path: Path, recorded_once: Path) -> Path:
    """This test's copy of the agent and its recordings; the recorded cassette."""
    for name in ("agent.py", "run.jsonl", "changed.jsonl"):
        shutil.copyfile(recorded_once / name, tmp_path / name)
    return tmp_path / "run.jsonl"


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "__pycache__")


# --------------------------------------------------------------------------- the library


def test_the_same_run_is_the_same_at_every_step(project: Path) -> None:
    report = drift(project, project)
    assert report.verdict == "same" and not report.changed and report.first_change is None
    assert {s.verdict for s in report.steps} == {"same"}
    assert report.summary() == "same"


def test_a_changed_answer_is_the_first_change_and_what_follows_comes_after_it(
        project: Path) -> None:
    report = drift(project, project.with_name("changed.jsonl"))
    assert report.verdict == "changed" and report.changed and report.cause == "answer"
    verdicts = [(s.seq, s.kind, s.verdict) for s in report.steps]
    first = next(i for i, (_, _, v) in enumerate(verdicts) if v == "changed")
    assert verdicts[first][:2] == (report.first_change, "model")
    # the second model call: step 0 asked first, then the tool (its effect inside it)
    assert [k for _, k, _ in verdicts[:first]] == ["model", "effect", "tool"]
    assert {v for _, _, v in verdicts[:first]} <= {"same", "equivalent"}
    assert {v for _, _, v in verdicts[first + 1:]} == {"after_change"}
    assert verdicts[-1][1] == "end"
    step = report.steps[first]
    assert [(c.path, c.a, c.b) for c in step.changes] == [
        (TEXT, "Narrowing it down.", "Narrowing it down further.")]
    assert step.where[TEXT] == "reply: text"
    # the next request carries the changed answer: a consequence, listed, not a drift
    later = [s for s in report.steps[first + 1:] if s.changes]
    assert later and later[0].kind == "model" and \
        later[0].changes[0].path.startswith("/request/messages/")
    counts = report.counts()
    assert counts["changed"] == 1 and counts["after_change"] == len(report.steps) - first - 2
    assert report.summary().startswith(
        f'changed at step {report.first_change}: the provider answered differently; {TEXT}: '
        '"Narrowing it down." -> "Narrowing it down further."')
    out = report.to_dict()
    assert out["verdict"] == "changed" and out["first_change"] == report.first_change
    assert out["steps"][first]["changes"] == [{
        "path": TEXT, "op": "replace", "recorded": "Narrowing it down.",
        "live": "Narrowing it down further.", "where": "reply: text"}]
    json.dumps(out)  # it is JSON as it is


def test_the_versions_of_both_runs_are_read_from_headers_and_responses(project: Path) -> None:
    report = drift(project, project.with_name("changed.jsonl"))
    for run in (report.recorded, report.live):
        assert run.versions["anthropic"] == anthropic.__version__
        assert run.versions["python"] == ".".join(map(str, sys.version_info[:3]))
        assert run.providers == ("anthropic",) and run.models == ("claude-sonnet-4-6",)
        assert list(run.api_versions) == ["anthropic-version"]
    assert report.version_changes() == {}


def test_what_differs_between_any_two_runs_is_equivalent() -> None:
    for path in ("/usage/output_tokens", "/cost_usd", "/response/message/usage/input_tokens",
                 *(f"/response/message/{key}" for key in providers.answer_meta_keys())):
        assert volatile("model", path), path
    assert volatile("effect", "/value") and volatile("end", "/totals/cost_usd")
    for kind, path in (("model", TEXT), ("model", "/request/messages/0/content"),
                       ("model", "/response/status"), ("tool", "/result"),
                       ("end", "/status"), ("end", "/totals/model_calls")):
        assert not volatile(kind, path), (kind, path)


# --------------------------------------------------------------------------- the command


def test_an_unchanged_provider_exits_0_with_every_step_same_or_equivalent(
        project: Path, stubs: dict[str, StubServer]) -> None:
    before, served = project.read_bytes(), stubs["same"].served
    done = _deja("drift", "run.jsonl", "--base-url", stubs["same"].url, "--json",
                 cwd=project.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)  # the program's own output went to stderr
    assert "turn 0: Searching." in done.stderr
    assert report["verdict"] == "equivalent" and report["first_change"] is None
    assert {s["verdict"] for s in report["steps"]} == {"same", "equivalent"}
    equivalent = [s for s in report["steps"] if s["verdict"] == "equivalent"]
    assert {s["kind"] for s in equivalent} == {"effect"}  # the tool's uuid4()
    assert all([c["path"] for c in s["equivalent"]] == ["/value"] for s in equivalent)
    assert stubs["same"].served - served == 4  # it ran live
    assert report["live"]["kept"] is False
    assert project.read_bytes() == before
    assert _files(project.parent) == ["agent.py", "changed.jsonl", "run.jsonl"]


def test_a_changed_second_answer_exits_1_naming_the_step_and_the_field(
        project: Path, stubs: dict[str, StubServer]) -> None:
    before = project.read_bytes()
    done = _deja("drift", "run.jsonl", "--base-url", stubs["changed"].url, cwd=project.parent)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "against a live run r_" in out and "(not kept): CHANGED" in out
    assert "step 3 (model): CHANGED: the provider answered differently" in out
    assert f'{TEXT}: "Narrowing it down." -> "Narrowing it down further."  [reply: text]' in out
    assert "after the change: steps 4-9 and the end line (not drifts of their own" in out
    assert f"versions:   python {sys.version.split()[0]}, anthropic {anthropic.__version__}" \
        in out and "(both runs)" in out
    assert "models:     claude-sonnet-4-6 (both runs)" in out
    assert "steps 0-2" not in out and "step 1 (effect): equivalent" in out
    assert project.read_bytes() == before
    assert _files(project.parent) == ["agent.py", "changed.jsonl", "run.jsonl"]


def test_o_keeps_the_live_run_as_a_signed_cassette_and_never_overwrites(
        project: Path, stubs: dict[str, StubServer]) -> None:
    before, served = project.read_bytes(), stubs["changed"].served
    done = _deja("drift", "run.jsonl", "--base-url", stubs["changed"].url, "-o", "live.jsonl",
                 "--json", cwd=project.parent)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    kept = load(project.with_name("live.jsonl"))
    assert kept.verified and kept.end is not None and kept.end["status"] == "completed"
    assert report["live"] == {**report["live"], "kept": True, "run": kept.run,
                              "path": "live.jsonl"}
    assert kept.header["argv"] == ["python", "agent.py"]
    assert kept.header["labels"]["drift_of"] == load(project).run
    assert report["first_change"] == 3 and report["cause"] == "answer"
    # the kept run is the live one: compared again, the same verdict
    assert drift(project, project.with_name("live.jsonl")).first_change == 3

    served = stubs["changed"].served
    for args, said in ((["-o", "live.jsonl"], "live.jsonl already exists; pass --force"),
                       (["-o", "run.jsonl", "--force"], "is the recorded cassette: deja "
                                                         "drift never writes it")):
        refused = _deja("drift", "run.jsonl", "--base-url", stubs["changed"].url, *args,
                        cwd=project.parent)
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    assert stubs["changed"].served == served  # nothing ran
    assert project.read_bytes() == before


def test_a_changed_request_is_the_programs_doing_not_the_providers(
        project: Path, stubs: dict[str, StubServer]) -> None:
    done = _deja("drift", "run.jsonl", "--base-url", stubs["same"].url, cwd=project.parent,
                 env={"AGENT_PROMPT": "Where is the token refresh?"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "step 0 (model): CHANGED: the program sent another request: its code or inputs " \
        "changed, not the provider" in done.stdout
    assert '/request/messages/0/content: "Where is the session refresh implemented?" -> ' \
        '"Where is the token refresh?"' in done.stdout


def test_against_compares_two_recorded_runs_without_running_anything(project: Path) -> None:
    done = _deja("drift", "run.jsonl", "--against", "changed.jsonl", cwd=project.parent)
    assert done.returncode == 1 and "step 3 (model): CHANGED" in done.stdout, done.stderr
    same = _deja("drift", "run.jsonl", "--against", "run.jsonl", "--json", cwd=project.parent)
    assert same.returncode == 0 and json.loads(same.stdout)["verdict"] == "same"
    mixed = _deja("drift", "run.jsonl", "--against", "run.jsonl", "--", "python", "agent.py",
                  cwd=project.parent)
    assert mixed.returncode == 2 and "--against compares two recorded runs" in mixed.stderr


def test_an_unverified_cassettes_recorded_command_is_not_run(
        project: Path, stubs: dict[str, StubServer]) -> None:
    marker = project.parent / "ran"
    agent = project.with_name("agent.py")
    agent.write_text(f"open({str(marker)!r}, 'w').close()\n" + agent.read_text())
    stranger = {"DEJA_KEY": "a-key-this-cassette-was-not-signed-with-0123"}
    refused = _deja("drift", "run.jsonl", "--base-url", stubs["same"].url,
                    cwd=project.parent, env=stranger)
    assert refused.returncode == 2 and "UnverifiedCassette" in refused.stderr
    refused = _deja("drift", "run.jsonl", "--base-url", stubs["same"].url,
                    "--allow-unverified", cwd=project.parent, env=stranger)
    assert refused.returncode == 2, refused.stderr
    assert "deja does not run the command an unverified header names (python agent.py)" \
        in refused.stderr
    assert not marker.exists()
    as_json = _deja("drift", "run.jsonl", "--json", cwd=project.parent, env=stranger)
    assert as_json.returncode == 2
    assert json.loads(as_json.stdout)["error"] == "UnverifiedCassette"
    assert not marker.exists()


def test_a_run_recorded_through_the_proxy_is_refused_saying_how(project: Path) -> None:
    source = Source.of(project.read_bytes())
    docs = [dict(d) for d in source.docs]
    docs[0]["proxy"] = {"upstream": "https://api.anthropic.com"}
    project.write_bytes(join(resign(docs, TEST_KEY.encode())))
    assert load(project).verified
    done = _deja("drift", "run.jsonl", cwd=project.parent)
    assert done.returncode == 2
    assert "was recorded through deja proxy" in done.stderr
    assert "deja drift run.jsonl --against DIR/<run>.jsonl" in done.stderr


def test_bad_input_exits_2(project: Path) -> None:
    for args, said in ((["missing.jsonl"], "CassetteNotFound"),
                       (["run.jsonl", "--base-url", "ftp://example"], "is not an http://")):
        done = _deja("drift", *args, cwd=project.parent)
        assert done.returncode == 2 and said in done.stderr, done.stderr
