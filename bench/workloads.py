"""Shared workload for the benchmarks: the real anthropic SDK against deja's stub server.

Everything here is offline (127.0.0.1). A measurement starts its own stub server and
stops it when done (:func:`stub`), works in its own temporary directory (:func:`tempdir`),
and checks before and after that no HTTP patches (deja's or vcrpy's) are left active
(:func:`assert_unpatched`), so deja and vcrpy are never measured on top of each other.
"""

from __future__ import annotations

import contextlib
import gc
import http.client
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2

import recorder
from recorder.testing.server import StubServer

MODEL = "claude-sonnet-4-6"
API_KEY = "sk-bench"
MAX_TOKENS = 64
ECHO_SCRIPT = {"default": {"text": "ok {echo}"}}

# The transport methods both deja and vcrpy patch, as they are with nothing installed.
_PRISTINE: dict[str, Any] = {
    "httpx2.HTTPTransport.handle_request": httpx2.HTTPTransport.handle_request,
    "httpx2.AsyncHTTPTransport.handle_async_request":
        httpx2.AsyncHTTPTransport.handle_async_request,
    "http.client.HTTPConnection": http.client.HTTPConnection,
    "http.client.HTTPSConnection": http.client.HTTPSConnection,
}


def _current() -> dict[str, Any]:
    return {
        "httpx2.HTTPTransport.handle_request": httpx2.HTTPTransport.handle_request,
        "httpx2.AsyncHTTPTransport.handle_async_request":
            httpx2.AsyncHTTPTransport.handle_async_request,
        "http.client.HTTPConnection": http.client.HTTPConnection,
        "http.client.HTTPSConnection": http.client.HTTPSConnection,
    }


def assert_unpatched(where: str) -> None:
    """Fail loudly if a deja session or a vcrpy cassette is still patching HTTP."""
    changed = [name for name, obj in _current().items() if obj is not _PRISTINE[name]]
    if changed or recorder.active() is not None:
        raise RuntimeError(f"{where}: HTTP patches still active ({changed or 'deja session'}); "
                           "a previous measurement leaked its patches")


def prompt(i: int) -> str:
    """A small prompt, distinct per call, so that every request fingerprint differs."""
    return f"bench prompt {i}: name one prime above {i}"


def client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=API_KEY)


def call(c: anthropic.Anthropic, i: int) -> Any:
    return c.messages.create(model=MODEL, max_tokens=MAX_TOKENS,
                             messages=[{"role": "user", "content": prompt(i)}])


def check_echo(messages: list[Any], indices: list[int] | range) -> None:
    """Every response is the stub's echo of its own prompt (served or replayed right)."""
    for msg, i in zip(messages, indices, strict=True):
        text = msg.content[0].text
        if text != f"ok {prompt(i)}":
            raise RuntimeError(f"call {i}: unexpected response text {text!r}")


def calls(c: anthropic.Anthropic, indices: list[int] | range) -> list[Any]:
    return [call(c, i) for i in indices]


def timed_calls(c: anthropic.Anthropic,
                indices: list[int] | range) -> tuple[list[float], list[Any]]:
    """Per-call wall times (seconds) and the responses."""
    times, out = [], []
    for i in indices:
        t0 = time.perf_counter()
        out.append(call(c, i))
        times.append(time.perf_counter() - t0)
    return times, out


@contextlib.contextmanager
def stub(script: dict[str, Any] | None = None) -> Iterator[StubServer]:
    """A stub Anthropic server for one measurement; always stopped."""
    server = StubServer(script or ECHO_SCRIPT).start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def tempdir(name: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=f"deja-bench-{name}-") as d:
        yield Path(d)


@contextlib.contextmanager
def measurement(name: str) -> Iterator[None]:
    """Bracket a measurement: no patches leaked in or out, garbage collected first."""
    assert_unpatched(f"before {name}")
    gc.collect()
    try:
        yield
    finally:
        assert_unpatched(f"after {name}")


def vcr_instance(record_mode: str) -> Any:
    """vcrpy as a user would set it up: record with its defaults (record_mode="all"; the
    matchers do not change what is recorded), replay matching method, URI and body (the
    requests all go to one URI, so the body is what tells them apart)."""
    import vcr

    if record_mode == "none":
        return vcr.VCR(record_mode="none", match_on=["method", "uri", "body"])
    return vcr.VCR(record_mode=record_mode)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def ms(seconds: float) -> float:
    return seconds * 1000.0


def rounds(n: int, order: list[str]) -> Iterator[tuple[int, list[str]]]:
    """``n`` rounds of ``order``, rotated each round so no variant always runs first."""
    for r in range(n):
        k = r % len(order)
        yield r, order[k:] + order[:k]


def run_blocks(blocks: dict[str, Callable[[], None]], n_rounds: int) -> None:
    for _, order in rounds(n_rounds, list(blocks)):
        for name in order:
            gc.collect()
            blocks[name]()
