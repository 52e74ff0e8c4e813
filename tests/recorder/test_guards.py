"""Acceptance tests of the harness budgets (turns, tokens, dollars, wall clock, max_tokens),
and what a replay or a resume makes of their decisions.

The real anthropic SDK talks to the stub server; cassettes, status records and cancel
flags are real files; cross-process behaviour (``deja record``, ``deja status``, ``deja
cancel``) runs real processes. Time is never waited for: the wall-clock budget takes an
injected clock (``record(clock=...)``) and the circuit breaker's process-wide registry a
replaceable one (``BREAKERS.clock``), both fake here. The other guards are in
test_guards_cancel.py, test_guards_loop.py, test_guards_breaker.py and their configuration
in test_guards_config.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import anthropic
import guard_helpers
import pytest
from conftest import MODEL
from guard_agents.chatty import ask, client
from guard_helpers import (
    CHATTY,
    SCRIPT,
    USAGE,
    FakeClock,
    assert_replay_stops_the_same,
    assert_stopped,
    chat,
    controls,
    deja,
    end_of,
    kinds,
)

import recorder
import replayer
from recorder import BudgetExhausted, ConfigError
from recorder.harness.progress import read_status
from recorder.providers.pricing import PriceTable

# Fixtures shared by the test_guards files.
breaker_clock = guard_helpers.breaker_clock


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
