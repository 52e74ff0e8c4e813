"""A replay whose agent asks something else, or stops early: where it diverges and what it
reports.
"""

from __future__ import annotations

import time
from pathlib import Path

import anthropic
import pytest
from conftest import MODEL
from record_replay_helpers import WireTap, model_obs, sync_client

import recorder
import replayer

# ------------------------------------------------------------------------- divergence


def _record_two_step(stub, tmp_path: Path) -> tuple[Path, str, int]:
    """A run of one effect and one model call; returns the path, url and model seq."""
    server = stub({"turns": [{"text": "recorded answer"}]})
    url = server.url
    path = tmp_path / "div.jsonl"
    with recorder.record(path), sync_client(url) as client:
        recorder.now()
        client.messages.create(model=MODEL, max_tokens=32,
                               messages=[{"role": "user", "content": "the old prompt"}])
    server.stop()
    (obs,) = model_obs(path)
    assert obs["seq"] == 1
    return path, url, obs["seq"]


def _changed_agent(url: str, tap: WireTap) -> None:
    with sync_client(url, tap, max_retries=2) as client:
        recorder.now()
        client.messages.create(model=MODEL, max_tokens=32,
                               messages=[{"role": "user", "content": "the new prompt"}])


def test_changed_prompt_diverges_at_once(stub, tmp_path: Path) -> None:
    path, url, seq = _record_two_step(stub, tmp_path)
    tap = WireTap()
    seen: list[BaseException] = []
    started = time.perf_counter()
    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        try:
            _changed_agent(url, tap)
        except BaseException as exc:
            seen.append(exc)
            raise
    elapsed = time.perf_counter() - started
    exc = info.value
    # The agent's own call raised the Divergence itself, not the SDK's wrapper of it.
    assert seen == [exc]
    assert not isinstance(exc, anthropic.APIConnectionError)
    assert elapsed < 5
    # One attempt reached the transport and got no response: the SDK (max_retries=2) did
    # not wrap the divergence in APIConnectionError and retry it.
    assert tap.requests == 1
    assert tap.attempts == []
    assert exc.step == seq
    assert exc.info.kind == "model"
    removed = [line for line in exc.diff.splitlines() if line.startswith("-")]
    added = [line for line in exc.diff.splitlines() if line.startswith("+")]
    assert any("the old prompt" in line for line in removed)
    assert any("the new prompt" in line for line in added)
    assert str(path) in str(exc)


def test_divergence_available_on_result_without_raising(stub, tmp_path: Path) -> None:
    path, url, seq = _record_two_step(stub, tmp_path)
    ctx = replayer.replay(path, raise_on_divergence=False)
    with ctx:
        with pytest.raises(recorder.Divergence):
            _changed_agent(url, WireTap())
    assert ctx.result is not None
    assert not ctx.result.identical
    assert ctx.result.divergence is not None
    assert ctx.result.divergence.step == seq
    assert "the new prompt" in ctx.result.divergence.diff
    assert "DIVERGED" in ctx.result.report()


def test_swallowed_divergence_is_raised_when_the_block_ends(stub, tmp_path: Path) -> None:
    path, url, seq = _record_two_step(stub, tmp_path)
    swallowed: list[BaseException] = []
    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        with sync_client(url) as client:
            recorder.now()
            try:
                client.messages.create(model=MODEL, max_tokens=32,
                                       messages=[{"role": "user", "content": "the new prompt"}])
            except Exception as exc:  # noqa: BLE001 - an agent that catches everything...
                swallowed.append(exc)
            # ...and goes on with the recorded call, so that no recorded step is left over:
            # only the swallowed divergence can make the block fail.
            client.messages.create(model=MODEL, max_tokens=32,
                                   messages=[{"role": "user", "content": "the old prompt"}])
    assert len(swallowed) == 1 and isinstance(swallowed[0], recorder.Divergence)
    assert info.value.step == seq
    assert "does not match the recording" in str(info.value)
    assert "the new prompt" in info.value.diff


def test_agent_stopping_early_names_the_first_unused_step(stub, tmp_path: Path) -> None:
    server = stub({"turns": [{"text": "a"}, {"text": "b"}, {"text": "c"}]})
    url = server.url
    path = tmp_path / "early.jsonl"

    def agent(calls: int) -> None:
        with sync_client(url) as client:
            for i in range(calls):
                client.messages.create(model=MODEL, max_tokens=32,
                                       messages=[{"role": "user", "content": f"q{i}"}])

    with recorder.record(path):
        agent(3)
    server.stop()

    ctx = replayer.replay(path)
    with pytest.raises(recorder.Divergence) as info, ctx:
        agent(1)
    assert info.value.step == 1
    assert "step 1" in str(info.value)
    assert ctx.result is not None
    assert ctx.result.unused == (1, 2)
    assert not ctx.result.complete
