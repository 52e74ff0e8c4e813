"""A model response nested deeper than Python parses, through ``deja record`` and replay.

A server on 127.0.0.1 answers ``POST /v1/messages`` with a JSON message whose body also
holds 100,000 nested arrays. Without deja the anthropic SDK raises its own parsing error
(``json`` gives up with ``RecursionError``). Under ``deja record`` the agent gets exactly
that error, not an ``APIConnectionError``, and the exchange is recorded as received: the
cassette verifies and holds the body byte for byte (usage and stop reason, which nothing
could read, are left empty). ``deja replay`` serves it back (identical, the agent fails the
same way), and ``deja show`` and ``deja ls`` list the run without a traceback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from recorder.cassette import load

KEY = "test-key-0123456789abcdef"  # conftest's DEJA_KEY, given explicitly to subprocesses
DEPTH = 100_000
BODY = (b'{"id":"msg_deep","type":"message","role":"assistant","model":"claude-sonnet-4-6",'
        b'"content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn",'
        b'"usage":{"input_tokens":3,"output_tokens":1},"deep":'
        + b"[" * DEPTH + b"]" * DEPTH + b"}")

AGENT = '''\
import anthropic

client = anthropic.Anthropic(api_key="sk-test", max_retries=0)
try:
    reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=16,
                                   messages=[{"role": "user", "content": "hi"}])
    print("answer", reply.content[0].text)
except Exception as exc:  # what the SDK raised, by its type
    print("raised", type(exc).__module__, type(exc).__name__)
'''


class _Deep(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self) -> None:  # the name http.server calls
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Deep)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_a_deeply_nested_response_is_recorded_as_received(tmp_path: Path, server: str,
                                                          deja_home: Path) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    env = {**os.environ, "ANTHROPIC_BASE_URL": server, "DEJA_HOME": str(deja_home),
           "DEJA_KEY": KEY}
    bare = run([sys.executable, "agent.py"], env, tmp_path)
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout.startswith("raised "), bare.stdout  # the SDK's own error
    assert "APIConnectionError" not in bare.stdout

    deja = [sys.executable, "-m", "deja"]
    recorded = run([*deja, "record", "-o", "run.jsonl", "--", "python", "agent.py"], env,
                   tmp_path)
    assert recorded.returncode == 0, recorded.stderr
    assert recorded.stdout == bare.stdout  # what the agent gets without deja

    cassette = load(tmp_path / "run.jsonl", allow_incomplete=False)
    assert cassette.verified and cassette.end is not None
    [step] = cassette.observations
    assert step["kind"] == "model" and step["response"]["status"] == 200
    assert step["response"]["body"].encode() == BODY  # as received, byte for byte
    assert step["usage"] is None and step["stop_reason"] is None

    replayed = run([*deja, "replay", "run.jsonl", "--json"], env, tmp_path)
    assert replayed.returncode == 0, replayed.stderr
    result = json.loads(replayed.stdout)
    assert result["identical"] and result["steps_served"] == 1
    assert bare.stdout.strip() in replayed.stderr  # the program's output goes to stderr

    for command in (["show", "run.jsonl"], ["ls", "."]):
        shown = run([*deja, *command], env, tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert "Traceback" not in shown.stderr and cassette.run in shown.stdout
