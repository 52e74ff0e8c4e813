"""What keeps the proxy's added time small: one kept-alive connection to the upstream for
every call, and new runs started side by side.

- Every call through the proxy goes upstream over the pooled client's kept-alive
  connection: an upstream that counts the TCP connections it accepts sees one for a whole
  conversation of calls, not one per call (a connection's setup would be paid on every
  call).
- The first requests of two conversations start their runs at the same time: a new
  cassette's header is forced to disk, and a run that waited for every other run's start
  would queue behind all of them (the tail of the concurrent rows). Requests that could
  join the same new run still take turns: the same request sent twice at once lands in one
  run.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator, MutableMapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import pytest
from proxy_helpers import cassettes

from deja.proxy.app import Proxy
from deja.proxy.runs import ProxyRun
from recorder.record import RecordSession
from recorder.testing.server import StubServer

MODEL = "claude-sonnet-4-6"
REPLY = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
         "content": [{"type": "text", "text": "done"}], "stop_reason": "end_turn",
         "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}}


class CountingUpstream(ThreadingHTTPServer):
    """An upstream that answers every POST with one Messages reply, over HTTP/1.1 kept-alive
    connections, and counts the connections it accepted and the requests it answered."""

    daemon_threads = True

    def __init__(self) -> None:
        self.connections = 0
        self.requests = 0
        self.counted = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Answer)

    def get_request(self) -> tuple[Any, Any]:
        accepted = super().get_request()
        with self.counted:
            self.connections += 1
        return accepted

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        body = json.dumps(REPLY).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        server = self.server
        assert isinstance(server, CountingUpstream)
        with server.counted:
            server.requests += 1

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[CountingUpstream]:
    server = CountingUpstream()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_every_call_goes_upstream_over_one_kept_alive_connection(
        proxy: Callable[..., Any], upstream: CountingUpstream, tmp_path: Path) -> None:
    p = proxy("--upstream", upstream.url, "--dir", str(tmp_path / "c"))
    client = anthropic.Anthropic(base_url=p.url, api_key="sk-test", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "step 0"}]
    for k in range(1, 9):  # one conversation of eight calls, its history growing
        reply = client.messages.create(model=MODEL, max_tokens=50, messages=messages)
        messages += [{"role": "assistant", "content": reply.content[0].text},
                     {"role": "user", "content": f"step {k}"}]
    client.close()
    assert upstream.requests == 8
    assert upstream.connections == 1
    code, log = p.stop()
    assert code == 0, log
    assert len(cassettes(tmp_path / "c")) == 1  # and one run, recorded


# -- runs started side by side, in process: the ASGI app with a run maker that waits


async def _post(app: Proxy, text: str) -> tuple[int, str]:
    """POST a one-message conversation to the app as uvicorn would; (status, run id)."""
    body = json.dumps({"model": MODEL, "max_tokens": 50,
                       "messages": [{"role": "user", "content": text}]}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "query_string": b"",
             "headers": [(b"host", b"127.0.0.1:8787"), (b"content-type", b"application/json"),
                         (b"x-api-key", b"sk-test"), (b"anthropic-version", b"2023-06-01"),
                         (b"content-length", str(len(body)).encode())]}
    given = asyncio.Event()
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if not given.is_set():
            given.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays until it is answered
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    run = dict(start["headers"]).get(b"x-deja-run-id", b"").decode()
    return start["status"], run


def _app(upstream: str, directory: Path, together: threading.Barrier) -> Proxy:
    """The proxy in record mode whose new runs each wait (in their worker thread) until
    ``together`` has as many waiting as it counts: started one at a time, the first would
    wait for ever."""

    def new_run(name: str | None, labels: dict[str, str]) -> ProxyRun:
        together.wait()
        session = RecordSession(directory, argv=[], labels=labels)
        return ProxyRun(session.start(intercept=False), name=name)

    return Proxy(upstream=upstream, new_run=new_run)


def _at_once(app: Proxy, first: str, second: str) -> list[tuple[int, str]]:
    """Two requests sent to the app at the same time; (status, run id) of each."""

    async def main() -> list[tuple[int, str]]:
        await app.startup()
        try:
            return list(await asyncio.gather(_post(app, first), _post(app, second)))
        finally:
            await app.shutdown()

    return asyncio.run(main())


def test_two_conversations_start_their_runs_side_by_side(
        stub: Callable[[dict], StubServer], tmp_path: Path) -> None:
    server = stub({"model": MODEL, "default": {"text": "done"}})
    app = _app(server.url, tmp_path / "c", threading.Barrier(2, timeout=20))
    (status_a, run_a), (status_b, run_b) = _at_once(app, "first conversation",
                                                    "second conversation")
    assert (status_a, status_b) == (200, 200)
    assert run_a and run_b and run_a != run_b
    assert len(cassettes(tmp_path / "c")) == 2


def test_the_same_request_twice_at_once_still_starts_one_run(
        stub: Callable[[dict], StubServer], tmp_path: Path) -> None:
    server = stub({"model": MODEL, "default": {"text": "done"}})
    app = _app(server.url, tmp_path / "c", threading.Barrier(1))
    (status_a, run_a), (status_b, run_b) = _at_once(app, "the same question",
                                                    "the same question")
    assert (status_a, status_b) == (200, 200)
    assert run_a == run_b  # the second, sent while the first was in flight, is its retry
    assert len(cassettes(tmp_path / "c")) == 1
