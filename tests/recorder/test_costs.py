"""Honest costs: prompt-cache reads and writes priced at their own rates, a price table per
model that a project extends, the dollar budget counting the same figures, and a fork's
live spend told apart from what it replayed.

Every expected figure is worked out here by hand from the providers' published rates
(dollars per million tokens, written out below), never read from deja's price table: a
wrong rate in the table fails these tests.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anthropic
import pytest
from conftest import API_KEY, MODEL, read_lines
from guard_helpers import assert_stopped, end_of

import recorder
import replayer
from recorder import BudgetExhausted, ConfigError
from recorder.cassette.rows import describe_split, run_totals
from recorder.harness.settings import resolve
from recorder.providers.pricing import Price, PriceTable

# Anthropic's pricing page (https://docs.claude.com/en/docs/about-claude/pricing):
# base input, 5-minute cache writes, 1-hour cache writes, cache hits, output.
ANTHROPIC = {
    "claude-opus-4-6": (5.00, 6.25, 10.00, 0.50, 25.00),
    "claude-opus-4-5": (5.00, 6.25, 10.00, 0.50, 25.00),
    "claude-opus-4-1": (15.00, 18.75, 30.00, 1.50, 75.00),
    "claude-opus-4": (15.00, 18.75, 30.00, 1.50, 75.00),
    "claude-sonnet-4-6": (3.00, 3.75, 6.00, 0.30, 15.00),
    "claude-sonnet-4-5": (3.00, 3.75, 6.00, 0.30, 15.00),
    "claude-sonnet-4": (3.00, 3.75, 6.00, 0.30, 15.00),
    "claude-haiku-4-5": (1.00, 1.25, 2.00, 0.10, 5.00),
    "claude-3-7-sonnet": (3.00, 3.75, 6.00, 0.30, 15.00),
    "claude-3-5-haiku": (0.80, 1.00, 1.60, 0.08, 4.00),
    "claude-3-opus": (15.00, 18.75, 30.00, 1.50, 75.00),
    "claude-3-haiku": (0.25, 0.30, 0.50, 0.03, 1.25),
}
# OpenAI's pricing page (https://platform.openai.com/docs/pricing), Standard tier:
# input, cached input, output.
OPENAI = {
    "gpt-5": (1.25, 0.125, 10.00),
    "gpt-5-mini": (0.25, 0.025, 2.00),
    "gpt-5-nano": (0.05, 0.005, 0.40),
    "gpt-5.1": (1.25, 0.125, 10.00),
    "gpt-4.1": (2.00, 0.50, 8.00),
    "gpt-4.1-mini": (0.40, 0.10, 1.60),
    "gpt-4.1-nano": (0.10, 0.025, 0.40),
    "gpt-4o": (2.50, 1.25, 10.00),
    "gpt-4o-mini": (0.15, 0.075, 0.60),
    "o3": (2.00, 0.50, 8.00),
    "o4-mini": (1.10, 0.275, 4.40),
}
SONNET_IN, SONNET_WRITE, SONNET_WRITE_1H, SONNET_READ, SONNET_OUT = ANTHROPIC["claude-sonnet-4-6"]


def sonnet_dollars(usage: dict[str, int]) -> float:
    """What ``usage`` costs on claude-sonnet-4-6, by hand."""
    return (usage.get("input_tokens", 0) * SONNET_IN
            + usage.get("cache_creation_input_tokens", 0) * SONNET_WRITE
            + usage.get("cache_read_input_tokens", 0) * SONNET_READ
            + usage.get("output_tokens", 0) * SONNET_OUT) / 1_000_000


# ------------------------------------------------------------------------------ the table


@pytest.mark.parametrize("model", sorted(ANTHROPIC))
def test_anthropic_models_carry_their_published_cache_rates(model: str) -> None:
    price = PriceTable().lookup(model)
    assert price is not None
    assert (price.input, price.write_rate, price.write_1h_rate, price.read_rate,
            price.output) == pytest.approx(ANTHROPIC[model])


@pytest.mark.parametrize("model", sorted(OPENAI))
def test_openai_models_carry_their_cached_input_rate_and_no_cache_write(model: str) -> None:
    price = PriceTable().lookup(model)
    assert price is not None
    inp, cached, out = OPENAI[model]
    assert (price.input, price.read_rate, price.output) == pytest.approx((inp, cached, out))
    assert price.write_rate == price.write_1h_rate == price.input  # no surcharge to write


@pytest.mark.parametrize(("model", "family"), [
    ("claude-sonnet-4-5-20250929", "claude-sonnet-4-5"),
    ("claude-opus-4-5-20251101", "claude-opus-4-5"),     # not claude-opus-4's $15
    ("claude-opus-4-1-20250805", "claude-opus-4-1"),
    ("claude-opus-4-20250514", "claude-opus-4"),
    ("claude-sonnet-4-0", "claude-sonnet-4"),
    ("claude-haiku-4-5-20251001", "claude-haiku-4-5"),
    ("claude-3-7-sonnet-latest", "claude-3-7-sonnet"),
    ("claude-3-5-haiku-20241022", "claude-3-5-haiku"),
    ("claude-3-haiku-20240307", "claude-3-haiku"),
    ("gpt-4.1-2025-04-14", "gpt-4.1"),
    ("gpt-4.1-mini-2025-04-14", "gpt-4.1-mini"),          # not gpt-4.1's rates
    ("gpt-4o-2024-08-06", "gpt-4o"),
    ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"),
    ("o4-mini-2025-04-16", "o4-mini"),
    ("gpt-5-mini-2025-08-07", "gpt-5-mini"),
])
def test_a_snapshot_is_priced_as_the_longest_key_that_prefixes_it(model: str,
                                                                   family: str) -> None:
    table = PriceTable()
    assert table.lookup(model) == table.lookup(family)
    expected = ANTHROPIC.get(family) or OPENAI[family]
    assert table.lookup(model).input == expected[0]  # type: ignore[union-attr]


@pytest.mark.parametrize(("model", "inp", "out"), [
    ("gpt-4o-2024-05-13", 5.00, 15.00),   # the first gpt-4o, dearer than gpt-4o
    ("gpt-5-pro", 15.00, 120.00),         # not gpt-5's rates
    ("o3-pro-2025-06-10", 20.00, 80.00),  # not o3's
    ("o1-pro", 150.00, 600.00),
])
def test_variants_priced_apart_from_their_family_have_their_own_rows(
        model: str, inp: float, out: float) -> None:
    price = PriceTable().lookup(model)
    assert price is not None and (price.input, price.output) == (inp, out)
    assert price.read_rate == inp  # no cached-input discount


def test_an_unknown_model_or_no_usage_has_no_cost() -> None:
    table = PriceTable()
    assert table.lookup("acme-7") is None and table.lookup(None) is None
    assert table.cost("acme-7", {"input_tokens": 10}) is None
    assert table.cost(MODEL, None) is None and table.cost(MODEL, {}) is None


# ------------------------------------------------------------------------------ Price.cost


def test_cache_reads_and_writes_are_charged_apart_from_input() -> None:
    usage = {"input_tokens": 2_000, "output_tokens": 500,
             "cache_creation_input_tokens": 100_000, "cache_read_input_tokens": 40_000}
    # 2000 * $3 + 100000 * $3.75 + 40000 * $0.30 + 500 * $15, per million
    assert PriceTable().cost(MODEL, usage) == pytest.approx(0.4005)
    assert PriceTable().cost(MODEL, usage) == pytest.approx(sonnet_dollars(usage))


def test_one_hour_cache_writes_are_charged_at_their_own_rate() -> None:
    price = PriceTable().lookup(MODEL)
    assert price is not None
    # Anthropic's usage: the writes' total, and how many of them had each lifetime.
    wire = {"input_tokens": 10, "output_tokens": 0, "cache_creation_input_tokens": 3_000,
            "cache_creation": {"ephemeral_5m_input_tokens": 1_000,
                               "ephemeral_1h_input_tokens": 2_000}}
    expected = (10 * SONNET_IN + 1_000 * SONNET_WRITE + 2_000 * SONNET_WRITE_1H) / 1e6
    assert price.cost(wire) == pytest.approx(expected)
    # deja's flat name for the 1-hour part, and the split without the total
    flat = {"input_tokens": 10, "cache_creation_input_tokens": 3_000,
            "cache_creation_1h_input_tokens": 2_000}
    assert price.cost(flat) == pytest.approx(expected)
    split_only = {"input_tokens": 10, "cache_creation": wire["cache_creation"]}
    assert price.cost(split_only) == pytest.approx(expected)
    # without a split, every write is a 5-minute one
    assert price.cost({"cache_creation_input_tokens": 3_000}) == pytest.approx(
        3_000 * SONNET_WRITE / 1e6)


def test_openai_cached_prompt_tokens_are_charged_at_the_cached_input_rate() -> None:
    # prompt_tokens 10000 with 8000 cached, normalised: 2000 input + 8000 cache reads
    usage = {"input_tokens": 2_000, "cache_read_input_tokens": 8_000, "output_tokens": 500}
    inp, cached, out = OPENAI["gpt-4.1"]
    assert PriceTable().cost("gpt-4.1-2025-04-14", usage) == pytest.approx(
        (2_000 * inp + 8_000 * cached + 500 * out) / 1e6) == pytest.approx(0.012)


def test_a_price_without_cache_rates_follows_anthropics_multipliers() -> None:
    price = Price(2.0, 8.0)
    assert (price.write_rate, price.write_1h_rate, price.read_rate) == pytest.approx(
        (2.5, 4.0, 0.2))
    usage = {"input_tokens": 1_000_000, "output_tokens": 1_000_000,
             "cache_creation_input_tokens": 1_000_000, "cache_read_input_tokens": 1_000_000}
    assert price.cost(usage) == pytest.approx(2.0 + 8.0 + 2.5 + 0.2)


def test_counts_that_are_no_counts_cost_nothing() -> None:
    price = Price(3.0, 15.0)
    assert price.cost({"input_tokens": -5, "output_tokens": True,
                       "cache_read_input_tokens": "9", "cache_creation": 7}) == 0


# ------------------------------------------------------------------------------ overrides


def test_record_prices_accept_a_list_and_a_table_of_named_rates() -> None:
    table = resolve(prices={
        "acme-tune": [2, 8],
        "acme-cached": [2.0, 8.0, 2.5, 0.2, 4.0],
        MODEL: {"input": 30.0, "output": 150.0, "cache_read": 3.0},
    }, use_project=False).prices
    assert table.lookup("acme-tune-7") == Price(2.0, 8.0)
    assert table.lookup("acme-cached") == Price(2.0, 8.0, 2.5, 0.2, 4.0)
    sonnet = table.lookup(MODEL)
    assert sonnet is not None and (sonnet.input, sonnet.read_rate) == (30.0, 3.0)
    assert sonnet.write_rate == 37.5  # an override replaces the price whole: 1.25x input
    assert table.lookup("claude-sonnet-4-5") == PriceTable().lookup("claude-sonnet-4-5")


@pytest.mark.parametrize(("value", "words"), [
    ([2.0], ["acme", "[input, output]"]),
    ([1, 2, 3, 4, 5, 6], ["acme", "[input, output]"]),
    ("cheap", ["acme", "'cheap'"]),
    ({"input": 1.0}, ["acme", "no output rate"]),
    ({"input": 1.0, "output": 2.0, "cache_reed": 0.1}, ["acme", "unknown field", "cache_reed"]),
    ({"input": True, "output": 2.0}, ["acme", "input must be a number"]),
    ({"input": "1", "output": 2.0}, ["acme", "input must be a number"]),
    ([1.0, -2.0], ["acme", "output is negative"]),
    ([1.0, 2.0, math.nan], ["acme", "cache_write", "finite"]),
    ([1.0, 2.0, None, math.inf], ["acme", "cache_read", "finite"]),
])
def test_a_bad_price_is_a_config_error_naming_the_model(value: Any, words: list[str]) -> None:
    with pytest.raises(ConfigError) as raised:
        resolve(prices={"acme": value}, use_project=False)
    for word in words:
        assert word in str(raised.value)


def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, toml: str) -> Path:
    """A project whose pyproject.toml has ``toml``, the working directory inside it."""
    root = tmp_path / "project"
    (root / "src").mkdir(parents=True)
    (root / "pyproject.toml").write_text('[project]\nname = "agent"\n\n' + toml)
    monkeypatch.delenv("DEJA_CONFIG", raising=False)
    monkeypatch.chdir(root / "src")  # found by walking up from here
    return root / "pyproject.toml"


PROJECT_PRICES = """\
[tool.deja.prices]
"acme-tune" = [2.0, 8.0]
"acme-inline" = {input = 1.0, output = 4.0, cache_read = 0.1}

