"""What a program reads of a response through its client is, on replay, what it read live.

Each case calls a real server on 127.0.0.1 live, under ``recorder.record`` and under
``replayer.replay``, through the client named, and compares what the program got:

- aiohttp told not to decompress (``auto_decompress=False``) gets the compressed bytes;
- a body that is itself gzip (a ``.gz`` file sent with ``content-encoding: gzip``) loses
  one layer of gzip, not two, through every client;
- a ``set-cookie`` sets the cookie it set live (its value redacted): the whole header
  redacted made a cookie named ``[redacted]``, which httpx's cookie mapping could not read;
- requests' ``iter_content`` yields the chunks it yielded live, no empty one after them;
- aiohttp's ``text()`` decodes by the response's charset and ``json()`` refuses a body
  that is not JSON by its content type, as aiohttp does;
- a multipart upload replays, though each client draws a new random boundary for every
  request (it diverged: the body never matched the recorded one);
- urllib sends a body of unknown length (a generator) in chunks; recorded, it goes out
  whole with its length (it went out unframed under a chunked header, and the server
  read it as chunks);
- an aiohttp form (a dict, or a ``FormData`` with a file) is recorded and replays (its
  body, which aiohttp encodes only as it sends it, failed the program's call with a
  ``TypeError`` while recording);
- an aiohttp redirect is followed on replay with the method aiohttp follows it with live
  (vcrpy asked for every redirect with GET: a POST redirected by a 307 or a 308, or a PUT
  by a 302, diverged).
"""

from __future__ import annotations

import asyncio
import gzip
import json
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

INNER = gzip.compress(b"the file inside", mtime=0)
FILE = bytes(range(256)) * 3  # not UTF-8: the body is stored as base64
SECRET = b"sk-ant-api03-" + b"Q7x" * 14


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, body: bytes, *headers: tuple[str, str]) -> None:
        self.send_response(200)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> bytes:
        if "chunked" not in self.headers.get("transfer-encoding", ""):
            return self.rfile.read(int(self.headers["content-length"]))
        body = b""
        while size := int(self.rfile.readline().strip(), 16):
            body += self.rfile.read(size)
            self.rfile.readline()
        self.rfile.readline()
        return body

    def do_POST(self) -> None:  # an upload: its size and whether the file is in it
        if self.path.startswith("/moved/"):  # /moved/307: a redirect of that status
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(int(self.path.rpartition("/")[2]))
            self.send_header("location", "/landed")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        body = self._body() if self.path != "/landed" else \
            self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/landed":  # the method a redirect was followed with, and its body
            self._send(json.dumps({"method": self.command, "size": len(body)}).encode(),
                       ("content-type", "application/json"))
            return
        if self.path == "/echo":
            self._send(body, ("content-type", "application/octet-stream"))
            return
        self._send(json.dumps({"size": len(body), "has": FILE in body}).encode(),
                   ("content-type", "application/json"))

    def do_PUT(self) -> None:
        self.do_POST()

    def do_GET(self) -> None:
        if self.path == "/landed":
            self.do_POST()
            return
        if self.path == "/xgz":  # aiohttp does not decode x-gzip: it hands it on
            self._send(gzip.compress(b'{"token": "' + SECRET + b'"}'),
                       ("content-encoding", "x-gzip"))
            return
        if self.path == "/go":
            self.send_response(302)
            self.send_header("location", "/broken")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        if self.path == "/broken":
            self.send_response(500)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        if self.path == "/gz":
            self._send(gzip.compress(b'{"a": 1}'), ("content-encoding", "gzip"))
        elif self.path == "/file.gz":  # a gzip file, gzip-encoded on the way
            self._send(gzip.compress(INNER), ("content-type", "application/gzip"),
                       ("content-encoding", "gzip"))
        elif self.path == "/cookie":
            self._send(b"{}", ("set-cookie", "sid=s3cr3t-value; Path=/; HttpOnly"),
                       ("set-cookie", "theme=dark; Path=/"))
        elif self.path == "/latin1":
            self._send("café".encode("latin-1"), ("content-type", "text/plain; charset=iso-8859-1"))
        elif self.path == "/notjson":
            self._send(b'{"k": 1}', ("content-type", "text/plain"))
        else:  # /chunks: one body read in pieces
            self._send(b"x" * 10_000, ("content-type", "application/octet-stream"))


