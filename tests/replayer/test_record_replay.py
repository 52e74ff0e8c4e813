"""Record a run of the real anthropic SDK against the stub server, then replay it offline.

Every test records with ``recorder.record`` while the stub answers, stops the stub, and
replays with ``replayer.replay`` pointing the client at the same (now closed) URL: the
replay cannot reach any network, so everything it gets comes from the cassette. Here: the
SDK's call shapes, retries, order and threads, and streams; divergence, tools and effects,
and secrets are in the other test_record_replay_*.py files.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import anthropic._base_client as sdk_base_client
import pytest
from conftest import MODEL
from record_replay_helpers import (
    USER,
    WireTap,
    async_client,
    model_obs,
    replay_ok,
    replay_ok_async,
    stored_bodies,
    sync_client,
)

import recorder
import replayer

# --------------------------------------------------------------- the SDK's call shapes


def test_sync_create_replays_byte_identical(stub, tmp_path: Path) -> None:
    server = stub({"turns": [{"text": "Hello there."}, {"text": "Second answer."}]})
    url = server.url

    def agent() -> list[tuple[str, bytes]]:
        out = []
        with sync_client(url) as client:
            for prompt in ("first", "second"):
                raw = client.messages.with_raw_response.create(
                    model=MODEL, max_tokens=32, messages=[{"role": "user", "content": prompt}])
                out.append((raw.parse().id, raw.http_response.content))
        return out

    path = tmp_path / "sync.jsonl"
    with recorder.record(path) as run:
        recorded = agent()
    server.stop()
    assert run.totals["model_calls"] == 2
    assert len(server.requests) == 2

    replayed, _ = replay_ok(path, agent)
    assert [mid for mid, _ in replayed] == [mid for mid, _ in recorded]
    assert [body for _, body in replayed] == [body for _, body in recorded]
    assert [body for _, body in recorded] == stored_bodies(path)
    assert [o["message_id"] for o in model_obs(path)] == [mid for mid, _ in recorded]


@pytest.mark.asyncio
async def test_async_create_replays_byte_identical(stub, tmp_path: Path) -> None:
    server = stub({"turns": [{"text": "Async hello."}]})
    url = server.url

    async def agent() -> tuple[str, bytes]:
        async with async_client(url) as client:
            raw = await client.messages.with_raw_response.create(
                model=MODEL, max_tokens=32, messages=USER)
            return (await raw.parse()).id, raw.http_response.content

    path = tmp_path / "async.jsonl"
    with recorder.record(path):
        recorded = await agent()
    server.stop()

    replayed, _ = await replay_ok_async(path, agent)
    assert replayed == recorded
    assert stored_bodies(path) == [recorded[1]]


def test_create_stream_events_and_raw_sse_replay(stub, tmp_path: Path) -> None:
    server = stub({"turns": [{"text": "one two three four five six seven"},
                             {"text": "raw bytes of a stream", "thinking": "hmm"}]})
    url = server.url

    def agent() -> tuple[list[dict], bytes, list[bytes]]:
        tap = WireTap()
        with sync_client(url, tap) as client:
            with client.messages.create(model=MODEL, max_tokens=64, messages=USER,
                                        stream=True) as stream:
                events = [event.model_dump() for event in stream]
            with client.messages.with_streaming_response.create(
                    model=MODEL, max_tokens=64, stream=True,
                    messages=[{"role": "user", "content": "raw"}]) as response:
                sse = b"".join(response.iter_bytes())
        return events, sse, tap.bodies

    path = tmp_path / "stream.jsonl"
    with recorder.record(path):
        recorded = agent()
    server.stop()
    events, sse, wire = recorded
    assert [e["type"] for e in events].count("content_block_delta") >= 2
    assert sse.startswith(b"event: message_start")

    replayed, _ = replay_ok(path, agent)
    assert replayed[0] == events  # every raw event, message id included
    assert replayed[0][0]["message"]["id"] == events[0]["message"]["id"]
    assert replayed[1] == sse
    assert replayed[2] == wire
    assert wire[1] == sse
    assert stored_bodies(path) == wire
    obs = model_obs(path)
    assert all(o["stream"] for o in obs)
    assert obs[0]["message_id"] == events[0]["message"]["id"]


def test_messages_stream_sync_replays(stub, tmp_path: Path) -> None:
    server = stub({"turns": [{"text": "streamed with the helper", "tool_use": {
        "name": "search", "input": {"query": "deja"}}}]})
    url = server.url

    def agent() -> tuple[dict, list[str], list[bytes]]:
        tap = WireTap()
        with sync_client(url, tap) as client:
            with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
                texts = list(stream.text_stream)
                final = stream.get_final_message()
        return final.model_dump(), texts, tap.bodies

    path = tmp_path / "helper.jsonl"
    with recorder.record(path):
        recorded = agent()
    server.stop()
    assert recorded[0]["content"][1]["type"] == "tool_use"

    replayed, _ = replay_ok(path, agent)
    assert replayed[0]["id"] == recorded[0]["id"]
    assert replayed == recorded
    assert stored_bodies(path) == recorded[2]


@pytest.mark.asyncio
async def test_messages_stream_async_replays(stub, tmp_path: Path) -> None:
    server = stub({"turns": [{"text": "async helper stream"}, {"text": "second async"}]})
    url = server.url

    async def agent() -> tuple[list[str], list[bytes]]:
        tap = WireTap()
        ids = []
        async with async_client(url, tap) as client:
            for prompt in ("a", "b"):
                async with client.messages.stream(
                        model=MODEL, max_tokens=64,
                        messages=[{"role": "user", "content": prompt}]) as stream:
                    ids.append((await stream.get_final_message()).id)
        return ids, tap.bodies

    path = tmp_path / "async-helper.jsonl"
    with recorder.record(path):
        recorded = await agent()
    server.stop()

    replayed, _ = await replay_ok_async(path, agent)
    assert replayed[0] == recorded[0]
    assert replayed[1] == recorded[1]
    assert stored_bodies(path) == recorded[1]


class _SleepLog:
    """Stands in for ``time`` in the SDK module while *recording* only: logs the backoff."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


