"""Acceptance tests of the harness guards: budgets, cancel, loop guard, circuit breaker,
configuration, and what a replay or a resume makes of their decisions.

The real anthropic SDK talks to the stub server; cassettes, status records and cancel
flags are real files; cross-process behaviour (``deja record``, ``deja status``, ``deja
cancel``) runs real processes. Time is never waited for: the wall-clock budget takes an
injected clock (``record(clock=...)``) and the circuit breaker's process-wide registry a
replaceable one (``BREAKERS.clock``), both fake here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from click.testing import CliRunner
from conftest import MODEL, read_lines
from guard_agents.chatty import ask, client

import recorder
import replayer
from deja.cli import main as cli
from recorder import (
    BreakerSettings,
    BudgetExhausted,
    Budgets,
    Cancelled,
    CircuitOpen,
    ConfigError,
    LoopDetected,
    LoopGuard,
)
from recorder.harness.guards import BREAKERS, Breaker, LoopWatch, is_failure
from recorder.harness.progress import read_status, request_cancel
from recorder.pricing import PriceTable

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


# ------------------------------------------------------------------------------ budgets


def test_turn_budget_refuses_the_fourth_call_before_it_is_sent(stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "turns.jsonl"
    calls: list[int] = []
    with pytest.raises(BudgetExhausted) as raised, \
            recorder.record(path, budgets={"turns": 3}) as rec:
        chat(client(server.url), 10, calls)
    assert len(server.requests) == 3
    assert calls == [0, 1, 2, 3]  # the 4th call was refused
    exc = raised.value
    assert not isinstance(exc, anthropic.APIConnectionError)  # reached the agent as itself
    assert exc.end_status == "exhausted"
    assert exc.detail["budget"] == "turns" and exc.detail["used"] == exc.detail["limit"] == 3
    assert "turns budget exhausted (3 of 3)" in str(exc)
    assert_stopped(path, budget="turns", used=3, limit=3, models=3)
    assert end_of(path)["totals"]["model_calls"] == 3
    status = read_status(rec.run_id)
    assert status is not None and status["status"] == "exhausted" and status["ended"]

    replayed = assert_replay_stops_the_same(
        path, lambda calls: chat(client(server.url), 10, calls), BudgetExhausted, 3, steps=4)
    assert replayed.detail["budget"] == "turns" and replayed.detail["used"] == 3


@pytest.mark.parametrize(("limit", "sent"), [(300, 3), (240, 2), (241, 3), (120, 1)])
def test_token_budget_stops_at_the_first_call_after_the_total_reaches_it(
        stub, tmp_path: Path, limit: int, sent: int) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "tokens.jsonl"
    calls: list[int] = []
    with pytest.raises(BudgetExhausted), recorder.record(path, budgets={"tokens": limit}):
        chat(client(server.url), 10, calls)
    assert len(server.requests) == sent == calls[-1]
    used = sent * 120
    assert used >= limit and used - limit < 120  # overshoot: at most the one call in flight
    assert_stopped(path, budget="tokens", used=used, limit=limit, models=sent)
    assert_replay_stops_the_same(path, lambda calls: chat(client(server.url), 10, calls),
                                 BudgetExhausted, sent, steps=sent + 1)


@pytest.mark.parametrize(("prices", "limit", "sent"), [
    (None, 1.0, 3),                       # the built-in table: $3 / $15 per million
    ({MODEL: [30.0, 150.0]}, 5.0, 2),     # an override: ten times the price
])
def test_dollar_budget_counts_spend_from_the_price_table(
        stub, tmp_path: Path, prices: dict | None, limit: float, sent: int) -> None:
    usage = {"input_tokens": 100_000, "output_tokens": 10_000}
    server = stub({"turns": [], "default": {"text": "ok", "usage": usage}})
    per_call = PriceTable(prices).cost(MODEL, usage)
    assert per_call == pytest.approx(0.45 if prices is None else 4.5)
    path = tmp_path / "dollars.jsonl"
    with pytest.raises(BudgetExhausted), \
            recorder.record(path, budgets={"dollars": limit}, prices=prices):
        chat(client(server.url), 10)
    assert len(server.requests) == sent
    assert sent * per_call >= limit > (sent - 1) * per_call
    assert_stopped(path, budget="dollars", used=sent * per_call, limit=limit, models=sent)
    models = [o for o in recorder.load(path).observations if o["kind"] == "model"]
    assert [m["cost_usd"] for m in models] == pytest.approx([per_call] * sent)
    assert_replay_stops_the_same(path, lambda calls: chat(client(server.url), 10, calls),
                                 BudgetExhausted, sent, steps=sent + 1)


def test_dollar_budget_with_an_unpriced_model_is_refused_before_anything_is_sent(
        stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    c = client(server.url)
    with pytest.raises(ConfigError) as raised, \
            recorder.record(tmp_path / "unpriced.jsonl", budgets={"dollars": 5.0}):
        c.messages.create(model="acme-unpriced-1", max_tokens=64,
                          messages=[{"role": "user", "content": "hi"}])
    assert server.requests == []
    assert "acme-unpriced-1" in str(raised.value) and "no price" in str(raised.value)
    assert not isinstance(raised.value, anthropic.APIConnectionError)
    # A price for it makes the same run go through.
    with recorder.record(tmp_path / "priced.jsonl", budgets={"dollars": 5.0},
                         prices={"acme-unpriced": [1.0, 2.0]}):
        c.messages.create(model="acme-unpriced-1", max_tokens=64,
                          messages=[{"role": "user", "content": "hi"}])
    assert len(server.requests) == 1


def test_wall_clock_budget_uses_the_injected_clock(stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    clock = FakeClock()
    path = tmp_path / "seconds.jsonl"
    calls: list[int] = []
    started = time.monotonic()
    with pytest.raises(BudgetExhausted), \
            recorder.record(path, budgets={"seconds": 10}, clock=clock):
        # calls at 0, 4 and 8 s go out; the one at 12 s is refused
        chat(client(server.url), 10, calls, between=lambda: clock.advance(4))
    assert time.monotonic() - started < 5  # nothing waited for the budget
    assert calls == [0, 1, 2, 3]
    assert len(server.requests) == 3
    assert_stopped(path, budget="seconds", used=12.0, limit=10.0, models=3)
    # The replay needs no clock: the decision is in the cassette.
    assert_replay_stops_the_same(path, lambda calls: chat(client(server.url), 10, calls),
                                 BudgetExhausted, 3, steps=4)


def test_max_tokens_ceiling_refuses_a_larger_request_before_it_is_sent(
        stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "ceiling.jsonl"
    c = client(server.url)
    with recorder.record(path, budgets={"max_tokens": 8192}), \
            pytest.raises(BudgetExhausted) as raised:
        ask(c, 0, max_tokens=50_000)
    assert server.requests == []
    assert raised.value.detail == {"budget": "max_tokens", "used": 50_000, "limit": 8192,
                                   "before": raised.value.detail["before"]}
    assert_stopped(path, budget="max_tokens", used=50_000, limit=8192, models=0)

    # At the ceiling is fine; over it is refused.
    server2 = stub(SCRIPT)
    path2 = tmp_path / "ceiling2.jsonl"
    with pytest.raises(BudgetExhausted), recorder.record(path2, budgets={"max_tokens": 8192}):
        ask(client(server2.url), 0, max_tokens=8192)
        ask(client(server2.url), 1, max_tokens=8193)
    assert [r["body"]["max_tokens"] for r in server2.requests] == [8192]

    def agent(calls: list[int]) -> None:
        calls.append(0)
        ask(client(server.url), 0, max_tokens=50_000)

    assert_replay_stops_the_same(path, agent, BudgetExhausted, 0, steps=1)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_clamp_sends_the_ceiling_and_stores_the_original_request(
        stub, tmp_path: Path, stream: bool) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "clamp.jsonl"

    def agent(calls: list[int]) -> None:
        c = client(server.url)
        calls.append(0)
        if stream:
            with c.messages.stream(model=MODEL, max_tokens=50_000,
                                   messages=[{"role": "user", "content": "turn 0"}]) as s:
                assert s.get_final_message().content[0].text == "ok"
        else:
            assert ask(c, 0, max_tokens=50_000).content[0].text == "ok"
        calls.append(1)
        ask(c, 1, max_tokens=100)  # under the ceiling: untouched

    with recorder.record(path, budgets={"max_tokens": 8192, "max_tokens_mode": "clamp"}):
        agent([])
    assert [r["body"]["max_tokens"] for r in server.requests] == [8192, 100]
    assert kinds(path)[1:] == ["control", "model", "model", "end"]
    (clamped,) = controls(path)
    assert clamped["event"] == "max_tokens_clamped"
    assert clamped["detail"] == {"asked": 50_000, "limit": 8192}
    assert end_of(path)["status"] == "completed"
    cassette = recorder.load(path)
    first, second = (o for o in cassette.observations if o["kind"] == "model")
    assert cassette.request_of(first["seq"])["max_tokens"] == 50_000  # what the agent asked
    assert first["clamped_max_tokens"] == 8192
    assert cassette.request_of(second["seq"])["max_tokens"] == 100
    assert "clamped_max_tokens" not in second

    run = replayer.replay(path)
    with run:
        agent([])
    assert run.result is not None and run.result.identical, run.result.report()


def test_an_agent_that_catches_the_stop_still_ends_exhausted(stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "caught.jsonl"
    with recorder.record(path, budgets={"turns": 2}) as rec:
        try:
            chat(client(server.url), 10)
        except BudgetExhausted:
            pass  # the agent carries on as if nothing happened and returns normally
    assert len(server.requests) == 2
    end = end_of(path)
    assert end["status"] == "exhausted" and end["reason"] == "turns_budget"
    assert rec.end is not None and rec.end["status"] == "exhausted"
    status = read_status(rec.run_id)
    assert status is not None and status["status"] == "exhausted"


# ------------------------------------------------------------------------------ cancel


def deja(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=ROOT, timeout=60)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def header_run(path: Path) -> str | None:
    try:
        first = path.read_text().split("\n", 1)
    except FileNotFoundError:
        return None
    return json.loads(first[0])["run"] if len(first) == 2 else None


def test_cancel_from_another_process_stops_the_run_at_the_next_boundary(
        stub, tmp_path: Path) -> None:
    server = stub({"turns": [], "default": {"text": "ok", "usage": USAGE, "delay_ms": 20}})
    path = tmp_path / "cancel.jsonl"
    log = tmp_path / "agent.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deja", "record", "-o", str(path), "--max-turns", "5000",
             "--", "python", str(CHATTY)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "ANTHROPIC_BASE_URL": server.url}, start_new_session=True)
    try:
        run = wait_for("the cassette header", lambda: header_run(path))
        wait_for("two turns", lambda: (read_status(run) or {}).get("turn", 0) >= 2)

        shown = deja("status", run, "--json")
        assert shown.returncode == 0, shown.stderr
        live = json.loads(shown.stdout)
        assert live["status"] == "running", live
        assert set(STATUS_FIELDS) <= set(live), sorted(set(STATUS_FIELDS) - set(live))
        assert live["run_id"] == run
        assert live["turn"] >= 2 and live["turn_limit"] == 5000
        assert live["budget_s"] == 3600 and live["elapsed_s"] > 0
        assert live["tokens"] == 120 * live["turn"] and live["token_limit"] is None
        per_turn = PriceTable().cost(MODEL, USAGE)
        assert live["spend_usd"] == pytest.approx(per_turn * live["turn"])
        assert live["dollar_limit"] is None
        assert live["artefacts"] == [str(path.resolve())]
        assert live["cancel"] == f"deja cancel {run}"
        assert isinstance(live["step"], str) and live["step"]
        assert "ended" not in live

        cancelled = deja("cancel", run, "--reason", "wrong input file")
        sent_at_cancel = len(server.requests)
        assert cancelled.returncode == 0, cancelled.stderr
        assert proc.wait(timeout=30) == 0  # the agent caught Cancelled and returned 0
    finally:
        if proc.poll() is None:  # a failure above: stop deja record and the agent under it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    assert "stopped: Cancelled" in log.read_text()
    lines = read_lines(path)
    models = [line for line in lines if line.get("kind") == "model"]
    assert len(server.requests) == len(models)  # every request is in the cassette
    assert len(models) <= sent_at_cancel + 1  # at most the one in flight at the flag
    (stop,) = controls(path)
    assert stop["event"] == "cancelled"
    assert stop["detail"]["reason"] == "wrong input file"
    assert stop["detail"]["before"].startswith("model call POST")
    assert [line.get("kind") for line in lines[1:]][-2:] == ["control", "end"]  # nothing after
    end = lines[-1]
    assert end["status"] == "cancelled" and end["reason"] == "cancelled"
    assert end["exit_code"] == 0
    assert end["totals"]["model_calls"] == len(models)
    assert_replay_stops_the_same(path, lambda calls: chat(client(server.url), 10**6, calls),
                                 Cancelled, len(models), steps=len(models) + 1)

    after = json.loads(deja("status", run, "--json").stdout)
    assert after["status"] == "cancelled" and after["ended"] is True
    assert after["turn"] == len(models)
    assert after["totals"]["model_calls"] == len(models)

    runner = CliRunner()
    human = runner.invoke(cli, ["status", run])
    assert human.exit_code == 0 and f"run {run}: cancelled" in human.output
    again = runner.invoke(cli, ["cancel", run])
    assert again.exit_code == 2 and "already ended" in again.output
    unknown = runner.invoke(cli, ["cancel", "r_000000000000deadbeef"])
    assert unknown.exit_code == 2 and "no run" in unknown.output
    assert runner.invoke(cli, ["status", "r_000000000000deadbeef"]).exit_code == 2


def test_cancel_is_read_before_a_tool_call_and_the_body_never_runs(stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    ran: list[str] = []

    @recorder.tool
    def lookup(q: str) -> str:
        ran.append(q)
        return q.upper()

    path = tmp_path / "tool.jsonl"
    with pytest.raises(Cancelled), recorder.record(path) as rec:
        ask(client(server.url), 0)
        lookup("a")
        request_cancel(rec.run_id, "enough")
        lookup("b")
    assert ran == ["a"]
    (stop,) = controls(path)
    assert stop["event"] == "cancelled" and stop["detail"]["before"] == "tool lookup"
    assert end_of(path)["status"] == "cancelled"

    def agent(calls: list[int]) -> None:
        calls.append(0)
        ask(client(server.url), 0)
        calls.append(1)
        lookup("a")
        calls.append(2)
        lookup("b")

    assert_replay_stops_the_same(path, agent, Cancelled, 2, steps=3)
    assert ran == ["a"]  # the replay ran no tool body


# ------------------------------------------------------------------------------ loop guard


def watch(**settings: Any) -> Callable[..., dict[str, Any] | None]:
    w = LoopWatch(LoopGuard(**settings))
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
        LoopGuard(repeats=1)
    with pytest.raises(ConfigError, match="window"):
        LoopGuard(repeats=4, window=3)


def test_loop_guard_false_disables_it() -> None:
    guard = LoopGuard.of(False)
    assert not guard.enabled
    w = LoopWatch(guard)
    assert [w.check("a", {}) for _ in range(10)] == [None] * 10
    w = LoopWatch(LoopGuard.of(None))  # the default, for contrast
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


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(("budgets", "words"), [
    ({"turns": -1}, ["turns", "negative"]),
    ({"seconds": -0.5}, ["seconds", "negative"]),
    ({"tokens": "lots"}, ["tokens", "number", "'lots'"]),
    ({"dollars": "5"}, ["dollars", "number"]),
    ({"turns": True}, ["turns", "number"]),
    ({"seconds": float("nan")}, ["seconds", "number"]),
    ({"max_tokens": 1.5}, ["max_tokens", "whole"]),
    ({"turnz": 3}, ["unknown budget", "turnz"]),
    ({"max_tokens_mode": "squash"}, ["max_tokens_mode", "squash"]),
    ([("turns", 3)], ["budgets must be a table"]),
])
def test_bad_budget_is_a_config_error_at_start(stub, tmp_path: Path, budgets: Any,
                                               words: list[str]) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "bad.jsonl"
    with pytest.raises(ConfigError) as raised:
        with recorder.record(path, budgets=budgets):
            ask(client(server.url), 0)
    for word in words:
        assert word in str(raised.value)
    assert not path.exists() and server.requests == []


@pytest.mark.parametrize(("prices", "words"), [
    ({"my-tune": [2.0]}, ["my-tune"]),
    ({"my-tune": "cheap"}, ["my-tune"]),
    ({"my-tune": [2.0, "x"]}, ["my-tune"]),
    ({"my-tune": {"input": 1.0, "outptu": 2.0}}, ["my-tune"]),
    ({"my-tune": [-1.0, 2.0]}, ["my-tune", "negative"]),
])
def test_malformed_price_is_a_config_error_at_start(tmp_path: Path, prices: dict,
                                                    words: list[str]) -> None:
    with pytest.raises(ConfigError) as raised:
        recorder.record(tmp_path / "bad.jsonl", prices=prices)
    for word in words:
        assert word in str(raised.value)


@pytest.fixture
def pyproject(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    """Write a pyproject.toml and point DEJA_CONFIG at it."""
    def write(text: str) -> Path:
        path = tmp_path / "conf" / "pyproject.toml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        monkeypatch.setenv("DEJA_CONFIG", str(path))
        return path
    return write


@pytest.mark.parametrize(("toml", "words"), [
    ("[tool.deja\nturns = 3\n", ["cannot read"]),
    ("[tool.deja]\nbudget = {turns = 3}\n", ["unknown [tool.deja] key", "budget"]),
    ("[tool]\ndeja = 3\n", ["must be a table"]),
    ("[tool.deja.budgets]\nturns = -5\n", ["turns", "negative"]),
    ("[tool.deja.budgets]\ntokens = \"many\"\n", ["tokens", "number"]),
    ("[tool.deja.budgets]\nturnz = 3\n", ["turnz"]),
    ("[tool.deja]\nbudgets = 5\n", ["budgets"]),
    ("[tool.deja.prices]\n\"my-tune\" = [2.0]\n", ["my-tune"]),
    ("[tool.deja]\nprices = 5\n", ["prices"]),
    ("[tool.deja.loop]\nrepeats = 1\n", ["repeats"]),
    ("[tool.deja.loop]\nrepat = 4\n", ["repat"]),
    ("[tool.deja.breaker]\nfailures = \"many\"\n", ["failures"]),
    ("[tool.deja.breaker]\ncooldown = -1\n", ["cooldown"]),
])
def test_malformed_tool_deja_is_a_config_error_naming_the_file(
        pyproject: Callable[[str], Path], tmp_path: Path, toml: str, words: list[str]) -> None:
    conf = pyproject(toml)
    with pytest.raises(ConfigError) as raised:
        recorder.record(tmp_path / "bad.jsonl")
    message = str(raised.value)
    assert str(conf) in message
    for word in words:
        assert word in message
    # deja record refuses it too, before starting the program
    result = CliRunner().invoke(cli, ["record", "-o", str(tmp_path / "cli.jsonl"), "--",
                                      "python", "-c", "pass"])
    assert result.exit_code == 2 and str(conf) in result.output
    assert not (tmp_path / "cli.jsonl").exists()


def test_missing_config_file_is_a_config_error(pyproject: Callable[[str], Path],
                                               tmp_path: Path) -> None:
    conf = pyproject("")
    conf.unlink()
    with pytest.raises(ConfigError, match="cannot read"):
        recorder.record(tmp_path / "x.jsonl")


@pytest.mark.parametrize("args", [["--max-turns", "-1"], ["--max-tokens", "-5"],
                                  ["--max-seconds", "-1"], ["--max-dollars", "x"]])
def test_deja_record_refuses_a_bad_budget_flag(tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "x.jsonl"
    result = CliRunner().invoke(cli, ["record", "-o", str(out), *args, "--", "python", "-c",
                                      "raise SystemExit(9)"])
    assert result.exit_code == 2, result.output
    assert args[0] in result.output
    assert not out.exists()


def test_tool_deja_budgets_apply_and_explicit_arguments_override_them(
        pyproject: Callable[[str], Path], stub, tmp_path: Path) -> None:
    pyproject("[tool.deja.budgets]\nturns = 2\nmax_tokens = 8192\n\n"
              "[tool.deja.loop]\nrepeats = 4\nwindow = 6\n")
    server = stub(SCRIPT)

    path = tmp_path / "file.jsonl"
    with pytest.raises(BudgetExhausted), recorder.record(path):
        chat(client(server.url), 10)
    assert len(server.requests) == 2
    header = read_lines(path)[0]
    assert header["budgets"] == {"turns": 2, "max_tokens": 8192, "seconds": 3600.0,
                                 "max_tokens_mode": "refuse"}
    assert header["loop"]["repeats"] == 4 and header["loop"]["window"] == 6
    assert_stopped(path, budget="turns", used=2, limit=2, models=2)

    path = tmp_path / "args.jsonl"
    with pytest.raises(BudgetExhausted), recorder.record(path, budgets={"turns": 4}):
        chat(client(server.url), 10)
    assert len(server.requests) == 2 + 4
    header = read_lines(path)[0]
    assert header["budgets"]["turns"] == 4 and header["budgets"]["max_tokens"] == 8192

    # A Budgets object replaces the defaults and the file whole.
    path = tmp_path / "object.jsonl"
    with recorder.record(path, budgets=Budgets(turns=5)):
        chat(client(server.url), 5, max_tokens=50_000)
    assert read_lines(path)[0]["budgets"] == {"turns": 5, "max_tokens_mode": "refuse"}
    assert end_of(path)["status"] == "completed"


def test_deja_record_flags_override_tool_deja(pyproject: Callable[[str], Path], stub,
                                              tmp_path: Path) -> None:
    pyproject("[tool.deja.budgets]\nturns = 2\ntokens = 100000\n")
    server = stub(SCRIPT)
    path = tmp_path / "flags.jsonl"
    proc = deja("record", "-o", str(path), "--max-turns", "3", "--", "python", str(CHATTY),
                env={"ANTHROPIC_BASE_URL": server.url, "CHATTY_TURNS": "10"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stopped: BudgetExhausted" in proc.stdout
    assert len(server.requests) == 3
    assert read_lines(path)[0]["budgets"]["tokens"] == 100_000  # the file's, kept
    assert_stopped(path, budget="turns", used=3, limit=3, models=3)
    assert end_of(path)["exit_code"] == 0  # the agent caught it and exited normally


# ------------------------------------------------------------------------------ resume


@pytest.mark.parametrize(("budgets", "budget", "used"), [
    ({"turns": 3}, "turns", 3),
    ({"tokens": 300}, "tokens", 360),
    ({"dollars": PriceTable().cost(MODEL, USAGE) * 2.5}, "dollars",
     PriceTable().cost(MODEL, USAGE) * 3),
])
def test_counters_survive_resume_of_an_abandoned_run(stub, tmp_path: Path, budgets: dict,
                                                     budget: str, used: float) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "abandoned.jsonl"
    rec = recorder.start(path, budgets=budgets)
    try:
        chat(client(server.url), 2)
    finally:
        rec.abandon()
    assert len(server.requests) == 2 and kinds(path)[-1] == "model"

    calls: list[int] = []
    with pytest.raises(BudgetExhausted) as raised, replayer.resume(path):
        chat(client(server.url), 10, calls)
    assert calls == [0, 1, 2, 3]  # two replayed, one new call live, the second new refused
    assert len(server.requests) == 3
    assert raised.value.detail["budget"] == budget
    assert raised.value.detail["used"] == pytest.approx(used)
    assert kinds(path)[1:] == ["model", "model", "control", "model", "control", "end"]
    resumed, stop = controls(path)
    assert resumed["event"] == "resumed" and stop["event"] == "budget_exhausted"
    assert end_of(path)["status"] == "exhausted"


def test_counters_survive_resume_of_a_killed_run(stub, tmp_path: Path) -> None:
    server = stub(SCRIPT)
    path = tmp_path / "killed.jsonl"
    proc = deja("record", "-o", str(path), "--max-turns", "3", "--", "python", str(CHATTY),
                env={"ANTHROPIC_BASE_URL": server.url, "CHATTY_KILL_AFTER": "2"})
    assert proc.returncode != 0 and "turn 1" in proc.stdout, proc.stdout + proc.stderr
    assert len(server.requests) == 2
    assert kinds(path)[1:] == ["model", "model"]  # no end line: resumable

    calls: list[int] = []
    with pytest.raises(BudgetExhausted) as raised, replayer.resume(path):
        chat(client(server.url), 10, calls)
    assert calls[-1] == 3 and len(server.requests) == 3
    assert raised.value.detail["used"] == 3 and raised.value.detail["limit"] == 3
    assert end_of(path)["status"] == "exhausted"