[tool.deja.prices."claude-sonnet-4-6"]
input = 6.0
output = 30.0
cache_write = 7.5
cache_read = 0.6
cache_write_1h = 12.0
"""


def test_tool_deja_prices_extend_and_override_the_table(
        stub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project(tmp_path, monkeypatch, PROJECT_PRICES)
    table = resolve().prices
    assert table.lookup("acme-tune-2") == Price(2.0, 8.0)
    assert table.lookup("acme-inline") == Price(1.0, 4.0, cache_read=0.1)
    assert table.lookup(MODEL) == Price(6.0, 30.0, 7.5, 0.6, 12.0)
    # record(prices=...) wins over the file
    assert resolve(prices={MODEL: [1.0, 1.0]}).prices.lookup(MODEL) == Price(1.0, 1.0)

    # and a recorded run is charged by the file's figures
    usage = {"input_tokens": 1_000, "output_tokens": 100,
             "cache_creation_input_tokens": 2_000, "cache_read_input_tokens": 10_000}
    server = stub({"turns": [{"text": "ok", "usage": usage}]})
    path = tmp_path / "priced.jsonl"
    with recorder.record(path):
        ask(server.url, [{"role": "user", "content": "hi"}])
    (line,) = [o for o in recorder.load(path).observations if o["kind"] == "model"]
    assert line["cost_usd"] == pytest.approx(
        (1_000 * 6.0 + 100 * 30.0 + 2_000 * 7.5 + 10_000 * 0.6) / 1e6)


def test_a_bad_tool_deja_price_names_the_file_and_the_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = project(tmp_path, monkeypatch, '[tool.deja.prices]\n"acme" = {input = 1.0}\n')
    with pytest.raises(ConfigError) as raised:
        recorder.record(tmp_path / "bad.jsonl")
    assert str(path.resolve()) in str(raised.value) or str(path) in str(raised.value)
    assert "'acme'" in str(raised.value) and "no output rate" in str(raised.value)
    assert not (tmp_path / "bad.jsonl").exists()


# ------------------------------------------------------------------------------ a run


SYSTEM = [{"type": "text", "text": "You plan trips. " * 200,
           "cache_control": {"type": "ephemeral"}}]
# turn 0 writes the cache, the next two read it (and write a little more each)
USAGES = [
    {"input_tokens": 2_000, "output_tokens": 500, "cache_creation_input_tokens": 100_000,
     "cache_read_input_tokens": 0},
    {"input_tokens": 1_500, "output_tokens": 800, "cache_creation_input_tokens": 2_000,
     "cache_read_input_tokens": 100_000},
    {"input_tokens": 1_000, "output_tokens": 1_200, "cache_creation_input_tokens": 1_000,
     "cache_read_input_tokens": 102_000},
]
# by hand: $0.3885, $0.054, $0.05535
COSTS = [sonnet_dollars(u) for u in USAGES]
TEXTS = ["Day one: Lyon.", "Day two: Annecy.", "Day three: Geneva."]
TRIP = {"select": "conversation",
        "turns": [{"text": t, "usage": u} for t, u in zip(TEXTS, USAGES, strict=True)]}


def ask(url: str, messages: list[dict[str, Any]], stream: bool = False) -> str:
    with anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0) as c:
        if stream:
            with c.messages.stream(model=MODEL, max_tokens=256, system=SYSTEM,
                                   messages=messages) as s:
                message = s.get_final_message()
        else:
            message = c.messages.create(model=MODEL, max_tokens=256, system=SYSTEM,
                                        messages=messages)
    block = message.content[0]
    assert block.type == "text"
    return block.text


def trip(url: str, calls: list[int] | None = None) -> list[str]:
    """Three turns of one conversation; the second is streamed."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Plan three days."}]
    replies = []
    for i in range(3):
        if calls is not None:
            calls.append(i)
        text = ask(url, messages, stream=i == 1)
        replies.append(text)
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"And after day {i + 1}?"}]
    return replies