@pytest.fixture
def base() -> Iterator[str]:
    with http_server(_Handler) as url:
        yield url


def _three(path: Path, call: Callable[[], Any]) -> tuple[Any, Any, Any]:
    """What ``call`` returns live, recorded (into ``path``) and replayed."""
    live = call()
    with recorder.record(path):
        recorded = call()
    with replayer.replay(path):
        replayed = call()
    return live, recorded, replayed


def _aiohttp(coro: Callable[[aiohttp.ClientSession], Any], **session: Any) -> Any:
    async def go() -> Any:
        # a jar that takes cookies from an IP address (the server is 127.0.0.1)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True),
                                         **session) as s:
            return await coro(s)
    return asyncio.run(go())


async def _read(s: aiohttp.ClientSession, url: str, **options: Any) -> bytes:
    async with s.get(url, **options) as response:
        return await response.read()


def test_aiohttp_told_not_to_decompress_gets_the_compressed_bytes(tmp_path: Path,
                                                                  base: str) -> None:
    by_session = _three(tmp_path / "run1.jsonl", lambda: _aiohttp(lambda s: _read(s, base + "/gz"),
                                                    auto_decompress=False))
    assert by_session[0][:2] == b"\x1f\x8b"
    assert gzip.decompress(by_session[0]) == b'{"a": 1}'
    assert all(gzip.decompress(got) == b'{"a": 1}' for got in by_session)
    by_request = _three(tmp_path / "run2.jsonl", lambda: _aiohttp(
        lambda s: _read(s, base + "/gz", auto_decompress=False)))
    assert all(got[:2] == b"\x1f\x8b" for got in by_request), by_request
    assert _three(tmp_path / "run3.jsonl", lambda: _aiohttp(lambda s: _read(s, base + "/gz"))) \
        == (b'{"a": 1}',) * 3


@pytest.mark.parametrize("client", ["requests", "aiohttp", "httpx2"])
def test_a_gzip_file_sent_gzip_encoded_loses_one_layer(tmp_path: Path, base: str,
                                                       client: str) -> None:
    url = base + "/file.gz"
    call: Callable[[], bytes] = {
        "requests": lambda: requests.get(url, timeout=30).content,
        "aiohttp": lambda: _aiohttp(lambda s: _read(s, url)),
        "httpx2": lambda: httpx2.get(url, timeout=30).content}[client]
    assert _three(tmp_path / "run4.jsonl", call) == (INNER, INNER, INNER)


def test_a_set_cookie_sets_its_cookie_with_the_value_redacted(tmp_path: Path,
                                                              base: str) -> None:
    url = base + "/cookie"

    def jars() -> dict[str, Any]:
        with requests.Session() as rs:
            rs.get(url, timeout=30)
            by_requests = sorted(rs.cookies.keys())
        with httpx2.Client() as hc:
            hc.get(url)
            by_httpx = dict(hc.cookies)  # raised KeyError for a cookie named [redacted]

        async def aio(s: aiohttp.ClientSession) -> list[str]:
            async with s.get(url) as response:
                await response.read()
            return sorted(c.key for c in s.cookie_jar)
        return {"requests": by_requests, "httpx": sorted(by_httpx),
                "aiohttp": _aiohttp(aio), "sid": by_httpx.get("sid")}

    live, recorded, replayed = _three(tmp_path / "run5.jsonl", jars)
    names = ["sid", "theme"]
    for got in (live, recorded, replayed):
        assert (got["requests"], got["httpx"], got["aiohttp"]) == (names, names, names), got
    assert live["sid"] == recorded["sid"] == "s3cr3t-value"
    assert replayed["sid"] == "[redacted]"
    assert b"s3cr3t-value" not in (tmp_path / "run5.jsonl").read_bytes()


