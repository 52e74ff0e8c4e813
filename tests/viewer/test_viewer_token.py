"""The viewer's token: another user of this machine cannot drive ``deja view``.

``deja view`` is served for real on 127.0.0.1 and asked over plain HTTP and the
websocket handshake, as any local process could: without the cookie the page, Streamlit's
assets and routes and the websocket are refused 401 (only the health check answers);
the address ``deja view`` printed (this install's token, from ``$DEJA_HOME/serve.token``,
a file only its owner can read) sets an ``HttpOnly``, ``SameSite=Strict`` cookie holding
no token and redirects to the same page without it; with that cookie the page and the
websocket are served. ``--token`` names another token. Then headless Chromium: refused
without the address, let in with it. The guard's own rules, in process, last.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import re
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect
from test_viewer_browser import chromium_missing, chromium_page, free_port, printed_address

from deja.runs.auth import read_token, token_path
from viewer.guard import COOKIE, HostGuard, cookie_value, cookies, token_in, without_token

REFUSED = b"open the address deja view printed"


@contextmanager
def viewer(folder: Path, log: Path, *args: str) -> Iterator[tuple[int, str]]:
    """``deja view FOLDER ARGS`` on a free port: its port and the address it printed."""
    port = free_port()
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "deja", "view", str(folder),
                                    "--port", str(port), *args], stdout=sink,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 40
            while get(port, "/_stcore/health")[0] != 200:
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            yield port, printed_address(log.read_text())
        finally:
            process.terminate()  # deja view stops the Streamlit server with it
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def get(port: int, path: str, **headers: str) -> tuple[int, bytes, dict[str, str]]:
    """Status, body and headers (lowercase names) of ``GET path``; 0 when nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read(), {k.lower(): v for k, v in
                                                   response.getheaders()}
    except OSError:
        return 0, b"", {}
    finally:
        conn.close()


def handshake(port: int, cookie: str | None = None) -> bytes:
    """What the viewer answers a websocket handshake from its own page with ``cookie``."""
    request = (f"GET /_stcore/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"Origin: http://127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
               "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
               "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: streamlit\r\n"
               + (f"Cookie: {cookie}\r\n" if cookie else "") + "\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            piece = sock.recv(4096)
            if not piece:
                break
            answer += piece
        return answer


def test_the_viewer_wants_the_printed_token(tmp_path: Path) -> None:
    folder = tmp_path / "cassettes"
    folder.mkdir()
    with viewer(folder, tmp_path / "view.log") as (port, address):
        # The address carries this install's token, in a file only its owner can read.
        token = read_token()
        assert token is not None and address == f"http://127.0.0.1:{port}/?token={token}"
        assert stat.S_IMODE(token_path().stat().st_mode) == 0o600
        assert stat.S_IMODE(token_path().parent.stat().st_mode) & 0o077 == 0
        # Without the cookie: the page, the assets and routes, the websocket: 401.
        status, body, headers = get(port, "/")
        assert status == 401 and REFUSED in body, (status, body)
        assert headers["content-type"].startswith("text/plain")
        for path in ("/?run=r_1", "/_stcore/host-config", "/favicon.png", "/media/x.png",
                     "/static/js/index.js", "/?token=" + "x" * 43, "/?token="):
            assert get(port, path)[0] == 401, path
        assert get(port, "/_stcore/health")[:2] == (200, b"ok")
        refused = handshake(port)
        assert refused.startswith(b"HTTP/1.1 401 "), refused
        assert handshake(port, f"{COOKIE}={token}").startswith(b"HTTP/1.1 401 ")  # no token
        # The printed address: the cookie (no token in it) and the same page without it.
        status, _, headers = get(port, f"/?token={token}&run=r_1&step=2")
        assert status == 303 and headers["location"] == "/?run=r_1&step=2", headers
        assert headers["referrer-policy"] == "no-referrer"
        name, value = headers["set-cookie"].split(";", 1)[0].split("=", 1)
        attributes = [a.strip() for a in headers["set-cookie"].split(";")[1:]]
        assert name == COOKIE and token not in value and value == cookie_value(token)
        assert sorted(attributes) == ["HttpOnly", "Path=/", "SameSite=Strict"]
        signed = f"{COOKIE}={value}"
        # With it: the page, its scripts, the websocket.
        status, page, _ = get(port, "/", Cookie=f"other=1; {signed}")
        assert status == 200 and b"<script" in page
        script = re.search(rb'src="\.?(/?static/js/[^"]+)"', page)
        assert script is not None, page[:500]
        asset = "/" + script.group(1).decode().lstrip("/")
        assert get(port, asset, Cookie=signed)[0] == 200
        assert get(port, asset)[0] == 401
        assert handshake(port, signed).startswith(b"HTTP/1.1 101 ")


def test_another_token_given_with_token(tmp_path: Path) -> None:
    folder = tmp_path / "cassettes"
    folder.mkdir()
    other = "another-token-0123456789abcdef"
    with viewer(folder, tmp_path / "view.log", "--token", other) as (port, address):
        assert address.endswith(f"/?token={other}")
        assert read_token() is None  # none made: the given one is the token
        assert get(port, f"/?token={other}")[0] == 303
        assert handshake(port, f"{COOKIE}={cookie_value(other)}").startswith(b"HTTP/1.1 101 ")


def test_chromium_is_let_in_by_the_printed_address_only(tmp_path: Path) -> None:
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)
    folder = tmp_path / "cassettes"
    folder.mkdir()
    with viewer(folder, tmp_path / "view.log") as (port, address), \
            chromium_page() as page:
        base = f"http://127.0.0.1:{port}"
        response = page.goto(base + "/?page=submitted")
        assert response is not None and response.status == 401
        expect(page.get_by_text("open the address deja view printed")).to_be_visible()
        expect(page.get_by_test_id("stApp")).to_have_count(0)
        page.goto(address)
        assert page.url == base + "/"  # the token is gone from the address bar
        expect(page.get_by_role("heading", name="Runs", exact=True)).to_be_visible()
        assert [c["httpOnly"] for c in page.context.cookies(base) if c["name"] == COOKIE] \
            == [True]
        assert COOKIE not in page.evaluate("document.cookie")  # not for the page's scripts


