"""The secret scan: one agent puts a distinct secret in every place deja writes something,
and none of them reaches a file, in any form, with the default settings.

The agent (``tests/secret_agent.py``) is recorded through the real ``deja record`` in a
subprocess and through ``recorder.record``, against the stub model and a plain HTTP
service that also streams OpenAI Chat Completions and Responses with secrets cut into
3-character pieces. Then every file deja wrote is searched for each of the 51 secrets
(``secret_agent.placements``) in clear, in base64 at each alignment (standard and urlsafe)
and URL-encoded: the cassettes, the DuckDB index and its WAL after ``deja ls``, every
status record and a copy of one taken while a tool call was in flight, everything under
``$DEJA_HOME``, and what ``deja export`` sends to a real OTLP/HTTP endpoint and writes as
OTLP/JSON, with and without ``--content``. Both runs then replay identical, offline.
The runs database's placements are scanned by ``tests/runs/test_runs_secrets.py``.
Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import secret_agent
from click.testing import CliRunner
from conftest import http_server
from secret_agent import OtlpReceiver, leaks, placements

import recorder
import replayer
from deja.cli import main
from recorder.capture.redact import REDACTED
from recorder.cassette import load
from recorder.harness.progress import runs_dir
from recorder.testing.server import StubServer
from viewer.index import index_path

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "tests" / "secret_agent.py"


def deja(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=180)


def _sse(events: list[tuple[str | None, dict[str, Any]]], done: bool) -> bytes:
    text = "".join((f"event: {name}\n" if name else "")
                   + f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
                   for name, data in events)
    return (text + ("data: [DONE]\n\n" if done else "")).encode()


def _pieces(text: str) -> list[str]:
    return [text[i:i + 3] for i in range(0, len(text), 3)]


def chat_stream(s: dict[str, str]) -> bytes:
    """A Chat Completions stream: the reply's text and a tool call's arguments in
    3-character pieces."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
            "model": secret_agent.OPENAI_MODEL}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> tuple[None, dict[str, Any]]:
        return None, {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": finish}]}

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": p}) for p in _pieces(
        f"Your deploy key is {s['openai_chat_stream']}, keep it safe.")]
    events.append(chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                         "function": {"name": "deploy", "arguments": ""}}]}))
    events += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]})
               for p in _pieces(json.dumps({"user": "ada",
                                            "password": s["openai_chat_args"]}))]
    events.append(chunk({}, "tool_calls"))
    return _sse(events, done=True)


def responses_stream(s: dict[str, str]) -> bytes:
    """A Responses stream: a message's text and a function call's arguments in
    3-character pieces, then each done event with the whole value, as the API sends."""
    text = f"The service token is {s['openai_responses_stream']} for today."
    args = json.dumps({"region": "eu", "api_key": s["openai_responses_args"]})
    message = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}
    call = {"id": "fc_1", "type": "function_call", "name": "deploy", "call_id": "call_2",
            "arguments": args, "status": "completed"}
    response = {"id": "resp_1", "object": "response", "created_at": 1700000000,
                "status": "in_progress", "model": secret_agent.OPENAI_MODEL, "output": []}
    events: list[tuple[str | None, dict[str, Any]]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **fields}))

    emit("response.created", response=response)
    emit("response.output_item.added", output_index=0,
         item={**message, "status": "in_progress", "content": []})
    emit("response.content_part.added", item_id="msg_1", output_index=0, content_index=0,
         part={"type": "output_text", "text": "", "annotations": []})
    for piece in _pieces(text):
        emit("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0,
             delta=piece, logprobs=[])
    emit("response.output_text.done", item_id="msg_1", output_index=0, content_index=0,
         text=text, logprobs=[])
    emit("response.output_item.done", output_index=0, item=message)
    emit("response.output_item.added", output_index=1,
         item={**call, "arguments": "", "status": "in_progress"})
    for piece in _pieces(args):
        emit("response.function_call_arguments.delta", item_id="fc_1", output_index=1,
             delta=piece)
    emit("response.function_call_arguments.done", item_id="fc_1", output_index=1,
         arguments=args)
    emit("response.output_item.done", output_index=1, item=call)
    emit("response.completed", response={**response, "status": "completed",
                                         "output": [message, call]})
    return _sse(events, done=False)