def test_requests_iter_content_yields_the_chunks_it_yielded_live(tmp_path: Path,
                                                                 base: str) -> None:
    def chunks() -> list[int]:
        with requests.get(base + "/chunks", stream=True, timeout=30) as response:
            return [len(c) for c in response.iter_content(4096)]
    assert _three(tmp_path / "run6.jsonl", chunks) == ([4096, 4096, 1808],) * 3


def test_aiohttp_text_and_json_read_as_aiohttp_reads_them(tmp_path: Path, base: str) -> None:
    async def text(s: aiohttp.ClientSession) -> str:
        async with s.get(base + "/latin1") as response:
            return await response.text()
    assert _three(tmp_path / "run7.jsonl", lambda: _aiohttp(text)) == ("café",) * 3

    async def not_json(s: aiohttp.ClientSession) -> str:
        async with s.get(base + "/notjson") as response:
            try:
                await response.json()
            except aiohttp.ContentTypeError:
                return "refused"
            return "read"
    assert _three(tmp_path / "run8.jsonl", lambda: _aiohttp(not_json)) == ("refused",) * 3


def test_the_cassette_keeps_a_gzip_file_as_the_wire_had_it(tmp_path: Path, base: str) -> None:
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        requests.get(base + "/file.gz", timeout=30)
    (line,) = [json.loads(x) for x in path.read_text().splitlines()
               if json.loads(x).get("kind") == "http"]
    import base64
    assert gzip.decompress(base64.b64decode(line["response"]["body"])) == INNER


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
@pytest.mark.parametrize("client", ["requests", "aiohttp", "httpx2"])
def test_a_multipart_upload_replays_though_its_boundary_is_new_each_time(
        tmp_path: Path, base: str, client: str, binary: bool) -> None:
    url, data = base + "/upload", FILE if binary else b"plain text file"

    async def aio(s: aiohttp.ClientSession) -> Any:
        form = aiohttp.FormData()
        form.add_field("f", data, filename="a.bin")
        async with s.post(url, data=form) as response:
            return await response.json()
    call: Callable[[], Any] = {
        "requests": lambda: requests.post(url, files={"f": ("a.bin", data)}, timeout=30).json(),
        "aiohttp": lambda: _aiohttp(aio),
        "httpx2": lambda: httpx2.post(url, files={"f": ("a.bin", data)}).json()}[client]
    live, recorded, replayed = _three(tmp_path / "run.jsonl", call)
    assert live == recorded == replayed and live["has"] is binary
    line = next(json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()
                if json.loads(x).get("kind") == "http")
    if client != "aiohttp":  # aiohttp's form is kept as its fields (below)
        assert line["request"]["body"]["body_encoding"] == ("base64" if binary else "text")


def test_an_aiohttp_form_is_recorded_and_replays(tmp_path: Path, base: str) -> None:
    async def post(s: aiohttp.ClientSession, data: Any) -> Any:
        async with s.post(base + "/upload", data=data) as response:
            return await response.json()

    def form() -> aiohttp.FormData:
        made = aiohttp.FormData()
        made.add_field("note", "hello")
        made.add_field("f", FILE, filename="a.bin", content_type="application/x-thing")
        return made
    for n, data in enumerate((lambda: {"a": "b", "c": "d"}, lambda: [("a", "1"), ("a", "2")],
                              form)):
        live, recorded, replayed = _three(
            tmp_path / f"form{n}.jsonl",
            lambda make=data: _aiohttp(lambda s: post(s, make())))  # type: ignore[misc]
        assert live["size"] == recorded["size"] == replayed["size"] > 0, n


