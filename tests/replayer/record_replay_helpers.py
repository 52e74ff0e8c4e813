"""What the test_record_replay files share: a wire tap on the SDK's transport, clients
through it, and a replay that must come out identical.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
from conftest import API_KEY

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