class _Service(BaseHTTPRequestHandler):
    """A plain HTTP service whose answers carry secrets (body, header, cookie, fields
    named like secrets), and an OpenAI-compatible endpoint that streams them in pieces."""

    protocol_version = "HTTP/1.1"
    secrets: dict[str, str] = {}

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, body: bytes, content_type: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        s = type(self).secrets
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("x-debug-auth", f"Bearer {s['http_response_header']}")
        self.send_header("set-cookie", f"sid={s['cookie']}; Path=/")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        s = type(self).secrets
        if self.path.startswith("/search"):
            self._send(json.dumps({"echo_token": s["http_response_body"], "ok": True}).encode())
        elif self.path.startswith("/sts"):
            self._send(json.dumps({"Credentials": {
                "AccessKeyId": "ASIAEXAMPLE", "SecretAccessKey": s["json_secret_access_key"],
                "Expiration": "2030-01-01T00:00:00Z"}}).encode(),
                headers={"x-webhook": s["shape_whsec"]})
        else:
            self._send(b"hello")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        s = type(self).secrets
        if self.path.endswith("/v1/chat/completions"):
            self._send(chat_stream(s), "text/event-stream")
        elif self.path.endswith("/v1/responses"):
            self._send(responses_stream(s), "text/event-stream")
        else:
            self._send(json.dumps({"access": "granted",
                                   "refreshToken": s["json_refresh_token"]}).encode())


def _script(s: dict[str, str]) -> dict[str, Any]:
    return {"turns": [
        {"text": "You said: {echo}"},
        {"text": "Looking it up.", "tool_use": {"name": "lookup",
                                                "input": {"token": s["stream_split"],
                                                          "query": "q"}}},
        {"text": "All done."}]}


@pytest.fixture
def service() -> Iterator[str]:
    with http_server(_Service) as base:
        yield base


def export_all(cassettes: list[Path], out: Path) -> list[Path]:
    """``deja export`` of each cassette to a real OTLP/HTTP endpoint and as OTLP/JSON,
    without and with ``--content``: the files it sent or wrote."""
    written = []
    with OtlpReceiver(out / "otlp") as receiver:
        for path in cassettes:
            for content in ([], ["--content"]):
                sent = CliRunner().invoke(main, ["export", str(path), "--otlp", receiver.url,
                                                 *content])
                assert sent.exit_code == 0, sent.output
                target = out / f"{path.stem}{'-content' if content else ''}.otlp.json"
                wrote = CliRunner().invoke(main, ["export", str(path), "--format", "otlp-json",
                                                  "-o", str(target), *content])
                assert wrote.exit_code == 0, wrote.output
                written.append(target)
        deadline = time.monotonic() + 10
        while len(receiver.files) < 2 * len(cassettes) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(receiver.files) == 2 * len(cassettes)
        return written + receiver.files


