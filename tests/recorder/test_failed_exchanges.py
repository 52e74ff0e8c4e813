"""An HTTP call that fails before a response is a line, and a replay fails it the same way.

requests, urllib and aiohttp go through vcrpy's stubs, which hand deja an exchange only
once its response has come: a refused connection, a timeout or a disconnect left no line
(httpx's stub logged one), so the replay of a program that met one diverged ("extra
call") where the program should have met its error again. Each client here calls a real
server on 127.0.0.1 that refuses, stalls or hangs up; the cassette must hold the failed
exchange, and a replay must raise what the client raised while recording: the same class
(for aiohttp's ``ClientConnectorError``, whose constructor wants a live connection, the
class above it), with the same text.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import pytest
import requests
from conftest import http_server

import recorder
import replayer
from recorder.capture._vcr_errors import replayed

TIMEOUT = 0.5  # the client's; the stalling server answers only once the test is over
_released = threading.Event()


class _Stalls(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        _released.wait(60)


class _HangsUp(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.close_connection = True  # no status line: the client reads end of file


@pytest.fixture
def refused() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/x"


@pytest.fixture
def stalls() -> Iterator[str]:
    _released.clear()
    with http_server(_Stalls) as base:
        try:
            yield base + "/x"
        finally:
            _released.set()


@pytest.fixture
def hangs_up() -> Iterator[str]:
    with http_server(_HangsUp) as base:
        yield base + "/x"


def _requests(url: str) -> Any:
    return requests.get(url, timeout=TIMEOUT)


def _urllib(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        return response.read()


def _aiohttp(url: str) -> Any:
    async def go() -> bytes:
        timeout = aiohttp.ClientTimeout(sock_read=TIMEOUT, sock_connect=TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.get(url) as response:
            return await response.read()
    return asyncio.run(go())


def _httpx2(url: str) -> Any:
    return httpx2.get(url, timeout=TIMEOUT)


CLIENTS: dict[str, Callable[[str], Any]] = {
    "requests": _requests, "urllib": _urllib, "aiohttp": _aiohttp, "httpx2": _httpx2}


def _raised(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - what the program met is the subject
        return exc
    raise AssertionError("the call did not fail")


@pytest.mark.parametrize("failure", ["refused", "stalls", "hangs_up"])
@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_call_that_fails_is_logged_and_fails_the_same_way_on_replay(
        request: pytest.FixtureRequest, tmp_path: Path, client: str, failure: str) -> None:
    url = request.getfixturevalue(failure)
    call = CLIENTS[client]
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        live = _raised(lambda: call(url))
        after = _raised(lambda: call(url))  # a program that tries again
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    failed = [line for line in lines if line.get("kind") == "http"]
    assert len(failed) == 2, lines
    assert all(line["error"]["has_response"] is False and "response" not in line
               for line in failed), failed
    ctx = replayer.replay(path)
    with ctx:
        again = _raised(lambda: call(url))
        again_after = _raised(lambda: call(url))
    assert ctx.result is not None and ctx.result.identical, ctx.result.report()
    for recorded, replayed_exc in ((live, again), (after, again_after)):
        # the class recorded, or the nearest one above it
        assert isinstance(recorded, type(replayed_exc)), (recorded, replayed_exc)
        assert type(replayed_exc) is not Exception
        if type(replayed_exc) is type(recorded):
            assert str(replayed_exc) == str(recorded)
        if isinstance(recorded, OSError) and type(replayed_exc) is type(recorded):
            assert replayed_exc.errno == recorded.errno, (recorded, replayed_exc)


def test_a_failure_of_another_client_or_a_class_no_client_raises_is_a_connection_error(
        ) -> None:
    foreign = {"type": "ConnectError", "module": "httpx", "message": "refused"}
    assert type(replayed(foreign, "urllib3")) is ConnectionError
    assert type(replayed(foreign, "aiohttp")) is aiohttp.ClientConnectionError
    # a cassette names a class; only an error class of the client's own is made
    for hostile in ({"type": "system", "module": "os", "message": "id"},
                    {"type": "ValueError", "module": "builtins", "message": "x"},
                    {"type": "Popen", "module": "subprocess", "message": "id"},
                    {"type": "HTTPError.__init__", "module": "urllib3.exceptions",
                     "message": "x"}):
        for client, fallback in (("urllib3", ConnectionError), ("http.client", ConnectionError),
                                 ("aiohttp", aiohttp.ClientConnectionError)):
            assert type(replayed(hostile, client)) is fallback, (hostile, client)
    refused = {"type": "NewConnectionError", "module": "urllib3.exceptions",
               "message": "HTTPConnection(host='h', port=1): Failed to establish"}
    made = replayed(refused, "urllib3")
    assert type(made).__name__ == "NewConnectionError" and str(made) == refused["message"]
    assert type(replayed(refused, "http.client")) is ConnectionError  # not urllib's to raise
    # an OSError keeps its number: a program that reads errno reads what it read live
    errno_111 = {"type": "ConnectionRefusedError", "module": "builtins",
                 "message": "[Errno 111] Connection refused"}
    made = replayed(errno_111, "http.client")
    assert type(made) is ConnectionRefusedError and isinstance(made, OSError)
    assert (made.errno, made.strerror, str(made)) == (111, "Connection refused",
                                                      errno_111["message"])
