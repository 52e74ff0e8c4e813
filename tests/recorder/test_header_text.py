"""Headers that are not ASCII, and headers an auth flow adds after a request was sent.

A response header's value may be UTF-8 or Latin-1 bytes; a recording keeps the text httpx
(or the proxy) read, and a replay must serve bytes that read back as that text, never
fail inside httpx. A request's headers are recorded as they were sent, though an auth
flow answering its 401 adds to the same request object afterwards.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import aiohttp
import httpx2
import pytest
import requests
from conftest import http_server

import recorder
import replayer
from deja.proxy._wire import served_headers
from recorder.capture.exchange import header_bytes
from recorder.cassette import load

MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-6",
           "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
           "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}}
REQUEST = json.dumps({"model": "claude-sonnet-4-6", "max_tokens": 8,
                      "messages": [{"role": "user", "content": "hi"}]}).encode()
# (header name, the bytes the server sends, the text httpx reads them as)
UTF8 = [("x-note", "café €".encode(), "café €")]
LATIN1 = [("x-note", "café".encode("latin-1"), "café"),
          ("x-sign", "a ± b".encode("latin-1"), "a ± b")]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    extra: list[tuple[str, bytes, str]] = []
    seen: list[str | None] = []

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: bytes, headers: list[tuple[str, bytes]]) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        for name, value in headers:  # raw bytes: send_header would encode them as Latin-1
            self._headers_buffer.append(name.encode("ascii") + b": " + value + b"\r\n")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/v1/messages":
            self._reply(200, json.dumps(MESSAGE).encode(),
                        [(name, raw) for name, raw, _ in self.extra])
            return
        auth = self.headers.get("authorization")
        type(self).seen.append(auth)
        if auth is None:  # the digest challenge: the client asks again, answering it
            self._reply(401, b"{}", [("www-authenticate",
                                      b'Digest realm="deja", nonce="abc123", qop="auth"')])
        else:
            self._reply(200, b'{"ok": true}', [])


@pytest.fixture
def server() -> Iterator[str]:
    with http_server(_Handler) as base:
        yield base


@pytest.mark.parametrize("extra", [UTF8, LATIN1], ids=["utf-8", "latin-1"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_response_header_that_is_not_ascii_replays_as_the_text_recorded(
        server: str, tmp_path, extra: list[tuple[str, bytes, str]], asynchronous: bool) -> None:
    _Handler.extra = extra
    path = tmp_path / "headers.jsonl"

    def call() -> httpx2.Response:
        headers = {"content-type": "application/json", "x-api-key": "sk-test"}
        if not asynchronous:
            with httpx2.Client() as client:
                return client.post(f"{server}/v1/messages", headers=headers, content=REQUEST)

        async def go() -> httpx2.Response:
            async with httpx2.AsyncClient() as client:
                return await client.post(f"{server}/v1/messages", headers=headers,
                                         content=REQUEST)
        return asyncio.run(go())

    with recorder.record(path):
        live = call()
    for name, _, text in extra:
        assert live.headers[name] == text
    stored = dict((k, v) for k, v in load(path).observations[0]["response"]["headers"])
    assert [stored[name] for name, _, _ in extra] == [text for _, _, text in extra]
    with replayer.replay(path):
        again = call()
    assert again.headers.multi_items() == live.headers.multi_items()
    assert again.content == live.content


HEADERS = {"content-type": "application/json", "x-api-key": "sk-test"}


def _requests(url: str) -> tuple[str | None, bytes]:
    response = requests.post(url, headers=HEADERS, data=REQUEST, timeout=30)
    return response.headers.get("x-note"), response.content


def _urllib(url: str) -> tuple[str | None, bytes]:
    request = urllib.request.Request(url, data=REQUEST, headers=HEADERS, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.headers.get("x-note"), response.read()


def _aiohttp(url: str) -> tuple[str | None, bytes]:
    async def go() -> tuple[str | None, bytes]:
        async with aiohttp.ClientSession() as session, \
                session.post(url, headers=HEADERS, data=REQUEST) as response:
            return response.headers.get("x-note"), await response.read()
    return asyncio.run(go())


@pytest.mark.parametrize("extra", [UTF8, LATIN1], ids=["utf-8", "latin-1"])
@pytest.mark.parametrize("client", [_requests, _urllib, _aiohttp],
                         ids=["requests", "urllib", "aiohttp"])
def test_other_clients_see_a_header_that_is_not_ascii_as_they_do_without_deja(
        server: str, tmp_path, extra: list[tuple[str, bytes, str]],
        client: Callable[[str], tuple[str | None, bytes]]) -> None:
    """Recording shows the client the header as it reads it without deja, and a replay
    shows it the same again; aiohttp reads bytes that are not UTF-8 as escapes no cassette
    can hold: recorded as their Latin-1 reading (before, the call failed)."""
    _Handler.extra = extra
    url, path = f"{server}/v1/messages", tmp_path / "client.jsonl"
    plain = client(url)
    with recorder.record(path):
        live = client(url)
    with replayer.replay(path):
        again = client(url)
    assert live[0] == plain[0]
    escaped = client is _aiohttp and extra is LATIN1
    assert again[0] == (extra[0][2] if escaped else live[0])
    assert again[1] == live[1]


def test_served_header_bytes_read_back_as_the_text_recorded() -> None:
    """Through the proxy too: text any recording keeps goes out as bytes, none refused."""
    for pairs in ([("x-note", "café €"), ("x-plain", "ok")], [("x-note", "café")],
                  [("x-odd", "\ud800")]):
        sent = served_headers(pairs, 2)
        assert sent[-1] == (b"content-length", b"2")
        read = httpx2.Headers(sent[:-1])
        if pairs[0][1] != "\ud800":
            assert read.multi_items() == pairs
        assert header_bytes(pairs) == sent[:-1]


def test_request_headers_are_recorded_as_sent_before_an_auth_flow_answers_a_401(
        server: str, tmp_path) -> None:
    _Handler.seen = []
    path = tmp_path / "digest.jsonl"
    with recorder.record(path), httpx2.Client(auth=httpx2.DigestAuth("user", "pw")) as client:
        response = client.post(f"{server}/data", content=b"{}")
    assert response.status_code == 200
    assert _Handler.seen[0] is None and _Handler.seen[1] is not None  # the flow ran
    lines = load(path).observations
    assert [line["response"]["status"] for line in lines] == [401, 200]
    names = [[k.lower() for k, _ in line["request"]["headers"]] for line in lines]
    assert "authorization" not in names[0]  # not sent with the first request
    assert "authorization" in names[1]
