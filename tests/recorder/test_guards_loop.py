"""The loop guard: the same tool call repeated within a window stops the run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import guard_helpers
import pytest
from guard_helpers import assert_replay_stops_the_same, controls, end_of

import recorder
from recorder import ConfigError, LoopDetected, LoopSettings
from recorder.harness.guards import LoopWatch

# Fixtures shared by the test_guards files.
breaker_clock = guard_helpers.breaker_clock


# ------------------------------------------------------------------------------ loop guard


def watch(**settings: Any) -> Callable[..., dict[str, Any] | None]:
    w = LoopWatch(LoopSettings(**settings))
    return lambda name, args=None: w.check(name, args if args is not None else {})


def test_loop_arguments_differing_only_in_key_order_are_the_same_call() -> None:
    check = watch()
    assert check("search", {"query": "x", "limit": 5, "opts": {"a": 1, "b": 2}}) is None
    assert check("search", {"opts": {"b": 2, "a": 1}, "limit": 5, "query": "x"}) is None
    loop = check("search", {"limit": 5, "opts": {"a": 1, "b": 2}, "query": "x"})
    assert loop is not None and loop["pattern"] == "repeat" and loop["times"] == 3
    # A different value is a different call; so is a different tool.
    check = watch()
    assert check("search", {"query": "x"}) is None
    assert check("search", {"query": "y"}) is None
    assert check("grep", {"query": "x"}) is None
    assert check("search", {"query": "X"}) is None


def test_loop_an_a_b_a_b_alternation_is_caught() -> None:
    check = watch()
    assert [check("a"), check("b"), check("a")] == [None, None, None]
    loop = check("b")
    assert loop is not None and loop["pattern"] == "alternation" and loop["tool"] == "b"
    # Without alternation detection the same calls pass (2 of each: under the repeats).
    check = watch(alternation=False)
    assert [check(n) for n in "abab"] == [None] * 4


def test_loop_two_repeats_within_the_window_are_fine() -> None:
    check = watch()
    assert [check("a"), check("a")] == [None, None]
    assert check("a") is not None  # the third is caught
    check = watch()
    assert [check(n) for n in "axayb"] == [None] * 5  # a twice, never three times


def test_loop_three_repeats_within_the_last_five_calls_are_caught() -> None:
    check = watch()
    assert [check(n) for n in "axay"] == [None] * 4
    loop = check("a")  # a, x, a, y, a: three of the last five
    assert loop is not None and loop["pattern"] == "repeat" and loop["window"] == 5


def test_loop_the_same_call_spread_beyond_the_window_is_fine() -> None:
    check = watch()
    # a at calls 1, 4 and 6: three a's, but never three within any five consecutive calls
    assert [check(n) for n in "axyazabcdaefga"] == [None] * 14
    # the same three a's squeezed into five calls are caught
    check = watch()
    assert [check(n) for n in "axya"] == [None] * 4
    assert check("a") is not None


def test_loop_thresholds_are_configurable() -> None:
    check = watch(repeats=4, window=6, alternation=False)
    assert [check("a") for _ in range(3)] == [None] * 3
    loop = check("a")
    assert loop is not None and loop["times"] == 4
    check = watch(repeats=2, window=2)
    assert check("a") is None and check("a") is not None
    with pytest.raises(ConfigError, match="repeats"):
        LoopSettings(repeats=1)
    with pytest.raises(ConfigError, match="window"):
        LoopSettings(repeats=4, window=3)


def test_loop_guard_false_disables_it() -> None:
    guard = LoopSettings.of(False)
    assert not guard.enabled
    w = LoopWatch(guard)
    assert [w.check("a", {}) for _ in range(10)] == [None] * 10
    w = LoopWatch(LoopSettings.of(None))  # the default, for contrast
    assert [w.check("a", {}) for _ in range(3)][-1] is not None


@pytest.mark.parametrize(("loop_guard", "allowed"), [(None, 2), ({"repeats": 4}, 3),
                                                     (False, 8)])
def test_loop_guard_in_a_recorded_run(tmp_path: Path, loop_guard: Any, allowed: int) -> None:
    ran: list[int] = []

    @recorder.tool
    def search(query: str, limit: int) -> str:
        ran.append(limit)
        return "nothing"

    path = tmp_path / "loop.jsonl"
    with recorder.record(path, loop_guard=loop_guard):
        try:
            for i in range(8):
                search(**({"query": "q", "limit": 1} if i % 2 else {"limit": 1, "query": "q"}))
        except LoopDetected as exc:
            assert exc.detail["pattern"] == "repeat"
    assert len(ran) == allowed
    end = end_of(path)
    if allowed == 8:
        assert end["status"] == "completed" and controls(path) == []
    else:
        assert end["status"] == "stopped" and end["reason"] == "loop_detected"
        (stop,) = controls(path)
        assert stop["event"] == "loop_detected" and stop["detail"]["times"] == allowed + 1

        def agent(calls: list[int]) -> None:
            for i in range(8):
                calls.append(i)
                search(query="q", limit=1)

        assert_replay_stops_the_same(path, agent, LoopDetected, allowed, steps=allowed + 1)
        assert len(ran) == allowed  # no tool body ran during the replay
