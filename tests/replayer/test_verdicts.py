"""Graded verdicts: each replayed call is exact, equivalent or diverged, and a divergence is
named by the kind of change that caused it.

The real anthropic SDK against the stub server records a weather agent (two tool calls in
one reply, run as deja tools, then the answer). The agent is then changed on purpose, one
change at a time, and replayed offline: each change must come out as its kind
(``different_tool``, ``different_arguments``, ``extra_call``, ``missing_call``,
``reordered``, ``changed_request`` with what changed), counted in the result, and shown in
the report of ``replayer.replay``, ``deja replay`` (text and ``--json``) and a failing
pytest test. Among fifty recorded requests, the nearest to a changed one is its own.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anthropic
import pytest
from conftest import MODEL

import recorder
import replayer
from recorder.cassette import load
from recorder.errors import DivergenceInfo

OFFLINE = "http://127.0.0.1:9"  # nothing listens there: a replay serves every call
SYSTEM = "You are a weather assistant."
TOOLS = [{"name": name, "description": f"The {name} for a city.",
          "input_schema": {"type": "object", "properties": {
              "city": {"type": "string"}, "units": {"type": "string"}}, "required": ["city"]}}
         for name in ("forecast", "alerts")]
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Checking both.", "tool_use": [{"name": "forecast", "input": {"city": "Paris"}},
                                            {"name": "forecast", "input": {"city": "Rome"}}]},
    {"text": "Paris 21C, Rome 25C."}], "default": {"text": "Tomorrow is the same."}}


@recorder.tool
def forecast(city: str, units: str = "C") -> str:
    return f"{city}: {21 if city == 'Paris' else 25} {units}"


@recorder.tool
def alerts(city: str, units: str = "C") -> str:
    return f"{city}: no alerts"


def agent(url: str, change: str | None = None) -> str:
    """The weather agent; ``change`` makes one deliberate change to it."""
    client = anthropic.Anthropic(base_url=url, api_key="sk-stub", max_retries=0)
    ask: dict[str, Any] = {"model": "claude-opus-4-1" if change == "model" else MODEL,
                           "max_tokens": 256, "tools": TOOLS,
                           "system": SYSTEM + (" Be brief." if change == "prompt" else "")}
    if change == "stop_sequences":
        ask["stop_sequences"] = ["END"]
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    first = client.messages.create(messages=messages, **ask)
    if change == "repeat":  # a retry the recording never made
        client.messages.create(messages=messages, **ask)
    results = []
    for block in first.content:
        if block.type == "tool_use":
            run = alerts if change == "different_tool" else forecast
            units = "F" if change == "different_arguments" else "C"
            results.append({"type": "tool_result", "tool_use_id": block.id,
                            "content": run(block.input["city"], units=units)})
    if change == "reordered":
        results.reverse()
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": results}]
    if change == "missing_call":
        return "stopped before the answer"
    answer = client.messages.create(messages=messages, **ask).content[0].text  # type: ignore[union-attr]
    if change == "extra_call":
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "And tomorrow?"}]
        client.messages.create(messages=messages, **ask)
    return answer


@pytest.fixture
def cassette(stub: Any, tmp_path: Path) -> Path:
    server = stub(SCRIPT)
    path = tmp_path / "weather.jsonl"
    with recorder.record(path):
        assert agent(server.url) == "Paris 21C, Rome 25C."
    server.stop()
    return path


def model_seqs(path: Path) -> list[int]:
    return [o["seq"] for o in load(path).observations if o["kind"] == "model"]


def replay_changed(path: Path, change: str) -> tuple[DivergenceInfo, replayer.ReplayResult]:
    context = replayer.replay(path)
    with pytest.raises(recorder.Divergence) as diverged, context:
        agent(OFFLINE, change)
    assert context.result is not None
    return diverged.value.info, context.result


def test_an_unchanged_agent_is_identical_with_every_call_exact(cassette: Path) -> None:
    with replayer.replay(cassette) as run:
        agent(OFFLINE)
    result = run.result
    assert result is not None and result.verdict == "identical", result.report()
    # two model calls and two tool calls, all exact
    assert result.grades == {"exact": 4, "equivalent": 0, "diverged": 0}
    assert not any(result.kinds.values()) and result.equivalent == ()
    assert result.to_dict()["verdict"] == "identical"
    assert "calls:      4 exact" in result.report()


# (change, kind, what changed, which recorded model call is nearest: 0 or 1, or a tool)
CHANGES = [
    ("model", "changed_request", ("model",), 0),
    ("prompt", "changed_request", ("prompt",), 0),
    ("stop_sequences", "changed_request", ("parameters: stop_sequences",), 0),
    ("reordered", "reordered", (), 1),
    ("different_tool", "different_tool", (), "tool"),
    ("different_arguments", "different_arguments", (), "tool"),
    ("extra_call", "extra_call", (), 1),
    ("repeat", "extra_call", (), 0),
]


@pytest.mark.parametrize(("change", "kind", "changed", "near"), CHANGES,
                         ids=[c[0] for c in CHANGES])
def test_each_deliberate_change_is_named_by_its_kind(cassette: Path, change: str, kind: str,
                                                     changed: tuple[str, ...],
                                                     near: int | str) -> None:
    info, result = replay_changed(cassette, change)
    assert (info.category, info.changed) == (kind, changed), info
    if isinstance(near, int):
        assert info.nearest_step == model_seqs(cassette)[near], info
        assert info.nearest is not None and \
            info.nearest.startswith(f"nearest recorded request: step {info.nearest_step}")
    else:
        tools = [o for o in load(cassette).observations if o["kind"] == "tool"]
        assert info.nearest_step == tools[0]["seq"], info
    # a call beyond the recording stands for one already played; any other, for none
    assert info.played == (1 if kind == "extra_call" else 0), info
    assert result.verdict == "diverged" and result.kinds[kind] == 1
    assert result.grades is not None and result.grades["diverged"] == 1
    report = result.report()
    shown = f"kind: {kind}" + (f" ({', '.join(changed)})" if changed else "")
    assert shown in report and f"{kind}: 1" in report, report
    assert f"step {info.nearest_step}, was already played {info.played} time" in report


def test_an_agent_that_stops_early_misses_a_call(cassette: Path) -> None:
    info, result = replay_changed(cassette, "missing_call")
    assert info.category == "missing_call" and info.step == model_seqs(cassette)[1]
    assert result.kinds is not None and result.kinds["missing_call"] == 1
    assert result.grades == {"exact": 3, "equivalent": 0, "diverged": 0}  # nothing replayed
    assert "kind: missing_call" in result.report()


def ticket(rng: random.Random, words: list[str], n: int) -> str:
    return f"Summarise ticket {n}: " + " ".join(rng.sample(words, 12))


def test_the_nearest_of_fifty_recorded_requests_is_the_changed_ones_own(
        stub: Any, tmp_path: Path) -> None:
    """Fifty independent requests, replayed in reverse order with one word of one changed:
    all fifty differ from it in the same one field, and the one it was is named."""
    rng = random.Random(7)
    words = [f"{a}{b}" for a in ("print", "mail", "disk", "login", "cache", "queue", "badge",
                                 "lamp", "fan", "door") for b in ("er", "box", "log", "key",
                                                                   "ing", "ward", "ful")]
    texts = [ticket(rng, words, n) for n in range(50)]
    server = stub({"default": {"text": "Done."}})
    path = tmp_path / "tickets.jsonl"

    def ask(url: str, prompts: list[str]) -> None:
        client = anthropic.Anthropic(base_url=url, api_key="sk-stub", max_retries=0)
        for prompt in prompts:
            client.messages.create(model=MODEL, max_tokens=32,
                                   messages=[{"role": "user", "content": prompt}])

    with recorder.record(path):
        ask(server.url, texts)
    server.stop()
    seqs = model_seqs(path)
    changed = list(reversed(texts))
    at = changed.index(texts[37])
    changed[at] = texts[37].replace(texts[37].split()[-1], "stapler")
    context = replayer.replay(path)
    with pytest.raises(recorder.Divergence) as diverged, context:
        ask(OFFLINE, changed)
    info = diverged.value.info
    assert info.nearest_step == seqs[37], info.nearest
    assert info.nearest == f"nearest recorded request: step {seqs[37]}, which differs in " \
                           "messages[0]"
    assert (info.category, info.changed, info.played) == ("changed_request", ("prompt",), 0)
    assert info.step == seqs[0]  # the diff is still against the first call not asked for
    assert context.result is not None
    assert context.result.grades == {"exact": at, "equivalent": 0, "diverged": 1}


AGENT_FILE = textwrap.dedent(f'''\
    import os, anthropic
    client = anthropic.Anthropic(base_url="{OFFLINE}", api_key="k", max_retries=0)
    reply = client.messages.create(model=os.environ["AGENT_MODEL"], max_tokens=64,
                                   messages=[{{"role": "user", "content": "Hi"}}])
    print(reply.content[0].text)
''')


def test_deja_replay_prints_the_verdict_in_its_report_and_its_json(
        stub: Any, tmp_path: Path) -> None:
    server = stub({"default": {"text": "Hello."}})
    path = tmp_path / "hello.jsonl"
    with recorder.record(path):
        client = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
        client.messages.create(model=MODEL, max_tokens=64,
                               messages=[{"role": "user", "content": "Hi"}])
    server.stop()
    (tmp_path / "agent.py").write_text(AGENT_FILE)

    def deja_replay(model: str, *flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deja", "replay", str(path), *flags, "--",
                               sys.executable, "agent.py"], cwd=tmp_path, text=True,
                              capture_output=True, timeout=120,
                              env={**os.environ, "AGENT_MODEL": model})

    same = deja_replay(MODEL, "--json")
    assert same.returncode == 0, same.stdout + same.stderr
    result = json.loads(same.stdout)
    assert result["verdict"] == "identical" and result["grades"]["exact"] == 1
    changed = deja_replay("claude-opus-4-1", "--json")
    assert changed.returncode == 1, changed.stdout + changed.stderr
    result = json.loads(changed.stdout)
    assert result["verdict"] == "diverged"
    assert result["kinds"]["changed_request"] == 1 and result["grades"]["diverged"] == 1
    assert result["divergence"]["category"] == "changed_request"
    assert result["divergence"]["changed"] == ["model"]
    text = deja_replay("claude-opus-4-1").stdout
    assert ": DIVERGED" in text and "calls:      1 diverged (changed_request: 1)" in text, text
    assert "kind: changed_request (model)" in text
    assert "nearest recorded request: step 0, which differs in model" in text


def test_a_failing_pytest_test_shows_the_kind_and_the_counts(pytester: pytest.Pytester,
                                                             cassette: Path) -> None:
    pytester.makepyfile(textwrap.dedent(f"""
        import sys, pytest
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from test_verdicts import OFFLINE, agent

        @pytest.mark.deja({str(cassette)!r})
        def test_same():
            agent(OFFLINE)

        @pytest.mark.deja({str(cassette)!r})
        def test_reordered():
            agent(OFFLINE, "reordered")
    """))
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_reordered*", "*: DIVERGED",
                                 "*calls:      3 exact, 1 diverged (reordered: 1)",
                                 "*kind: reordered",
                                 "*nearest recorded request: step *, which differs in "
                                 "messages?2?",  # (fnmatch reads [2] as a set)
                                 "*was already played 0 times"])
