"""The circuit breaker: failures within a minute open it, one probe after the cooldown, and
the SDK's retries counted; on the fake clock of guard_helpers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import guard_helpers
import pytest
from guard_agents.chatty import ask, client
from guard_helpers import FakeClock, controls, end_of, kinds

import recorder
import replayer
from recorder import BreakerSettings, CircuitOpen
from recorder.harness.guards import Breaker, is_failure

# Fixtures shared by the test_guards files.
breaker_clock = guard_helpers.breaker_clock


# ------------------------------------------------------------------------------ breaker


def test_breaker_opens_on_the_fifth_failure_within_sixty_seconds() -> None:
    clock = FakeClock()
    b = Breaker("api", BreakerSettings(), clock)
    for _ in range(4):
        b.record(True)
        clock.advance(14.9)
        assert b.allow() == (True, {}) and b.state == "closed"
    b.record(True)  # the fifth, 59.6 s after the first
    assert b.state == "open"
    allowed, detail = b.allow()
    assert not allowed and detail["state"] == "open" and detail["retry_in_s"] == 30


def test_breaker_does_not_open_on_failures_spread_over_five_minutes() -> None:
    clock = FakeClock()
    b = Breaker("api", BreakerSettings(), clock)
    for _ in range(5):
        b.record(True)
        clock.advance(75)
    assert b.state == "closed" and b.allow()[0]
    for _ in range(5):  # the same five within a minute: open
        b.record(True)
    assert b.state == "open"
    # four in the window and one just outside it: still closed
    b2 = Breaker("api", BreakerSettings(), clock)
    for step in (0, 15, 15, 15, 15.1):
        clock.advance(step)
        b2.record(True)
    assert b2.state == "closed"


def test_breaker_lets_exactly_one_probe_through_after_the_cooldown() -> None:
    clock = FakeClock()
    b = Breaker("api", BreakerSettings(), clock)
    for _ in range(5):
        b.record(True)
    clock.advance(29.999)
    assert not b.allow()[0]
    clock.advance(0.001)
    barrier = threading.Barrier(50)
    results: list[bool] = []
    lock = threading.Lock()

    def caller() -> None:
        barrier.wait()
        allowed, _ = b.allow()
        with lock:
            results.append(allowed)

    threads = [threading.Thread(target=caller) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 50 and results.count(True) == 1
    assert b.state == "half_open" and not b.allow()[0]  # the probe is still out


def test_breaker_probe_success_closes_it() -> None:
    clock = FakeClock()
    b = Breaker("api", BreakerSettings(), clock)
    for _ in range(5):
        b.record(True)
    clock.advance(30)
    assert b.allow() == (True, {"probe": True})
    b.record(False)
    assert b.state == "closed"
    assert all(b.allow()[0] for _ in range(10))
    for _ in range(4):  # the old failures are forgotten: four new ones do not open it
        b.record(True)
    assert b.state == "closed"


def test_breaker_probe_failure_reopens_it() -> None:
    clock = FakeClock()
    b = Breaker("api", BreakerSettings(), clock)
    for _ in range(5):
        b.record(True)
    clock.advance(31)
    assert b.allow()[0]
    b.record(True)
    assert b.state == "open"
    allowed, detail = b.allow()
    assert not allowed and detail["retry_in_s"] == 30  # a fresh cooldown
    clock.advance(30)
    assert b.allow() == (True, {"probe": True})


@pytest.mark.parametrize(("status", "counts"), [
    (400, False), (401, False), (403, False), (404, False), (409, False), (413, False),
    (422, False), (200, False), (408, True), (429, True), (500, True), (502, True),
    (503, True), (529, True)])
def test_breaker_counts_5xx_408_429_but_not_other_4xx(status: int, counts: bool) -> None:
    assert is_failure(status, None) is counts
    clock = FakeClock()
    b = Breaker("api", BreakerSettings(), clock)
    for _ in range(10):
        b.record(is_failure(status, None))
    assert b.state == ("open" if counts else "closed")
    for _ in range(5):
        b.record(is_failure(503, None))
    assert b.state == "open"


def test_breaker_counts_transport_errors() -> None:
    assert is_failure(None, ConnectionResetError("reset"))
    assert not is_failure(None, None)


def fail_turn(status: int) -> dict[str, Any]:
    if status == 0:
        return {"drop": "before_headers"}
    return {"error": {"status": status, "should_retry": False}}


@pytest.mark.parametrize("status", [529, 500, 429, 408, 0])  # 0: the connection drops
def test_breaker_end_to_end_the_sixth_call_fails_fast(stub, breaker_clock: FakeClock,
                                                      tmp_path: Path, status: int) -> None:
    server = stub({"turns": [fail_turn(status)] * 5, "default": {"text": "ok"}})
    path = tmp_path / "breaker.jsonl"

    def agent(advance: Callable[[float], None]) -> None:
        once = client(server.url)  # max_retries=0: one attempt a call
        for i in range(5):
            with pytest.raises(anthropic.APIError) as failed:
                ask(once, i)
            assert not isinstance(failed.value, recorder.DejaError)
        # A client that would retry: CircuitOpen reaches the agent at once, unwrapped.
        retrying = anthropic.Anthropic(base_url=server.url, api_key="sk-stub", max_retries=3,
                                       timeout=30)
        started = time.monotonic()
        with pytest.raises(CircuitOpen) as raised:
            ask(retrying, 5)
        assert time.monotonic() - started < 1.0  # fast: no SDK retry, no backoff
        assert not isinstance(raised.value, anthropic.APIConnectionError)
        advance(29)
        with pytest.raises(CircuitOpen):
            ask(retrying, 6)
        advance(1)
        assert ask(retrying, 7).content[0].text == "ok"  # the probe; its success closes it
        assert ask(retrying, 8).content[0].text == "ok"

    sent: list[int] = []

    def advance(seconds: float) -> None:
        sent.append(len(server.requests))  # while open, the stub's count does not move
        breaker_clock.advance(seconds)

    with recorder.record(path):
        agent(advance)
    assert sent == [5, 5]
    assert len(server.requests) == 7
    opened = controls(path)
    assert [s["event"] for s in opened] == ["circuit_open", "circuit_open"]
    assert opened[0]["detail"]["state"] == "open"
    assert opened[0]["detail"]["retry_in_s"] == 30 and opened[1]["detail"]["retry_in_s"] == 1
    assert end_of(path)["status"] == "completed"  # the agent handled it; the run went on
    assert end_of(path)["totals"]["model_calls"] == 7

    # The replay raises CircuitOpen at the same two calls, with no breaker and no clock.
    run = replayer.replay(path)
    with run:
        agent(lambda seconds: None)
    assert run.result is not None and run.result.identical, run.result.report()
    assert run.result.steps_served == run.result.steps_recorded == 9


@pytest.mark.parametrize("status", [400, 404, 422])
def test_breaker_end_to_end_client_errors_do_not_open_it(stub, tmp_path: Path,
                                                         status: int) -> None:
    server = stub({"turns": [fail_turn(status)] * 8 + [fail_turn(503)] * 5,
                   "default": {"text": "ok"}})
    c = client(server.url)
    with recorder.record(tmp_path / "4xx.jsonl"):
        for i in range(8):
            with pytest.raises(anthropic.APIStatusError):
                ask(c, i)
        for i in range(8, 13):  # five 503s after them do open it
            with pytest.raises(anthropic.InternalServerError):
                ask(c, i)
        with pytest.raises(CircuitOpen):
            ask(c, 13)
    assert len(server.requests) == 13


def test_breaker_counts_every_sdk_retry_and_stops_the_storm(stub, tmp_path: Path) -> None:
    # 529s the SDK would retry ten times (after 1 ms each); the breaker opens on the fifth
    # attempt and the sixth fails fast inside the same create() call.
    server = stub({"turns": [], "default": {"error": {"status": 529, "retry_after": 0.001}}})
    c = anthropic.Anthropic(base_url=server.url, api_key="sk-stub", max_retries=10)
    path = tmp_path / "storm.jsonl"
    with pytest.raises(CircuitOpen), recorder.record(path):
        ask(c, 0)
    assert len(server.requests) == 5
    assert kinds(path)[1:] == ["model"] * 5 + ["control", "end"]  # every attempt recorded
    assert end_of(path)["status"] == "stopped"


def test_breaker_is_shared_by_runs_in_the_process(stub, tmp_path: Path) -> None:
    server = stub({"turns": [fail_turn(529)] * 5, "default": {"text": "ok"}})
    c = client(server.url)
    with recorder.record(tmp_path / "first.jsonl"):
        for i in range(5):
            with pytest.raises(anthropic.APIStatusError):
                ask(c, i)
    with pytest.raises(CircuitOpen), recorder.record(tmp_path / "second.jsonl"):
        ask(c, 0)
    assert len(server.requests) == 5
    # breaker=False opts a run out
    with recorder.record(tmp_path / "third.jsonl", breaker=False):
        assert ask(c, 0).content[0].text == "ok"