def test_overloaded_then_success_replays_without_backoff(stub, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    server = stub({"turns": [{"error": {"status": 529, "retry_after": 30}},
                             {"text": "after the retry"}]})
    url = server.url

    def agent() -> tuple[str, bytes, int]:
        tap = WireTap()
        with sync_client(url, tap, max_retries=2) as client:
            raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=32,
                                                           messages=USER)
            return raw.parse().id, raw.http_response.content, len(tap.attempts)

    path = tmp_path / "retry.jsonl"
    # Recording: the SDK really gets the 529 with retry-after: 30 and really retries; only
    # its wait is logged instead of slept, to keep the suite fast. The log proves the SDK
    # honoured the 30 s, so a replay that did not skip the backoff would take 30 s.
    sleep_log = _SleepLog()
    with monkeypatch.context() as patch:
        patch.setattr(sdk_base_client, "time", sleep_log)
        with recorder.record(path):
            recorded = agent()
    assert sleep_log.sleeps == [30.0]
    assert recorded[2] == 2
    server.stop()

    obs = model_obs(path)
    assert [o["response"]["status"] for o in obs] == [529, 200]
    assert ["retry-after", "30"] in [[k.lower(), v] for k, v in obs[0]["response"]["headers"]]
    assert obs[0]["fp"] == obs[1]["fp"]

    assert sdk_base_client.time is time  # nothing of the recording's stand-in is left
    started = time.perf_counter()
    replayed, _ = replay_ok(path, agent)
    elapsed = time.perf_counter() - started
    # A functional check, not a benchmark: the recorded 529 says "retry after 30 s"; a
    # replay under 10 s means deja skipped the SDK's backoff sleep.
    assert elapsed < 10
    assert replayed == recorded
    assert stored_bodies(path)[1] == recorded[1]


def test_transport_error_then_success_replays(stub, tmp_path: Path) -> None:
    server = stub({"turns": [{"drop": "before_headers"}, {"text": "made it"}]})
    url = server.url

    def agent() -> tuple[str, int, int]:
        tap = WireTap()
        with sync_client(url, tap, max_retries=1) as client:
            message = client.messages.create(model=MODEL, max_tokens=32, messages=USER)
            # Two attempts; the failed one never produced a response.
            return message.id, tap.requests, len(tap.attempts)

    path = tmp_path / "drop.jsonl"
    with recorder.record(path) as run:
        recorded = agent()
    server.stop()
    assert len(server.requests) == 2
    assert recorded[1:] == (2, 1)

    failed, ok = model_obs(path)
    assert failed["error"]["has_response"] is False
    assert failed["error"]["type"]
    assert "response" not in failed
    assert "error" not in ok and ok["message_id"] == recorded[0]
    assert run.totals["errors"] == 1

    replayed, result = replay_ok(path, agent)
    assert replayed == recorded
    assert result.steps_served == 2


# ------------------------------------------------------------------- order and threads


