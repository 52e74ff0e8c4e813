"""The pytest plugin: @pytest.mark.deja replays a test against a cassette."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import recorder
from recorder.testing.server import StubServer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import retry_spiral  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from count_agent import SCRIPT  # noqa: E402


@pytest.fixture
def example_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_OLD_KEYS", "deja-example-key")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")  # nothing listens here


@pytest.mark.deja("cassettes/retry_spiral.jsonl")
def test_marked_test_replays_the_incident(example_key: None, deja_session: recorder.Session,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert deja_session.mode == "replay"
    assert retry_spiral.main() == 0
    out = capsys.readouterr().out
    assert out.count("search failed: malformed response") == 4


def test_a_marked_test_that_diverges_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(f"""
        import sys, pytest
        sys.path.insert(0, {str(ROOT / "examples")!r})
        import retry_spiral

        @pytest.fixture
        def example_key(monkeypatch):
            monkeypatch.setenv("DEJA_OLD_KEYS", "deja-example-key")

        @pytest.mark.deja({str(ROOT / "cassettes" / "retry_spiral.jsonl")!r})
        def test_changed(example_key, monkeypatch):
            monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
            monkeypatch.setattr(retry_spiral, "MAX_TURNS", 2)
            retry_spiral.main()
    """)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*replay of r_*DIVERGED*",
                                 "*divergence: step 4 (model): the run ended before*"])


def _unverified_project(pytester: pytest.Pytester, marker_kwargs: str = "") -> None:
    """A test replaying the example cassette on a machine without the example key."""
    pytester.makepyfile(f"""
        import sys, pytest
        sys.path.insert(0, {str(ROOT / "examples")!r})
        import retry_spiral

        @pytest.mark.deja({str(ROOT / "cassettes" / "retry_spiral.jsonl")!r}{marker_kwargs})
        def test_incident(monkeypatch):
            monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
            assert retry_spiral.main() == 0
    """)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")


def test_a_cassette_this_machine_cannot_verify_fails_the_test(
        pytester: pytest.Pytester) -> None:
    _unverified_project(pytester)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*UnverifiedCassette*not one of this machine's keys*"])


@pytest.mark.parametrize("how", ["flag", "marker", "env"])
def test_unverified_replay_when_allowed_is_listed_at_the_end(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    _unverified_project(pytester, ", allow_unverified=True" if how == "marker" else "")
    if how == "env":
        monkeypatch.setenv("DEJA_ALLOW_UNVERIFIED", "1")
    args = ["-p", "no:cacheprovider", *(["--deja-allow-unverified"] if how == "flag" else [])]
    result = pytester.runpytest_inprocess(*args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*deja: cassettes replayed NOT VERIFIED*",
                                 "*test_incident: NOT VERIFIED: it is signed with key*",
                                 "*prove nothing about what was recorded*"])


# -- recording rules, the recorded command, and a divergence as deja's report


def _agent_project(pytester: pytest.Pytester, marker_kwargs: str = "") -> Path:
    """A project with the count agent and a test of it; returns its cassette's path."""
    pytester.makepyfile(agent=(ROOT / "tests" / "count_agent.py").read_text())
    pytester.makepyfile(test_agent=f"""
        import pytest
        import agent

        @pytest.mark.deja("cassettes/agent.jsonl"{marker_kwargs})
        def test_agent():
            assert agent.main() == 0
    """)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    return pytester.path / "cassettes" / "agent.jsonl"


def _pytest(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


@pytest.fixture
def live(stub: Callable[[dict], StubServer], monkeypatch: pytest.MonkeyPatch) -> StubServer:
    server = stub(SCRIPT)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    return server


def test_deja_record_records_only_new_cassettes(pytester: pytest.Pytester,
                                                live: StubServer) -> None:
    cassette = _agent_project(pytester)
    # replay only (the default in CI): no cassette, nothing to replay
    _pytest(pytester, "--deja-record-mode=none").assert_outcomes(errors=1)
    assert not cassette.exists()

    _pytest(pytester, "--deja-record").assert_outcomes(passed=1)
    header = json.loads(cassette.read_text().splitlines()[0])
    assert header["argv"] == ["python", "-m", "pytest", "test_agent.py::test_agent"]
    assert "--deja-record" not in json.dumps(header)
    recorded = cassette.read_bytes()
    assert b'"kind":"model"' in recorded and b'"status":"completed"' in recorded

    _pytest(pytester, "--deja-record").assert_outcomes(passed=1)  # exists: replayed
    assert cassette.read_bytes() == recorded
    _pytest(pytester).assert_outcomes(passed=1)

    _pytest(pytester, "--deja-rerecord").assert_outcomes(passed=1)  # asked for: anew
    assert json.loads(cassette.read_text().splitlines()[0])["run"] != header["run"]


def test_a_record_false_cassette_is_never_written_by_a_flag(pytester: pytest.Pytester,
                                                           live: StubServer) -> None:
    cassette = _agent_project(pytester, ", record=False")
    result = _pytest(pytester, "--deja-record")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*agent.jsonl does not exist, and the test is marked "
                                 "record=False*"])
    assert not cassette.exists()

    _agent_project(pytester)  # recorded once as an ordinary test...
    _pytest(pytester, "--deja-record").assert_outcomes(passed=1)
    incident = cassette.read_bytes()
    _agent_project(pytester, ", record=False")  # ...then kept as an incident
    for flag in ("--deja-record", "--deja-rerecord"):
        _pytest(pytester, flag).assert_outcomes(passed=1)
        assert cassette.read_bytes() == incident


def test_a_cassette_recorded_by_pytest_replays_with_deja_replay(pytester: pytest.Pytester,
                                                                live: StubServer) -> None:
    cassette = _agent_project(pytester)
    _pytest(pytester, "--deja-record").assert_outcomes(passed=1)
    proc = subprocess.run([sys.executable, "-m", "deja", "replay", str(cassette)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ANTHROPIC_BASE_URL": "http://127.0.0.1:9"},
                          cwd=cassette.parent.parent.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ": identical" in proc.stdout and "1 passed" in proc.stdout


def test_a_divergence_fails_the_test_with_deja_report_only(
        pytester: pytest.Pytester, live: StubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    _agent_project(pytester)
    _pytest(pytester, "--deja-record").assert_outcomes(passed=1)
    monkeypatch.setenv("AGENT_PROMPT", "Find the token refresh code.")
    monkeypatch.delenv("BUILD_NUMBER", raising=False)
    for on_ci in ("", "1"):  # on CI pytest's short summary does not trim a message
        monkeypatch.setenv("CI", on_ci)
        result = _pytest(pytester)
        result.assert_outcomes(failed=1)
        text = result.stdout.str() + result.stderr.str()
        assert text.count("--- recorded") == 1 and text.count("+++ replayed") == 1, on_ci
        assert text.count("Find the token refresh code.") == 1, on_ci  # the diff, once
        summary = r"FAILED test_agent.py::test_agent - Failed: replay of r_\w+ " + (
            ".*DIVERGED$" if on_ci else "")  # off CI, trimmed to the terminal's width
        assert re.search(summary, text, re.M), text
    assert "DIVERGED" in text and "divergence: step 0 (model)" in text
    assert "Traceback" not in text and "_base_client" not in text and "anthropic/" not in text
    assert "pytest --deja-rerecord" in text  # what to do next