def test_no_secret_reaches_any_file_deja_writes(tmp_path: Path, deja_home: Path,
                                                service: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    s = placements()
    _Service.secrets = s
    cassettes = tmp_path / "cassettes"
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    work = tmp_path / s["cwd"]  # a working directory whose name is a token
    work.mkdir()
    (work / "pyproject.toml").write_text(
        '[tool.deja.redact]\npatterns = ["corp-[0-9a-f]{16}"]\n')
    cfg = tmp_path / "agent-config.json"
    env = {"SECRET_AGENT_CONFIG": str(cfg), "ANTHROPIC_API_KEY": s["env_api_key"]}
    flags = ["--redact-header", "x-tenant", "--redact-body", "/metadata/user_id",
             "--redact-pattern", r"tenant-([A-Za-z0-9]{12,})", "--redact-query", "session_ref",
             "--label", f"ci_token={s['label']}"]

    with StubServer(_script(s)) as model:
        cfg.write_text(json.dumps({"secrets": s, "model_url": model.url, "http_url": service,
                                   "snapshot_dir": str(snapshots)}))
        # 1. through the real CLI, the agent unmodified, in a subprocess
        proc = deja("record", "-o", str(cassettes / "cli.jsonl"), *flags, "--", "python",
                    str(AGENT), "--api-key", s["argv_option"], s["argv_shape"],
                    "-p", s["argv_p"], "--password", s["argv_password"],
                    f"--password={s['argv_password_eq']}", env=env, cwd=work)
        assert proc.returncode == 0, proc.stderr
        # The secrets did go out: the stub saw the key, the echo and the metadata.
        seen = model.requests[0]
        assert s["env_api_key"] in json.dumps(seen["headers"])
        assert s["body_path"] in json.dumps(seen["body"])
        # 2. through the Python API, the same agent in this process
        model.load(_script(s))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.chdir(work)
        with recorder.record(cassettes / "api.jsonl", redact_headers=("x-tenant",),
                             redact_body=("/metadata/user_id",),
                             redact_patterns=(r"tenant-([A-Za-z0-9]{12,})",),
                             redact_query=("session_ref",),
                             labels={"ci_token": s["label"]}):
            answers = json.loads(secret_agent.run())
        # The agent itself got everything live.
        assert s["echo"] in answers["echo"]
        assert s["tool_result_shape"] in answers["result"]["note"]
        streamed = answers["streamed"]
        assert s["openai_chat_stream"] in streamed["chat"]
        assert s["openai_chat_args"] in streamed["chat_args"]
        assert s["openai_responses_stream"] in streamed["responses"]
        assert s["openai_responses_args"] in streamed["responses_args"]
        assert answers["sts"]["Credentials"]["SecretAccessKey"] == s["json_secret_access_key"]
        assert answers["linked"]["token"] == s["json_token"]
        assert s["exc_password"] in answers["refused"]

    proc = deja("ls", str(cassettes))  # builds the DuckDB index from the cassettes
    assert proc.returncode == 0, proc.stderr
    recorded = [cassettes / "cli.jsonl", cassettes / "api.jsonl"]
    exported = export_all(recorded, tmp_path / "exported")
    files = [p for p in cassettes.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"cli.jsonl", "api.jsonl"}
    files.append(index_path(cassettes))  # the index, under $DEJA_HOME/index
    home = [p for p in deja_home.rglob("*") if p.is_file()]
    records = sorted(runs_dir().glob("*"))
    in_flight = sorted(snapshots.glob("*.json"))
    assert len(records) >= 2 and len(in_flight) == 2
    for snapshot in in_flight:  # taken while slow() ran: the step names the call
        assert json.loads(snapshot.read_text())["step"].startswith("tool slow(")
    found = leaks(s, list(dict.fromkeys(files + home + records + in_flight + exported)))
    assert not found, "\n".join(found)

    # What was recorded is all there, only redacted.
    for path in recorded:
        cassette = load(path)
        kinds = [o["kind"] for o in cassette.observations]
        assert kinds.count("model") == 5 and kinds.count("tool") == 5 and "effect" in kinds
        assert kinds.count("http") == 5
        assert cassette.header["redact"]["patterns"][-1] == r"tenant-([A-Za-z0-9]{12,})"
        assert path.read_text().count(REDACTED) >= 30
    header = load(cassettes / "cli.jsonl").header
    assert header["argv"][-8:] == ["--api-key", REDACTED, "sk-[redacted]", "-p", REDACTED,
                                   "--password", REDACTED, f"--password={REDACTED}"]
    assert header["redact"]["patterns"] == ["corp-[0-9a-f]{16}", r"tenant-([A-Za-z0-9]{12,})"]
    assert "ghs_[redacted]" in header["cwd"]

    # Both runs replay identical, offline (the model and the service are gone).
    # The recorded directory is redacted, so it does not exist: deja says so and runs
    # nothing until it is given.
    proc = deja("replay", str(cassettes / "cli.jsonl"), env=env, cwd=work)
    assert proc.returncode == 2 and "does not exist on this machine" in proc.stderr
    proc = deja("replay", str(cassettes / "cli.jsonl"), "--cwd", str(work), env=env, cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical" in proc.stdout
    ctx = replayer.replay(cassettes / "api.jsonl")
    with ctx:
        replayed = json.loads(secret_agent.run())
    assert ctx.result is not None and ctx.result.identical
    assert replayed["echo"].startswith("You said: my access key is [redacted]")
    assert replayed["result"]["ini"] == "aws_secret_access_key = [redacted]"
    assert replayed["streamed"]["chat"] == "Your deploy key is sk-[redacted], keep it safe."
    assert json.loads(replayed["streamed"]["responses_args"])["api_key"] == REDACTED
