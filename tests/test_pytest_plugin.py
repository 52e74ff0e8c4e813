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

        @pytest.mark.deja({str(ROOT / "cassettes" / "retry_spiral.jsonl")!r})
        def test_changed(monkeypatch):
            monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
            monkeypatch.setattr(retry_spiral, "MAX_TURNS", 2)
            retry_spiral.main()
    """)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Divergence*"])
