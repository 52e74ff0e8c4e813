"""The pytest plugin: @pytest.mark.deja replays a test against a cassette."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import recorder

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import retry_spiral  # noqa: E402


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
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Divergence*"])


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
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*UnverifiedCassette*not one of this machine's keys*"])


@pytest.mark.parametrize("how", ["flag", "marker", "env"])
def test_unverified_replay_when_allowed_is_listed_at_the_end(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    _unverified_project(pytester, ", allow_unverified=True" if how == "marker" else "")
    if how == "env":
        monkeypatch.setenv("DEJA_ALLOW_UNVERIFIED", "1")
    args = ["-p", "no:cacheprovider", *(["--deja-allow-unverified"] if how == "flag" else [])]
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*deja: cassettes replayed NOT VERIFIED*",
                                 "*test_incident: NOT VERIFIED: it is signed with key*",
                                 "*prove nothing about what was recorded*"])
