"""No secret reaches the cassette: API keys, cookies and their encoded forms."""

from __future__ import annotations

import base64
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests
from conftest import API_KEY, MODEL
from record_replay_helpers import USER, sync_client

import recorder

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
    assert set_cookie == ["sid=[redacted]; Path=/"]  # the cookie kept, its value out
    assert cassette.header["redact"]["headers"] == ["x-custom-token"]