def model_lines(path: Path) -> list[dict[str, Any]]:
    return [o for o in recorder.load(path).observations if o["kind"] == "model"]


def test_the_cost_of_a_run_with_cache_reads_and_writes_is_the_hand_computed_one(
        stub, tmp_path: Path) -> None:
    server = stub(TRIP)
    path = tmp_path / "trip.jsonl"
    with recorder.record(path):
        assert trip(server.url) == TEXTS
    lines = model_lines(path)
    assert [o["usage"] for o in lines] == USAGES
    assert [o["stream"] for o in lines] == [False, True, False]
    assert [o["cost_usd"] for o in lines] == pytest.approx(COSTS)
    assert COSTS == pytest.approx([0.3885, 0.054, 0.05535])
    totals = end_of(path)["totals"]
    assert totals["cost_usd"] == pytest.approx(sum(COSTS)) == pytest.approx(0.49785)
    assert totals["input_tokens"] == 4_500 and totals["output_tokens"] == 2_500
    assert run_totals(recorder.load(path))["all"]["cost_usd"] == totals["cost_usd"]
    # Replayed offline, the run is the same and costs the same.
    with replayer.replay(path) as run:
        assert trip(server.url) == TEXTS
    assert run.result is not None and run.result.identical, run.result.report()


@pytest.mark.parametrize(("limit", "sent"), [
    (0.38, 1),   # turn 0 alone costs $0.3885: priced as plain input it would be $0.3135
    (0.40, 2),   # $0.3885 < $0.40 <= $0.4425 after turn 1
    (0.4425, 2),
])
def test_the_dollar_budget_counts_cache_tokens_and_stops_at_the_next_call(
        stub, tmp_path: Path, limit: float, sent: int) -> None:
    server = stub(TRIP)
    path = tmp_path / "budget.jsonl"
    calls: list[int] = []
    with pytest.raises(BudgetExhausted) as raised, \
            recorder.record(path, budgets={"dollars": limit}):
        trip(server.url, calls)
    assert len(server.requests) == sent and calls == list(range(sent + 1))
    spent = sum(COSTS[:sent])
    assert spent >= limit > spent - COSTS[sent - 1]  # crossed by the last call sent
    assert raised.value.end_status == "exhausted"
    assert_stopped(path, budget="dollars", used=spent, limit=limit, models=sent)
    end = end_of(path)
    assert end["status"] == "exhausted" and end["totals"]["cost_usd"] == pytest.approx(spent)