def test_identical_calls_are_served_in_recorded_order(stub, tmp_path: Path) -> None:
    server = stub({"turns": [{"text": "first"}, {"text": "second"}, {"text": "third"}]})
    url = server.url

    def agent() -> list[tuple[str, str]]:
        with sync_client(url) as client:
            out = []
            for _ in range(3):
                m = client.messages.create(model=MODEL, max_tokens=32, messages=USER)
                out.append((m.id, m.content[0].text))
            return out

    path = tmp_path / "same.jsonl"
    with recorder.record(path):
        recorded = agent()
    server.stop()
    assert [text for _, text in recorded] == ["first", "second", "third"]
    assert len({o["fp"] for o in model_obs(path)}) == 1

    replayed, _ = replay_ok(path, agent)
    assert replayed == recorded


def test_concurrent_calls_each_get_their_own_response(stub, tmp_path: Path) -> None:
    server = stub({"default": {"text": "answer to {echo}", "delay_ms": 20}})
    url = server.url
    prompts = [f"question {i}" for i in range(8)]

    def run_threads(client: anthropic.Anthropic, order: list[int], *,
                    one_at_a_time: bool) -> dict[int, tuple[str, str]]:
        results: dict[int, tuple[str, str]] = {}
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(order)) if not one_at_a_time else None

        def work(i: int) -> None:
            try:
                if barrier is not None:
                    barrier.wait(timeout=10)
                m = client.messages.create(
                    model=MODEL, max_tokens=32, messages=[{"role": "user", "content": prompts[i]}])
                results[i] = (m.id, m.content[0].text)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in order]
        for thread in threads:
            thread.start()
            if one_at_a_time:
                thread.join()
        for thread in threads:
            thread.join()
        assert not errors, errors
        return results

    path = tmp_path / "threads.jsonl"
    with recorder.record(path), sync_client(url) as client:
        recorded = run_threads(client, list(range(8)), one_at_a_time=False)
    server.stop()
    assert {i: text for i, (_, text) in recorded.items()} == {
        i: f"answer to {p}" for i, p in enumerate(prompts)}

    # Replay in the reverse of the order the cassette holds the calls in.
    cassette = recorder.load(path)
    recorded_order = [prompts.index(cassette.request_of(o["seq"])["messages"][0]["content"])
                      for o in cassette.observations if o["kind"] == "model"]
    assert sorted(recorded_order) == list(range(8))
    ctx = replayer.replay(path)
    with ctx, sync_client(url) as client:
        replayed = run_threads(client, recorded_order[::-1], one_at_a_time=True)
    assert replayed == recorded
    assert ctx.result is not None and ctx.result.identical


# --------------------------------------------------------------------- stream teeing


def test_stream_reaches_the_caller_while_recording(stub, tmp_path: Path) -> None:
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
    server = stub({"turns": [{"text": text, "event_delay_ms": 200}]})
    path = tmp_path / "tee.jsonl"
    with recorder.record(path), sync_client(server.url) as client:
        started = time.perf_counter()
        first_event = first_delta = None
        with client.messages.create(model=MODEL, max_tokens=64, messages=USER,
                                    stream=True) as stream:
            for event in stream:
                now = time.perf_counter() - started
                if first_event is None:
                    first_event = now
                if first_delta is None and event.type == "content_block_delta":
                    first_delta = now
        total = time.perf_counter() - started
    server.stop()
    assert first_event is not None and first_delta is not None
    # Relative times within this one run: events arrive as the stub sends them (9 gaps of
    # 200 ms), not all at once when the stream ends.
    assert total > 1.2
    assert first_event < total / 4
    assert first_delta < total / 2
    (obs,) = model_obs(path)
    assert obs["stream"] is True
    assert 0 < obs["ttft_ms"] < obs["ms"] / 4
    assert json.loads(
        obs["response"]["body"].split("data: ", 1)[1].split("\n", 1)[0]
    )["type"] == "message_start"


def test_replay_needs_no_network(stub, tmp_path: Path) -> None:
    """Replay opens no connection: the stopped stub's port refuses, and replay still works."""
    server = stub({"turns": [{"text": "offline"}]})
    url, port = server.url, server.port
    path = tmp_path / "offline.jsonl"
    with recorder.record(path), sync_client(url) as client:
        recorded = client.messages.create(model=MODEL, max_tokens=32, messages=USER).id
    server.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass

    def agent() -> str:
        with sync_client(url) as client:
            return client.messages.create(model=MODEL, max_tokens=32, messages=USER).id

    replayed, _ = replay_ok(path, agent)
    assert replayed == recorded
