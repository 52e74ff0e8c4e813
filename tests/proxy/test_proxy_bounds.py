"""The recording proxy's bounds: what an upstream sends back (a gzip bomb, an endless
stream), slow clients (slowloris, on ``deja proxy`` and ``deja serve``), hop-by-hop headers
a ``Connection`` header names, and who may call it (``Host``, ``Origin``).

Every proxy is a real ``deja proxy`` process; the upstream is a small HTTP/1.1 server on
127.0.0.1 written here on raw asyncio streams (it must send what no well-behaved server
sends); clients are raw sockets and ``http.client``, which leave a body compressed and a
stream unread as they came.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import brotli
import pytest
import zstandard
from proxy_helpers import ProxyProcess, cassettes

from recorder.cassette import load

Proxy = Callable[..., ProxyProcess]
MIB = 1024 * 1024
BOMB_MIB = 256  # what the gzip bomb inflates to
REPLY = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-6",
         "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn",
         "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}}
DELTA = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
         b'"delta":{"type":"text_delta","text":"' + b"la " * 100 + b'"}}\n\n')
STREAM_HEAD = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_2",'
               b'"type":"message","role":"assistant","model":"claude-sonnet-4-6","content":[],'
               b'"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":3,'
               b'"output_tokens":0}}}\n\nevent: content_block_start\ndata: {"type":'
               b'"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n')


def gzip_bomb(mib: int) -> bytes:
    """A gzip body of ``mib`` MiB of zeros, built in well under a second: after a full
    flush, deflate's output for one more MiB of zeros is the same block every time, so the
    block is repeated rather than computed ``mib`` times (the trailer's CRC is the real
    one, so a decompressor accepts the whole body)."""
    zeros = bytes(MIB)
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    head = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    assert c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH) == block
    end = c.flush(zlib.Z_FINISH)[:-8]  # the last (empty) block, without the trailer
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    return head + block * (mib - 1) + end + struct.pack("<II", crc, (mib * MIB) & 0xFFFFFFFF)


class Upstream:
    """An HTTP/1.1 server on 127.0.0.1, one behaviour per ``x-case`` request header:
    ``bomb`` (a gzip bomb as a JSON reply), ``endless`` (an SSE stream that never ends),
    ``hop`` (the request's headers echoed, with hop-by-hop headers of its own), else a
    JSON message. ``seen`` keeps every request's headers."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.bomb = b""
        self.bomb_coding = "gzip"
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.base_events.Server | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> Upstream:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._client, "127.0.0.1", 0), self.loop).result(10)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        async def close() -> None:
            assert self.server is not None
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:  # closed however it ends, cancelled at the server's close included
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = head.decode("latin-1").split("\r\n")
                    headers = {k.strip().lower(): v.strip() for k, _, v in
                               (line.partition(":") for line in lines[1:] if line)}
                    await reader.readexactly(int(headers.get("content-length", "0")))
                    self.seen.append(headers)
                    await self._answer(headers, writer)
        finally:
            writer.close()

    async def _answer(self, headers: dict[str, str], writer: asyncio.StreamWriter) -> None:
        case = headers.get("x-case", "")
        if case == "bomb":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-encoding: %s\r\n"
                         b"content-length: %d\r\n\r\n" % (self.bomb_coding.encode(),
                                                             len(self.bomb)))
            for at in range(0, len(self.bomb), 64 * 1024):
                writer.write(self.bomb[at:at + 64 * 1024])
                await writer.drain()
            return
        if case == "endless":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            writer.write(b"%x\r\n%s\r\n" % (len(STREAM_HEAD), STREAM_HEAD))
            chunk = DELTA * 40
            while True:  # until the proxy hangs up
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
        body = json.dumps({**REPLY, "echo": headers} if case == "hop" else REPLY).encode()
        extra = b"connection: keep-alive, x-upstream-hop\r\nx-upstream-hop: s3cret\r\n" \
                b"x-upstream-kept: yes\r\n" if case == "hop" else b""
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%s"
                     b"content-length: %d\r\n\r\n%s" % (extra, len(body), body))
        await writer.drain()


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream().start()
    yield server
    server.stop()