# ---------------------------------------------------------------------- the guard's rules


def call(guard: HostGuard, kind: str, path: str, query: str = "",
         headers: dict[str, str] | None = None, method: str = "GET") -> list[dict[str, Any]]:
    """What ``guard`` sends for one request; the app behind it answers ``app``."""
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        sent.append({"type": "app"})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        sent.append(dict(message))

    guard.app = app
    scope = {"type": kind, "path": path, "query_string": query.encode(), "method": method,
             "headers": [(k.encode(), v.encode()) for k, v in
                         {"host": "127.0.0.1:8501", **(headers or {})}.items()],
             "extensions": {"websocket.http.response": {}} if kind == "websocket" else {}}
    asyncio.run(guard(scope, receive, send))
    return sent


def test_the_guards_token_rules() -> None:
    token = "t0ken-of-this-install-0123456789"
    guard = HostGuard(lambda *_: None, token=token)  # type: ignore[arg-type, return-value]
    signed = {"cookie": f"{COOKIE}={cookie_value(token)}"}
    assert call(guard, "http", "/", headers=signed) == [{"type": "app"}]
    assert call(guard, "websocket", "/_stcore/stream", headers=signed) == [{"type": "app"}]
    assert call(guard, "http", "/")[0]["status"] == 401
    assert call(guard, "websocket", "/_stcore/stream")[0] == {
        "type": "websocket.http.response.start", "status": 401,
        "headers": call(guard, "http", "/")[0]["headers"]}
    assert call(guard, "websocket", "/_stcore/health")[0]["status"] == 401
    assert call(guard, "http", "/_stcore/health") == [{"type": "app"}]
    assert call(guard, "http", "/", f"token={token}", method="POST")[0]["status"] == 401
    assert call(guard, "websocket", "/_stcore/stream", f"token={token}")[0]["status"] == 401
    assert call(guard, "http", "/", f"token={token}x")[0]["status"] == 401
    assert call(guard, "http", "/", "token=wrong", headers=signed)[0]["status"] == 401
    assert call(guard, "http", "/", f"token={token}", headers=signed)[0]["status"] == 303
    assert call(guard, "http", "/", "token=" + token[:-1])[0]["status"] == 401
    assert call(guard, "http", "/", headers={"cookie": f"{COOKIE}={token}"})[0]["status"] == 401
    assert call(guard, "http", "/", headers={"host": "rebind.example:8501", **signed}
                )[0]["status"] == 421  # the Host first, the cookie does not excuse it
    answer = call(guard, "http", "/a b", f"x=1&token={token}&y=%26")[0]
    assert answer["status"] == 303 and dict(answer["headers"])[b"location"] == b"/a%20b?x=1&y=%26"
    assert call(guard, "http", "/", f"token={token}", method="HEAD")[0]["status"] == 303
    open_guard = HostGuard(lambda *_: None)  # type: ignore[arg-type, return-value]
    assert call(open_guard, "http", "/") == [{"type": "app"}]  # no token: the old checks only
    assert cookies('a=1; deja_view="v"; deja_view=w') == {"a": "1", "deja_view": "v"}
    assert token_in("a=1&token=x%2By") == "x+y" and token_in("a=1") is None
    assert without_token("/", "token=abc") == "/"
    assert cookie_value(token) != cookie_value(token + "x") and len(cookie_value(token)) == 64
    assert os.environ.get("DEJA_VIEW_TOKEN") is None
