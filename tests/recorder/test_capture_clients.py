"""Plain HTTP clients are captured as ``http`` observations and replay byte-identically.

A small stdlib server on 127.0.0.1 answers every request with fresh random bytes, so a
replay that returned the recorded bytes with the server stopped can only have served
them from the cassette.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import httpx2
import pytest
import requests

import recorder
import replayer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, body: bytes) -> None:
        payload = json.dumps({"method": self.command, "path": self.path,
                              "body": body.decode("latin-1"),
                              "nonce": secrets.token_hex(8)}).encode()
        # A non-UTF-8 tail: the bytes must survive the cassette exactly.
        payload += b"\n\xff\xfe" + secrets.token_bytes(8)
        self.send_response(200)
        self.send_header("content-type", "application/octet-stream")
        self.send_header("x-served-by", "capture-test")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        self._answer(b"")

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self._answer(self.rfile.read(length))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, addr


class LocalServer:
    def __init__(self) -> None:
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self._stopped = False

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)


@pytest.fixture
def server() -> Iterator[LocalServer]:
    srv = LocalServer()
    yield srv
    srv.stop()


# Each client does the same two calls: GET <url>/items?q=..&page=2 and POST <url>/submit.
Calls = Callable[[str, str, bytes], tuple[int, bytes, int, bytes]]


def _httpx_sync(base: str, query: str, body: bytes) -> tuple[int, bytes, int, bytes]:
    with httpx.Client(timeout=5) as client:
        got = client.get(f"{base}/items", params={"q": query, "page": "2"})
        sent = client.post(f"{base}/submit", content=body,
                           headers={"content-type": "application/json"})
        return got.status_code, got.content, sent.status_code, sent.content


def _httpx_async(base: str, query: str, body: bytes) -> tuple[int, bytes, int, bytes]:
    async def go() -> tuple[int, bytes, int, bytes]:
        async with httpx.AsyncClient(timeout=5) as client:
            got = await client.get(f"{base}/items", params={"q": query, "page": "2"})
            sent = await client.post(f"{base}/submit", content=body,
                                     headers={"content-type": "application/json"})
            return got.status_code, got.content, sent.status_code, sent.content
    return asyncio.run(go())


def _httpx2_sync(base: str, query: str, body: bytes) -> tuple[int, bytes, int, bytes]:
    with httpx2.Client(timeout=5) as client:
        got = client.get(f"{base}/items", params={"q": query, "page": "2"})
        sent = client.post(f"{base}/submit", content=body,
                           headers={"content-type": "application/json"})
        return got.status_code, got.content, sent.status_code, sent.content


def _httpx2_async(base: str, query: str, body: bytes) -> tuple[int, bytes, int, bytes]:
    async def go() -> tuple[int, bytes, int, bytes]:
        async with httpx2.AsyncClient(timeout=5) as client:
            got = await client.get(f"{base}/items", params={"q": query, "page": "2"})
            sent = await client.post(f"{base}/submit", content=body,
                                     headers={"content-type": "application/json"})
            return got.status_code, got.content, sent.status_code, sent.content
    return asyncio.run(go())


def _requests(base: str, query: str, body: bytes) -> tuple[int, bytes, int, bytes]:
    with requests.Session() as session:
        got = session.get(f"{base}/items", params={"q": query, "page": "2"}, timeout=5)
        sent = session.post(f"{base}/submit", data=body, timeout=5,
                            headers={"content-type": "application/json"})
        return got.status_code, got.content, sent.status_code, sent.content


def _aiohttp(base: str, query: str, body: bytes) -> tuple[int, bytes, int, bytes]:
    async def go() -> tuple[int, bytes, int, bytes]:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/items", params={"q": query, "page": "2"}) as got:
                got_body = await got.read()
            async with session.post(f"{base}/submit", data=body,
                                    headers={"content-type": "application/json"}) as sent:
                sent_body = await sent.read()
            return got.status, got_body, sent.status, sent_body
    return asyncio.run(go())


CLIENTS: dict[str, Calls] = {
    "httpx": _httpx_sync,
    "httpx-async": _httpx_async,
    "httpx2": _httpx2_sync,
    "httpx2-async": _httpx2_async,
    "requests": _requests,
    "aiohttp": _aiohttp,
}
BODY = b'{"name":"deja","n":1}'


def _record(server: LocalServer, calls: Calls, path: Path) -> tuple[int, bytes, int, bytes]:
    with recorder.record(path) as run:
        recorded = calls(server.url, "first", BODY)
    assert run.totals["http_calls"] == 2
    assert run.totals["model_calls"] == 0
    server.stop()
    return recorded


@pytest.mark.parametrize("name", list(CLIENTS))
def test_client_records_and_replays_byte_identical(name: str, server: LocalServer,
                                                   tmp_path: Path) -> None:
    calls = CLIENTS[name]
    path = tmp_path / f"{name}.jsonl"
    recorded = _record(server, calls, path)
    assert recorded[0] == recorded[2] == 200
    got = json.loads(recorded[1].split(b"\n\xff\xfe", 1)[0])
    assert got["method"] == "GET" and got["path"].startswith("/items?")
    sent = json.loads(recorded[3].split(b"\n\xff\xfe", 1)[0])
    assert sent["method"] == "POST" and sent["body"] == BODY.decode()

    cassette = recorder.load(path)
    obs = cassette.observations
    assert [o["kind"] for o in obs] == ["http", "http"]
    assert [o["method"] for o in obs] == ["GET", "POST"]
    assert obs[0]["url"].startswith(f"{server.url}/items?")
    assert obs[1]["request"]["body"] == json.loads(BODY)
    assert all(o["response"]["encoding"] == "base64" for o in obs)  # not UTF-8: exact bytes

    with pytest.raises(OSError), socket.create_connection(
            ("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=1):
        pass  # the server is gone: a replay cannot reach it

    ctx = replayer.replay(path, require_signature=True)
    with ctx:
        replayed = calls(server.url, "first", BODY)
    assert replayed == recorded
    assert ctx.result is not None
    assert ctx.result.identical, ctx.result.report()


@pytest.mark.parametrize("name", list(CLIENTS))
def test_client_changed_request_diverges(name: str, server: LocalServer,
                                         tmp_path: Path) -> None:
    calls = CLIENTS[name]
    path = tmp_path / f"{name}.jsonl"
    _record(server, calls, path)
    obs = recorder.load(path).observations

    # Another query string: the GET (step 0) no longer matches.
    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        calls(server.url, "second", BODY)
    assert info.value.step == obs[0]["seq"]
    assert info.value.info.kind == "http"
    assert "q=first" in info.value.diff and "q=second" in info.value.diff

    # Same GET, another POST body: the POST (step 1) no longer matches.
    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        calls(server.url, "first", b'{"name":"deja","n":2}')
    assert info.value.step == obs[1]["seq"]
    assert '"n": 1' in info.value.diff and '"n": 2' in info.value.diff
