"""What the test_guards files share: the stub script, a fake clock for the breakers, and
checks of what a stopped run wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from conftest import read_lines
from guard_agents.chatty import ask

import replayer
from recorder.harness.guards import BREAKERS

ROOT = Path(__file__).resolve().parents[2]
CHATTY = Path(__file__).resolve().parents[1] / "guard_agents" / "chatty.py"
USAGE = {"input_tokens": 100, "output_tokens": 20}  # 120 tokens a turn
SCRIPT = {"turns": [], "default": {"text": "ok", "usage": USAGE}}
STOP_EVENTS = ("budget_exhausted", "cancelled", "loop_detected", "circuit_open")
STATUS_FIELDS = ("run_id", "status", "turn", "turn_limit", "step", "elapsed_s", "budget_s",
                 "tokens", "token_limit", "spend_usd", "dollar_limit", "artefacts", "cancel")


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def breaker_clock() -> Iterator[FakeClock]:
    """Every test gets empty breakers on a fake clock; both are restored afterwards."""
    saved = BREAKERS.clock
    clock = FakeClock()
    BREAKERS.clock = clock
    BREAKERS.reset()
    yield clock
    BREAKERS.clock = saved
    BREAKERS.reset()


# ------------------------------------------------------------------------------ helpers


def chat(c: anthropic.Anthropic, n: int, calls: list[int] | None = None, *,
         between: Callable[[], None] | None = None, max_tokens: int = 64) -> None:
    """``n`` model calls; ``calls`` collects the index of each call as it is attempted."""
    for i in range(n):
        if calls is not None:
            calls.append(i)
        ask(c, i, max_tokens)
        if between is not None:
            between()


def controls(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    return [line for line in read_lines(path)
            if line.get("kind") == "control" and event in (None, line.get("event"))]


def kinds(path: Path) -> list[str]:
    return [line.get("kind", "header") for line in read_lines(path)]


def end_of(path: Path) -> dict[str, Any]:
    last = read_lines(path)[-1]
    assert last["kind"] == "end", last
    return last


def assert_stopped(path: Path, *, budget: str, used: Any, limit: Any, models: int) -> None:
    """The cassette: ``models`` model lines, then the budget's control line, then the end."""
    assert kinds(path)[1:] == ["model"] * models + ["control", "end"]
    (stop,) = controls(path)
    assert stop["event"] == "budget_exhausted"
    assert stop["detail"]["budget"] == budget
    assert stop["detail"]["used"] == pytest.approx(used)
    assert stop["detail"]["limit"] == pytest.approx(limit)
    assert stop["detail"]["before"].startswith("model call POST")
    end = end_of(path)
    assert end["status"] == "exhausted"
    assert end["reason"] == f"{budget}_budget"
    assert end["error"]["type"] == "BudgetExhausted"
    assert end["error"]["message"] == stop["detail"]["message"]  # what the agent was told


def assert_replay_stops_the_same(path: Path, agent: Callable[[list[int]], None],
                                 error: type[Exception], at_call: int,
                                 steps: int) -> Exception:
    """Replaying ``path`` raises ``error`` at call ``at_call``, every step consumed."""
    calls: list[int] = []
    run = replayer.replay(path)
    with run, pytest.raises(error) as raised:
        agent(calls)
    assert calls[-1] == at_call
    stop = [c for c in controls(path) if c["event"] in STOP_EVENTS][-1]
    assert str(raised.value) == f"{stop['detail']['message']} [replayed from seq {stop['seq']}]"
    assert not isinstance(raised.value, anthropic.APIConnectionError)
    result = run.result
    assert result is not None
    assert result.identical, result.report()
    assert result.steps_served == result.steps_recorded == steps
    assert result.unused == ()
    return raised.value


def deja(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=ROOT, timeout=60)
