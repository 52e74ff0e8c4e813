"""Record a run of the real anthropic SDK against the stub server, then replay it offline.

Every test records with ``recorder.record`` while the stub answers, stops the stub, and
replays with ``replayer.replay`` pointing the client at the same (now closed) URL: the
replay cannot reach any network, so everything it gets comes from the cassette.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import anthropic._base_client as sdk_base_client
import httpx2
import pytest
import requests
from conftest import API_KEY, MODEL

import recorder
import replayer

USER = [{"role": "user", "content": "hi"}]


# ------------------------------------------------------------------------------ helpers


class _TapStream(httpx2.SyncByteStream, httpx2.AsyncByteStream):
    """Passes a response stream through unchanged and keeps a copy of every chunk."""

    def __init__(self, inner: Any, sink: list[bytes]) -> None:
        self._inner, self._sink = inner, sink

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._sink.append(chunk)
            yield chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._sink.append(chunk)
            yield chunk

    def close(self) -> None:
        self._inner.close()

    async def aclose(self) -> None:
        await self._inner.aclose()


class WireTap:
    """What the SDK saw on the wire: one entry per HTTP attempt, with the raw body bytes.

    It wraps a real ``httpx2.HTTPTransport`` (the class deja patches), so it sits between
    the SDK and deja and sees exactly the bytes the SDK consumed, streamed or not.
    """

    def __init__(self) -> None:
        self.requests = 0  # requests handed to the transport, before deja sees them
        self.attempts: list[list[bytes]] = []  # responses that came back

    @property
    def bodies(self) -> list[bytes]:
        return [b"".join(chunks) for chunks in self.attempts]

    def _wrap(self, response: Any) -> Any:
        sink: list[bytes] = []
        self.attempts.append(sink)
        response.stream = _TapStream(response.stream, sink)
        return response

    def client(self) -> httpx2.Client:
        tap = self

        class Transport(httpx2.BaseTransport):
            def __init__(self) -> None:
                self.inner = httpx2.HTTPTransport()

            def handle_request(self, request: httpx2.Request) -> httpx2.Response:
                tap.requests += 1
                return tap._wrap(self.inner.handle_request(request))

            def close(self) -> None:
                self.inner.close()

        return httpx2.Client(transport=Transport())

    def async_client(self) -> httpx2.AsyncClient:
        tap = self

        class Transport(httpx2.AsyncBaseTransport):
            def __init__(self) -> None:
                self.inner = httpx2.AsyncHTTPTransport()

            async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
                tap.requests += 1
                return tap._wrap(await self.inner.handle_async_request(request))

            async def aclose(self) -> None:
                await self.inner.aclose()

        return httpx2.AsyncClient(transport=Transport())


def sync_client(url: str, tap: WireTap | None = None, **kwargs: Any) -> anthropic.Anthropic:
    kwargs.setdefault("max_retries", 0)
    if tap is not None:
        kwargs["http_client"] = tap.client()
    return anthropic.Anthropic(base_url=url, api_key=API_KEY, **kwargs)


def async_client(url: str, tap: WireTap | None = None, **kwargs: Any) -> anthropic.AsyncAnthropic:
    kwargs.setdefault("max_retries", 0)
    if tap is not None:
        kwargs["http_client"] = tap.async_client()
    return anthropic.AsyncAnthropic(base_url=url, api_key=API_KEY, **kwargs)


def model_obs(path: Path) -> list[dict]:
    return [o for o in recorder.load(path).observations if o["kind"] == "model"]


def stored_bodies(path: Path) -> list[bytes]:
    """The response bodies of the cassette's model observations, as bytes."""
    out = []
    for obs in model_obs(path):
        response = obs.get("response")
        if response is None:
            continue
        assert "encoding" not in response
        out.append(response["body"].encode("utf-8"))
    return out


def replay_ok(path: Path, fn: Any, *args: Any) -> tuple[Any, replayer.ReplayResult]:
    """Run ``fn`` under a replay of ``path``; the result must be identical and verified."""
    ctx = replayer.replay(path, require_signature=True)
    with ctx:
        out = fn(*args)
    assert ctx.result is not None
    assert ctx.result.identical, ctx.result.report()
    assert ctx.result.verified
    assert ctx.result.steps_served == ctx.result.steps_recorded
    return out, ctx.result