@contextlib.contextmanager
def post(url: str, case: str = "", *, headers: dict[str, str] | None = None,
         timeout: float = 30.0) -> Iterator[http.client.HTTPResponse]:
    """POST a model request through the proxy at ``url``: its response, unread (a
    compressed body stays compressed), on a connection closed afterwards."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    body = json.dumps({"model": "claude-sonnet-4-6", "max_tokens": 50,
                       "messages": [{"role": "user", "content": f"case {case or 'plain'}"}]})
    try:
        conn.request("POST", "/v1/messages", body=body, headers={
            "content-type": "application/json", "x-api-key": "sk-test",
            "anthropic-version": "2023-06-01", "accept-encoding": "gzip",
            **({"x-case": case} if case else {}), **(headers or {})})
        yield conn.getresponse()
    finally:
        conn.close()


def call(url: str, case: str = "", *, headers: dict[str, str] | None = None,
         timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """:func:`post`, read whole: (status, headers, body)."""
    with post(url, case, headers=headers, timeout=timeout) as r:
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def rss_peak_kib(pid: int) -> int:
    """The peak resident set of process ``pid`` so far (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def wait_for(done: Callable[[], Any], timeout: float, say: Callable[[], str] = str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = done()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not done within {timeout}s\n{say()}")


# ------------------------------------------------------------------ what comes back


def test_a_gzip_bomb_is_refused_with_a_named_error_and_bounded_memory(
        proxy: Proxy, upstream: Upstream, tmp_path: Path) -> None:
    upstream.bomb = gzip_bomb(BOMB_MIB)
    assert len(upstream.bomb) < MIB  # a small body ...
    # ... that inflates to 8 times the limit; the second client below asks the same thing
    # over and over, as often as the machine lets it, which the loop guard and the turn
    # budget would stop
    p = proxy("--upstream", upstream.url, "--dir", str(tmp_path / "c"), "--max-response",
              str(32 * MIB), "--no-loop-guard", "--max-turns", "1000000")
    status, _, body = call(p.url)
    assert status == 200, body
    before = rss_peak_kib(p.pid)

    # a second client keeps calling while the bomb goes through
    done, gaps, failures = threading.Event(), [], []

    def other_client() -> None:
        last = time.monotonic()
        while not done.is_set():
            status, _, body = call(p.url, headers={"x-deja-run": "other"})
            if status != 200:
                failures.append((status, body))
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    other = threading.Thread(target=other_client)
    other.start()
    try:
        wait_for(lambda: len(gaps) >= 3, 30)
        t0 = time.monotonic()
        status, headers, body = call(p.url, "bomb", headers={"x-deja-run": "bomb"})
        took = time.monotonic() - t0
        served_meanwhile = len(gaps)
        wait_for(lambda: len(gaps) >= served_meanwhile + 3, 30)
    finally:
        done.set()
        other.join(30)
    assert status == 502, body[:300]
    error = json.loads(body)["error"]
    assert error["type"] == "api_error"
    assert "ResponseTooLarge" in error["message"] and str(32 * MIB) in error["message"]
    assert "--max-response" in error["message"]
    assert headers["x-should-retry"] == "false"
    assert took < 10, took
    grew = rss_peak_kib(p.pid) - before
    assert grew < 64 * 1024, f"the proxy's peak RSS grew by {grew} KiB"
    assert not failures and max(gaps) < 5, (failures, max(gaps))

    code, log = p.stop()
    assert code == 0 and "Traceback" not in log, log
    [bombed] = [c for c in cassettes(tmp_path / "c")
                if any(o.get("error") for o in load(c).observations)]
    [step] = [o for o in load(bombed).observations if o["kind"] == "model"]
    assert step["error"]["type"] == "ResponseTooLarge"
    assert step["error"]["has_response"] is False
    assert bombed.stat().st_size < 64 * 1024


@pytest.mark.parametrize("coding", ["br", "zstd"])
def test_a_br_or_zstd_bomb_is_refused_too(proxy: Proxy, upstream: Upstream, tmp_path: Path,
                                          coding: str) -> None:
    """br and zstd bodies are read as gzip ones are (their usage, their secrets), so they
    are bounded the same way: brotli's decoder gives its output a step at a time, zstd's
    is fed a few bytes at a time."""
    zeros = bytes(BOMB_MIB * MIB)
    upstream.bomb = brotli.compress(zeros, quality=1) if coding == "br" else \
        zstandard.ZstdCompressor(level=1).compress(zeros)
    del zeros
    upstream.bomb_coding = coding
    assert len(upstream.bomb) < MIB
    p = proxy("--upstream", upstream.url, "--dir", str(tmp_path / "c"), "--max-response",
              str(32 * MIB))
    assert call(p.url)[0] == 200
    before = rss_peak_kib(p.pid)
    status, _, body = call(p.url, "bomb", headers={"x-deja-run": "bomb"})
    assert status == 502, body[:300]
    message = json.loads(body)["error"]["message"]
    assert "ResponseTooLarge" in message and str(32 * MIB) in message, message
    assert f"once inflated ({coding})" in message, message
    grew = rss_peak_kib(p.pid) - before
    assert grew < 64 * 1024, f"the proxy's peak RSS grew by {grew} KiB"
    code, log = p.stop()
    assert code == 0 and "Traceback" not in log, log


def read_stream(response: http.client.HTTPResponse, most: int, seconds: float) -> bytes:
    """A streamed body, read to its end, but no more than ``most`` bytes or ``seconds``."""
    got = bytearray()
    deadline = time.monotonic() + seconds
    while len(got) <= most and time.monotonic() < deadline:
        part = response.read1(64 * 1024)
        if not part:
            return bytes(got)
        got += part
    raise AssertionError(f"the stream did not end: {len(got)} bytes in "
                         f"{seconds - (deadline - time.monotonic()):.1f}s")


def test_an_endless_stream_is_cut_at_the_limit_with_an_error_event(
        proxy: Proxy, upstream: Upstream, tmp_path: Path) -> None:
    limit = MIB
    p = proxy("--upstream", upstream.url, "--dir", str(tmp_path / "c"), "--max-response",
              str(limit))
    with post(p.url, "endless") as r:
        assert r.status == 200
        got = read_stream(r, 8 * limit, 30)
    head, _, tail = got.rpartition(b"event: error\n")
    passed = head[:-2]  # the error event comes after a blank line of its own
    assert limit - len(DELTA) < len(passed) <= limit  # up to the limit, in whole events
    assert passed.startswith(STREAM_HEAD) and passed.endswith(DELTA)
    event = json.loads(tail.removeprefix(b"data: ").strip())
    assert event["type"] == "error" and "ResponseTooLarge" in event["error"]["message"]
    assert f"cut after {len(passed)} bytes" in event["error"]["message"]
    # the SDK raises it as an API error, with deja's message
    client = anthropic.Anthropic(base_url=p.url, api_key="sk-test", max_retries=0,
                                 default_headers={"x-case": "endless"})
    with pytest.raises(anthropic.APIStatusError, match="ResponseTooLarge"), \
            client.messages.stream(model="claude-sonnet-4-6", max_tokens=10,
                                   messages=[{"role": "user", "content": "hi"}]) as stream:
        for _ in stream:
            pass
    client.close()

    code, log = p.stop()
    assert code == 0 and "Traceback" not in log, log
    [path] = [c for c in cassettes(tmp_path / "c") if "case endless" in c.read_text()]
    longest = max(len(line) for line in path.read_bytes().splitlines())
    assert longest < limit * 1.25, longest  # the body passed on, escaped as JSON
    [step] = [o for o in load(path).observations if o["kind"] == "model"]
    assert step["error"]["type"] == "ResponseTooLarge" and step["error"]["has_response"]

    # a replay ends the stream as the recording did: the same bytes, the same error event
    replay = proxy("--replay", str(path))
    with post(replay.url, "endless") as again:
        assert again.status == 200
        assert read_stream(again, 8 * limit, 30) == got


# ------------------------------------------------------------------ slow clients


def partial_requests(url: str, n: int) -> list[socket.socket]:
    """``n`` connections that each send the start of a request's headers, never the end."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for i in range(n):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nx-slow-%d: " % i)
        s.setblocking(False)
        socks.append(s)
    return socks


def closed(s: socket.socket) -> bool:
    """Has the server closed this connection?"""
    try:
        return s.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_slowloris_connections_are_dropped_after_the_header_timeout(
        proxy: Proxy, upstream: Upstream, tmp_path: Path) -> None:
    p = proxy("--upstream", upstream.url, "--dir", str(tmp_path / "c"),
              "--header-timeout", "2")
    socks = partial_requests(p.url, 200)
    try:
        t0 = time.monotonic()
        status, _, body = call(p.url, timeout=10)  # a real client is served meanwhile
        assert status == 200, body
        for s in socks[:100]:  # a client that trickles its headers gains nothing
            with contextlib.suppress(OSError):
                s.send(b"a")
        wait_for(lambda: all(closed(s) for s in socks), 30,
                 lambda: f"{sum(map(closed, socks))} of 200 closed")
        assert time.monotonic() - t0 > 1.0  # by the timeout, not at once
    finally:
        for s in socks:
            s.close()
    code, log = p.stop()
    assert code == 0 and "Traceback" not in log, log


def test_a_request_body_that_stalls_is_answered_408_after_the_body_timeout(
        proxy: Proxy, upstream: Upstream, tmp_path: Path) -> None:
    p = proxy("--upstream", upstream.url, "--dir", str(tmp_path / "c"), "--body-timeout", "1")
    host, port = p.url.removeprefix("http://").split(":")
    stalled = socket.create_connection((host, int(port)), timeout=30)
    try:  # whole headers, then a tenth of the body it announces, then nothing
        stalled.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                        + b"{" * 100)
        t0 = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            piece = stalled.recv(65536)
            if not piece:
                break
            answer += piece
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"the request body stalled: nothing came for 1 s" in answer, answer
        assert time.monotonic() - t0 > 0.5  # by the timeout, not at once
        status, _, body = call(p.url, timeout=10)  # a real client is served meanwhile
        assert status == 200, body
    finally:
        stalled.close()
    code, log = p.stop()
    assert code == 0 and "Traceback" not in log, log


def test_deja_serve_drops_the_oldest_idle_connections_past_its_cap(tmp_path: Path) -> None:
    from recorder.serving import MAX_WAITING

    ready = tmp_path / "serve.ready"
    log = (tmp_path / "serve.log").open("wb")
    env = {k: v for k, v in os.environ.items()
           if k not in ("DEJA_TOKEN", "DEJA_DATABASE_URL", "DEJA_SERVER")}
    server = subprocess.Popen([sys.executable, "-m", "deja", "serve", "--port", "0",
                               "--ready-file", str(ready)], cwd=tmp_path, stdout=log,
                              stderr=subprocess.STDOUT, env=env)
    socks: list[socket.socket] = []
    try:
        wait_for(lambda: ready.is_file() or server.poll() is not None, 60,
                 lambda: (tmp_path / "serve.log").read_text())
        url = json.loads(ready.read_text())["url"]
        socks = partial_requests(url, MAX_WAITING + 60)
        wait_for(lambda: all(closed(s) for s in socks[:60]), 20,
                 lambda: f"{sum(map(closed, socks[:60]))} of the 60 oldest closed")
        assert not any(closed(s) for s in socks[-100:])  # the newest wait their turn
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", "/healthz")
            assert conn.getresponse().status == 200
        finally:
            conn.close()
    finally:
        for s in socks:
            s.close()
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        log.close()


# ------------------------------------------------------------------ headers and callers


def test_headers_a_connection_header_names_do_not_pass(
        proxy: Proxy, upstream: Upstream, tmp_path: Path) -> None:
    p = proxy("--upstream", upstream.url, "--dir", str(tmp_path / "c"))
    status, headers, body = call(p.url, "hop", headers={
        "connection": "keep-alive, x-secret-hop", "x-secret-hop": "s3cret", "x-kept": "yes"})
    reply = json.loads(body)
    assert status == 200
    assert reply["echo"]["x-kept"] == "yes"
    assert "x-secret-hop" not in reply["echo"], reply["echo"]
    assert headers["x-upstream-kept"] == "yes"
    assert "x-upstream-hop" not in headers, headers


def raw(url: str, headers: dict[str, str], path: str = "/v1/messages"
        ) -> tuple[int, dict[str, Any]]:
    """POST with exactly these headers (``Host`` too); (status, JSON body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    body = json.dumps({"model": "claude-sonnet-4-6", "max_tokens": 5,
                       "messages": [{"role": "user", "content": "hi"}]})
    try:
        conn.putrequest("POST", path, skip_host=True, skip_accept_encoding=True)
        for k, v in {"content-type": "application/json", "x-api-key": "sk-test",
                     "content-length": str(len(body)), **headers}.items():
            conn.putheader(k, v)
        conn.endheaders(body.encode())
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def test_a_foreign_host_or_a_web_pages_origin_is_refused(
        proxy: Proxy, upstream: Upstream, tmp_path: Path) -> None:
    p = proxy("--upstream", upstream.url, "--dir", str(tmp_path / "c"),
              "--allowed-host", "proxy.internal")
    port = p.url.rsplit(":", 1)[1]

    def refused(headers: dict[str, str], status: int) -> str:
        before = len(upstream.seen)
        got, body = raw(p.url, headers)
        assert got == status, (headers, body)
        assert len(upstream.seen) == before  # nothing went upstream
        return str(body["error"]["message"])

    # DNS rebinding: a page whose name points at 127.0.0.1 names itself in Host
    said = refused({"host": f"rebind.attacker.example:{port}"}, 421)
    assert "rebind.attacker.example" in said and "--allowed-host" in said
    refused({"host": "0.0.0.0"}, 421)
    # a cross-origin request from a web page (a form, a fetch without preflight)
    said = refused({"host": f"127.0.0.1:{port}", "origin": "https://evil.example"}, 403)
    assert "evil.example" in said
    refused({"host": f"127.0.0.1:{port}", "origin": "null"}, 403)
    refused({"host": f"localhost:{port}", "sec-fetch-site": "cross-site"}, 403)
    refused({"host": f"127.0.0.1:{port}", "origin": f"http://rebind.attacker.example:{port}"},
            403)
    # what programs on the machine send, a loopback page, and a name given to the proxy
    for headers in ({"host": f"127.0.0.1:{port}"}, {"host": f"LOCALHOST.:{port}"},
                    {"host": f"127.0.0.1:{port}", "origin": "http://localhost:5173"},
                    {"host": f"proxy.internal:{port}"}):
        status, body = raw(p.url, headers)
        assert status == 200, (headers, body)
    code, log = p.stop()
    assert code == 0 and "Traceback" not in log, log