def test_a_fork_reports_its_live_spend_apart_from_what_it_replayed(
        stub, tmp_path: Path) -> None:
    server = stub(TRIP)
    parent = tmp_path / "parent.jsonl"
    with recorder.record(parent):
        trip(server.url)
    assert len(server.requests) == 3
    out = tmp_path / "fork.jsonl"
    with replayer.fork(parent, at=1, out=out, sets=["content.0.text=Day two: Chamonix."]):
        replies = trip(server.url)
    assert replies == [TEXTS[0], "Day two: Chamonix.", TEXTS[2]]
    assert len(server.requests) == 4  # only the third turn went out

    lines = read_lines(out)
    assert [line.get("kind", "header") for line in lines] == \
        ["header", "model", "model", "control", "model", "end"]
    replayed, live = COSTS[0] + COSTS[1], COSTS[2]
    end = lines[-1]
    assert end["totals"]["replayed"]["cost_usd"] == pytest.approx(replayed)
    assert end["totals"]["replayed"]["model_calls"] == 2
    assert end["totals"]["cost_usd"] == pytest.approx(replayed + live)

    totals = run_totals(recorder.load(out))
    assert totals["live_from"] == 3 and totals["replayed_from"].startswith("parent ")
    assert totals["replayed"]["cost_usd"] == pytest.approx(replayed)
    assert totals["live"]["cost_usd"] == pytest.approx(live)
    assert totals["live"]["model_calls"] == 1
    assert totals["all"]["cost_usd"] == pytest.approx(replayed + live)
    said = describe_split(totals)
    assert said[0].startswith("replayed from parent ") and said[0].endswith(f"${replayed:.6f}")
    assert said[1].startswith("live (steps 3-3): 1 model call") and \
        said[1].endswith(f"${live:.6f}")