async def replay_ok_async(path: Path, coro_fn: Any, *args: Any) -> tuple[Any, Any]:
    ctx = replayer.replay(path, require_signature=True)
    with ctx:
        out = await coro_fn(*args)
    assert ctx.result is not None
    assert ctx.result.identical, ctx.result.report()
    return out, ctx.result


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


# ------------------------------------------------------------------------------ tools


def test_tools_replay_recorded_results_without_running(tmp_path: Path) -> None:
    calls: list[tuple] = []

    @recorder.tool
    def lookup(city: str, *, units: str = "C") -> dict:
        calls.append(("lookup", city, units))
        return {"city": city, "temp": 21.5 if units == "C" else 70.7, "token": uuid.uuid4().hex}

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


# ---------------------------------------------------------------------------- secrets


class _CookieHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen_cookies: list[str] = []

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        type(self).seen_cookies.append(self.headers.get("cookie", ""))
        body = b'{"ok":true}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("set-cookie", "sid=setcookie-SECRET-654; Path=/")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _b64_forms(secret: str) -> list[bytes]:
    """The base64 text a secret shows up as, at every alignment inside a longer blob."""
    forms = []
    data = secret.encode()
    for pad in range(3):
        encoded = base64.b64encode(b"\x00" * pad + data)
        # Drop the characters that mix in the padding and the unaligned tail.
        core = encoded[4 if pad else 0:len(encoded) - 4]
        forms.extend([core, core.replace(b"+", b"-").replace(b"/", b"_")])
    forms.append(base64.b64encode(data))
    return [f for f in forms if len(f) >= 8]


def test_no_secret_reaches_the_cassette(stub, tmp_path: Path) -> None:
    server = stub({"turns": [{"text": "secret-free answer"}]})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _CookieHandler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    _CookieHandler.seen_cookies = []
    token, cookie = "tok-SECRET-987", "session=cookie-SECRET-321"
    path = tmp_path / "secrets.jsonl"
    try:
        with recorder.record(path, redact_headers=("x-custom-token",)):
            with sync_client(server.url, default_headers={"x-custom-token": token,
                                                          "cookie": cookie}) as client:
                client.messages.create(model=MODEL, max_tokens=32, messages=USER)
            base = f"http://127.0.0.1:{httpd.server_address[1]}"
            with requests.Session() as session:
                session.get(f"{base}/login", timeout=5).raise_for_status()
                session.get(f"{base}/me", timeout=5).raise_for_status()
    finally:
        httpd.shutdown()
        httpd.server_close()
        server.stop()

    # The secrets did go over the wire...
    sent = server.requests[0]["headers"]
    assert sent["authorization"] == f"Bearer {API_KEY}"  # anthropic 2.x: bearer auth
    assert sent["x-custom-token"] == token
    assert sent["cookie"] == cookie
    assert _CookieHandler.seen_cookies == ["", "sid=setcookie-SECRET-654"]

    # ...and none of them reached the cassette, in clear or base64.
    raw = path.read_bytes()
    secrets = [API_KEY, f"Bearer {API_KEY}", token, cookie, "cookie-SECRET-321",
               "setcookie-SECRET-654", "sid=setcookie-SECRET-654"]
    for secret in secrets:
        assert secret.encode() not in raw, secret
        for form in _b64_forms(secret):
            assert form not in raw, (secret, form)
    # Nothing of any of them either (the header is left out: it holds the test's argv).
    assert b"SECRET" not in raw.split(b"\n", 1)[1]
    cassette = recorder.load(path)
    assert [o["kind"] for o in cassette.observations] == ["model", "http", "http"]
    headers = {k.lower(): v for k, v in cassette.observations[0]["request_headers"]}
    assert headers["x-custom-token"] == "[redacted]"
    assert headers["authorization"] == "[redacted]"
    assert headers["cookie"] == "[redacted]"
    set_cookie = [v for k, v in cassette.observations[1]["response"]["headers"]
                  if k.lower() == "set-cookie"]
    assert set_cookie == ["[redacted]"]
    assert cassette.header["redact"]["headers"] == ["x-custom-token"]


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