def test_urllib_sends_a_generator_body_the_server_can_read_while_recording(
        tmp_path: Path, base: str) -> None:
    def call() -> bytes:
        request = urllib.request.Request(base + "/echo", data=iter([b"part1-", b"part2"]),
                                         method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.read()
    assert _three(tmp_path / "run.jsonl", call) == (b"part1-part2",) * 3


def test_aiohttp_hands_on_an_x_gzip_body_and_its_secret_is_redacted(tmp_path: Path,
                                                                   base: str) -> None:
    live, recorded, replayed = _three(tmp_path / "run.jsonl",
                                      lambda: _aiohttp(lambda s: _read(s, base + "/xgz")))
    assert live == recorded and gzip.decompress(live).startswith(b'{"token": "sk-ant')
    assert SECRET not in (tmp_path / "run.jsonl").read_bytes()
    assert gzip.decompress(replayed) != gzip.decompress(live)  # redacted, one layer only
    assert b"redacted" in gzip.decompress(replayed).lower()


def test_aiohttp_json_and_file_bodies_are_recorded_as_sent(tmp_path: Path, base: str) -> None:
    path = tmp_path / "file.bin"
    path.write_bytes(FILE)

    async def post(s: aiohttp.ClientSession, **body: Any) -> Any:
        async with s.post(base + "/upload", **body) as response:
            return await response.json()

    def as_json() -> Any:
        return _aiohttp(lambda s: post(s, json={"n": 1, "items": ["a", "b"]}))

    def a_file() -> Any:
        with path.open("rb") as f:
            return _aiohttp(lambda s: post(s, data=f))

    for name, call, size in (("json", as_json, len(b'{"n": 1, "items": ["a", "b"]}')),
                             ("file", a_file, len(FILE))):
        live, recorded, replayed = _three(tmp_path / f"{name}.jsonl", call)
        assert live == recorded == replayed and live["size"] == size, (name, live, recorded)
    line = next(json.loads(x) for x in (tmp_path / "json.jsonl").read_text().splitlines()
                if json.loads(x).get("kind") == "http")
    assert line["request"]["body"] == {"n": 1, "items": ["a", "b"]}  # stored as JSON

    def as_text_json() -> Any:  # "1" is not 1: another request
        return _aiohttp(lambda s: post(s, json={"n": "1", "items": ["a", "b"]}))
    with pytest.raises(Exception, match="diverged"), replayer.replay(tmp_path / "json.jsonl"):
        as_text_json()


def test_an_aiohttp_redirect_to_an_error_it_raises_for_is_logged_once(tmp_path: Path,
                                                                      base: str) -> None:
    async def go(s: aiohttp.ClientSession) -> str:
        try:
            async with s.get(base + "/go", raise_for_status=True):
                return "ok"
        except aiohttp.ClientResponseError as exc:
            return f"{exc.status}"
    path = tmp_path / "run.jsonl"
    live, recorded, replayed = _three(path, lambda: _aiohttp(go))
    assert live == recorded == replayed == "500"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    statuses = [line["response"]["status"] for line in lines if line.get("kind") == "http"]
    assert statuses == [302, 500], lines  # no third, failed line for the first request


@pytest.mark.parametrize(("method", "status", "followed"), [
    ("POST", 307, "POST"), ("POST", 308, "POST"), ("PUT", 302, "PUT"), ("POST", 302, "GET"),
    ("POST", 303, "GET"), ("PUT", 301, "PUT")])
def test_an_aiohttp_redirect_is_followed_with_the_method_aiohttp_uses(
        tmp_path: Path, base: str, method: str, status: int, followed: str) -> None:
    async def go(s: aiohttp.ClientSession) -> Any:
        async with s.request(method, f"{base}/moved/{status}", data=b"payload") as response:
            return [h.status for h in response.history], await response.json()
    live, recorded, replayed = _three(tmp_path / "run.jsonl", lambda: _aiohttp(go))
    assert live == recorded == replayed, (live, recorded, replayed)
    assert live[0] == [status] and live[1]["method"] == followed
