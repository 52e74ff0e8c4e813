"""Tools and effects in a replay: their recorded results are served and their bodies never
run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from record_replay_helpers import replay_ok

import recorder
import replayer

# ------------------------------------------------------------------------------ tools


def test_tools_replay_recorded_results_without_running(tmp_path: Path) -> None:
    calls: list[tuple] = []

    @recorder.tool
    def lookup(city: str, *, units: str = "C") -> dict:
        calls.append(("lookup", city, units))
        return {"city": city, "temp": 21.5 if units == "C" else 70.7, "nonce": uuid.uuid4().hex}

    @recorder.tool(name="fetch_page")
    async def fetch(url: str) -> str:
        calls.append(("fetch", url))
        await asyncio.sleep(0)
        return f"<html>{url} {uuid.uuid4().hex}</html>"

    @recorder.tool
    def explode(n: int) -> int:
        calls.append(("explode", n))
        raise ValueError(f"bad n: {n}")

    @recorder.tool
    def config(options: dict) -> list:
        calls.append(("config", options))
        return sorted(options)

    def agent() -> list[Any]:
        out: list[Any] = [lookup("Paris"), lookup("Oslo", units="F"),
                          asyncio.run(fetch("https://example.test/a"))]
        with pytest.raises(ValueError, match=r"^bad n: 3$"):
            explode(3)
        out.append(config({"alpha": 1, "beta": {"x": 1, "y": 2}}))
        return out

    path = tmp_path / "tools.jsonl"
    with recorder.record(path):
        recorded = agent()
    assert len(calls) == 5
    obs = [o for o in recorder.load(path).observations if o["kind"] == "tool"]
    assert [o["name"] for o in obs] == ["lookup", "lookup", "fetch_page", "explode", "config"]
    assert obs[0]["args"] == {"city": "Paris"}  # the arguments as passed
    assert obs[1]["args"] == {"city": "Oslo", "units": "F"}
    assert obs[0]["result"] == recorded[0]
    assert obs[2]["result"] == recorded[2]
    assert obs[3]["error"]["type"] == "ValueError" and obs[3]["error"]["message"] == "bad n: 3"

    calls.clear()

    def replay_agent() -> list[Any]:
        out: list[Any] = [lookup("Paris"), lookup("Oslo", units="F"),
                          asyncio.run(fetch("https://example.test/a"))]
        with pytest.raises(ValueError, match=r"^bad n: 3$"):
            explode(3)
        # Same arguments, keys in another order: still the recorded call.
        out.append(config({"beta": {"y": 2, "x": 1}, "alpha": 1}))
        return out

    replayed, _ = replay_ok(path, replay_agent)
    assert calls == []  # no tool body ran
    assert replayed == recorded  # the random tokens came from the cassette

    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        lookup("Berlin")
    assert info.value.step == obs[0]["seq"]
    assert "Berlin" in info.value.diff and "Paris" in info.value.diff
    assert calls == []


@pytest.mark.asyncio
async def test_async_tool_error_and_divergence(tmp_path: Path) -> None:
    calls: list[int] = []

    @recorder.tool
    async def flaky(n: int) -> int:
        calls.append(n)
        if n < 0:
            raise ValueError(f"negative: {n}")
        return n * 2

    path = tmp_path / "async-tools.jsonl"
    with recorder.record(path):
        assert await flaky(4) == 8
        with pytest.raises(ValueError, match="negative: -1"):
            await flaky(-1)
    assert calls == [4, -1]

    calls.clear()
    ctx = replayer.replay(path)
    with ctx:
        assert await flaky(4) == 8
        with pytest.raises(ValueError, match=r"^negative: -1$"):
            await flaky(-1)
    assert calls == []
    assert ctx.result is not None and ctx.result.identical

    with pytest.raises(recorder.Divergence), replayer.replay(path):
        await flaky(5)
    assert calls == []


# ---------------------------------------------------------------------------- effects


def test_effects_replay_recorded_values(tmp_path: Path) -> None:
    produced: list[int] = []

    def sensor() -> dict:
        produced.append(1)
        return {"reading": time.perf_counter_ns(), "raw": b"\x00\xff"}

    def agent() -> tuple:
        return (recorder.now(), recorder.uuid4(), recorder.random(),
                recorder.value("x", sensor), recorder.value("x", sensor))

    path = tmp_path / "effects.jsonl"
    with recorder.record(path):
        recorded = agent()
    assert len(produced) == 2
    assert isinstance(recorded[1], uuid.UUID)
    effects = [o for o in recorder.load(path).observations if o["kind"] == "effect"]
    assert [o["name"] for o in effects] == ["time", "uuid", "random", "x", "x"]

    time.sleep(0.01)  # a live clock would now read differently
    produced.clear()
    replayed, _ = replay_ok(path, agent)
    assert replayed == recorded
    assert produced == []

    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        agent()
        recorder.value("x", sensor)  # a third "x": the recording has only two
    assert "no more effect" in str(info.value)
    assert produced == []
