"""The pytest plugin's dry run: ``--deja-dry-run`` (or ``--dry-run``) with ``all`` or
``rewrite`` runs each marked test live into a temporary file, reports how the provider's
answers differ from the cassette's in a ``deja drift`` section, and writes no cassette.

Each test writes the count agent and a marked test of it into a pytester folder, with a
cassette recorded once for the module by the plugin itself, and runs pytest on it in
process (pytester's own run: a session of its own, its modules let go after) against the
stub model on 127.0.0.1.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from recorder.cassette import load
from recorder.testing.server import StubServer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from count_agent import SCRIPT  # noqa: E402

CHANGED = {**SCRIPT, "turns": [SCRIPT["turns"][0],
                               {**SCRIPT["turns"][1], "text": "Narrowing it down further."},
                               *SCRIPT["turns"][2:]]}
TEST = """
import os, pytest
import agent

@pytest.mark.deja("cassettes/agent.jsonl")
def test_agent():
    assert agent.main() == 0
    assert not os.environ.get("FAIL_TEST"), "the test's own failure"
"""
INI = "[pytest]\nasyncio_default_fixture_loop_scope = function\n"


@pytest.fixture(autouse=True)
def _mode_not_set_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CI", "DEJA_RECORD_MODE", "DEJA_ALLOW_UNVERIFIED", "AGENT_TURNS",
                "AGENT_PROMPT", "FAIL_TEST"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def stubs() -> Iterator[dict[str, StubServer]]:
    """The provider as recorded (``same``) and as it answers now (``changed``)."""
    with StubServer(SCRIPT) as same, StubServer(CHANGED) as changed:
        yield {"same": same, "changed": changed}


def _write_project(folder: Path) -> None:
    shutil.copyfile(ROOT / "tests" / "count_agent.py", folder / "agent.py")
    (folder / "test_agent.py").write_text(TEST)
    (folder / "pytest.ini").write_text(INI)


@pytest.fixture(scope="module")
def recorded_once(tmp_path_factory: pytest.TempPathFactory, module_env: dict[str, str],
                  stubs: dict[str, StubServer]) -> Path:
    """The test's cassette, recorded once by the plugin (``--deja-record-mode=once``)."""
    folder = tmp_path_factory.mktemp("pytest-drift")
    _write_project(folder)
    env = {k: v for k, v in module_env.items()
           if k not in ("CI", "DEJA_RECORD_MODE", "AGENT_TURNS", "AGENT_PROMPT", "FAIL_TEST")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:langsmith_plugin",
         "--deja-record-mode=once", "test_agent.py"], cwd=folder, capture_output=True,
        text=True, timeout=180,
        env={**env, "ANTHROPIC_BASE_URL": stubs["same"].url, "PYTEST_ADDOPTS": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    return folder / "cassettes" / "agent.jsonl"


@pytest.fixture
def cassette(pytester: pytest.Pytester, recorded_once: Path) -> Path:
    """The project in this test's pytester folder, with the recorded cassette."""
    _write_project(pytester.path)
    (pytester.path / "cassettes").mkdir()
    return Path(shutil.copyfile(recorded_once, pytester.path / "cassettes" / "agent.jsonl"))


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


def dry_run(pytester: pytest.Pytester, cassette: Path, monkeypatch: pytest.MonkeyPatch,
            url: str, *flags: str) -> pytest.RunResult:
    """pytest FLAGS against the stub at ``url``, after which the cassette is as it was and
    alone in its folder: no new recording, no lock left behind."""
    recorded = cassette.read_bytes()
    monkeypatch.setenv("ANTHROPIC_BASE_URL", url)
    result = run(pytester, *flags)
    assert cassette.read_bytes() == recorded
    assert sorted(p.name for p in cassette.parent.iterdir()) == [cassette.name]
    return result


def test_a_changed_answer_is_reported_and_the_cassette_is_left_as_it_was(
        pytester: pytest.Pytester, cassette: Path, stubs: dict[str, StubServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    served = stubs["changed"].served
    result = dry_run(pytester, cassette, monkeypatch, stubs["changed"].url,
                     "--deja-record-mode=all", "--deja-dry-run")
    result.assert_outcomes(passed=1)  # a changed answer fails no test by itself
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([
        "*= deja drift =*",
        "test_agent.py::test_agent: cassettes/agent.jsonl: changed at step 3: the provider "
        'answered differently; /response/message/content/0/text: "Narrowing it down." -> '
        '"Narrowing it down further."; 6 steps after it',
        "dry run: no cassette was written; 1 changed, 0 equivalent, 0 same.*"])
    assert "cassettes written" not in result.stdout.str()
    assert stubs["changed"].served - served == 4  # the test ran live


def test_an_unchanged_provider_is_equivalent_and_rewrite_deletes_nothing(
        pytester: pytest.Pytester, cassette: Path, stubs: dict[str, StubServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    result = dry_run(pytester, cassette, monkeypatch, stubs["same"].url,
                     "--deja-record-mode=rewrite", "--dry-run")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "test_agent.py::test_agent: cassettes/agent.jsonl: equivalent (differs only in what "
        "differs between any two runs, at step 1, step 4, step 7)",
        "dry run: no cassette was written; 0 changed, 1 equivalent, 0 same.*"])


def test_a_failing_test_carries_the_whole_comparison_in_its_report(
        pytester: pytest.Pytester, cassette: Path, stubs: dict[str, StubServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIL_TEST", "1")
    result = dry_run(pytester, cassette, monkeypatch, stubs["changed"].url,
                     "--deja-rerecord", "--deja-dry-run")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*the test's own failure*",
        "*- Captured deja drift call -*",
        "drift of r_* against a live run r_* (not kept): CHANGED",
        "  step 3 (model): CHANGED: the provider answered differently",
        '    /response/message/content/0/text: "Narrowing it down." -> "Narrowing it down '
        'further."  [reply: text]',
        "  after the change: steps 4-9 and the end line*"])


def test_a_test_without_a_cassette_records_nothing(
        pytester: pytest.Pytester, cassette: Path, stubs: dict[str, StubServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    cassette.unlink()
    monkeypatch.setenv("ANTHROPIC_BASE_URL", stubs["same"].url)
    result = run(pytester, "--deja-record-mode=all", "--deja-dry-run")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["test_agent.py::test_agent: cassettes/agent.jsonl: no "
                                 "cassette to compare with (the live run was not kept)"])
    assert list(cassette.parent.iterdir()) == []


def test_a_dry_run_needs_a_mode_that_records_anew(
        pytester: pytest.Pytester, cassette: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = cassette.read_bytes()
    result = run(pytester, "--deja-dry-run")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--deja-dry-run runs the marked tests live into temporary "
                                 "files*it goes with --deja-record-mode=all or rewrite (or "
                                 "--deja-rerecord); no record mode was given*"])
    monkeypatch.setenv("DEJA_RECORD_MODE", "new_episodes")
    result = run(pytester, "--dry-run")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*; DEJA_RECORD_MODE asks for new_episodes*"])
    assert cassette.read_bytes() == recorded


def test_dry_run_is_left_to_a_plugin_that_took_the_name(
        pytester: pytest.Pytester, cassette: Path, stubs: dict[str, StubServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeconftest("""
        def pytest_addoption(parser):
            parser.addoption("--dry-run", action="store_true", dest="their_dry_run")

        def pytest_report_header(config):
            return f"their dry run: {config.getoption('their_dry_run')}"
    """)
    recorded = cassette.read_bytes()
    monkeypatch.setenv("ANTHROPIC_BASE_URL", stubs["changed"].url)
    result = run(pytester, "--deja-record-mode=all", "--dry-run")  # theirs: deja records
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["their dry run: True", "*deja: cassettes written*"])
    assert "deja drift" not in result.stdout.str()
    assert cassette.read_bytes() != recorded and load(cassette).verified

    cassette.write_bytes(recorded)
    result = run(pytester, "--deja-record-mode=all", "--deja-dry-run")  # deja's own
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["their dry run: False", "*= deja drift =*",
                                 "*cassettes/agent.jsonl: changed at step 3*"])
    assert cassette.read_bytes() == recorded
