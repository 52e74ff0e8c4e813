"""A scripted stub of the Anthropic Messages API and of OpenAI's, served over HTTP on 127.0.0.1.

The stub lets the real ``anthropic`` and ``openai`` SDKs be driven with no network and no API
key: tests, benchmarks and the demo point ``anthropic.Anthropic(base_url=server.url,
api_key="sk-test")`` (or ``openai.OpenAI(base_url=server.url + "/v1", ...)``) at it. It
speaks the wire protocol of ``POST /v1/messages``: JSON responses, SSE streaming
(``"stream": true``) with chunked transfer encoding, tool use, thinking blocks, and error
responses with the real error body and retry headers; and that of OpenAI's
``POST /v1/chat/completions`` and ``POST /v1/responses``, from the same scripts
(:mod:`recorder.testing.openai_reply`); and Gemini's ``POST .../models/{model}:generateContent``
and ``:streamGenerateContent`` (:mod:`recorder.testing.gemini_reply`; ``google-genai`` is
pointed at it with ``http_options=types.HttpOptions(base_url=server.url)``); and Claude on
Amazon Bedrock's ``POST /model/{modelId}/invoke`` and ``/invoke-with-response-stream``
(:mod:`recorder.testing.bedrock_reply`; ``anthropic.AnthropicBedrock(base_url=server.url, ...)``).
Standard library only.

It answers from a *script* (a dict, a JSON file, or JSON text) of turns::

    {"select": "conversation",
     "turns": [{"text": "Hello!"}, {"tool_use": {"name": "search", "input": {"q": "x"}}}],
     "rules": [{"when": {"tool_result_is_error": false}, "text": "Found it."}],
     "default": {"text": "ok"}}

The script format is documented in :mod:`recorder.testing.script`; which turn answers a request
is decided by :mod:`recorder.testing.match` from the request alone (its conversation, and the
SDK's attempt header for retries), and what a turn sends back is built by
:mod:`recorder.testing.reply`. ``deja stub --from CASSETTE`` (:mod:`replayer.stub`) writes a
script that answers what a recorded run received.

Control endpoints for other processes: ``GET /_stub/health``, ``GET /_stub/requests`` and
``POST /_stub/script`` (body: a script). ``POST /v1/messages/count_tokens`` answers with a rough
token count.

Typical use::

    with StubServer({"turns": [{"text": "hi"}]}) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="sk-test")
        client.messages.create(model="m", max_tokens=10, messages=[...])
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

from recorder.testing import bedrock_reply, gemini_reply, openai_reply
from recorder.testing._http import HttpServer, serve_in_thread
from recorder.testing.match import attempt, pick, position
from recorder.testing.reply import (
    Answer,
    chunk,
    dumps,
    error_body,
    input_tokens,
    random_id,
    reply_for,
    scripted_error,
    stream_events,
)
from recorder.testing.script import StubScriptError, load_script

__all__ = ["StubScriptError", "StubServer", "load_script"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# HTTP server
# --------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "deja-stub/1.0"
    sys_version = ""
    server: HttpServer

    # -- plumbing ------------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("stub %s - %s", self.address_string(), format % args)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            parts: list[bytes] = []
            while True:
                size_line = self.rfile.readline(65537)
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline(65537)
            return b"".join(parts)
        try:
            length = int(self.headers.get("content-length") or 0)
        except ValueError:
            self.close_connection = True  # the framing is unknown: answer, then hang up
            return b""
        return self.rfile.read(length) if length > 0 else b""

    def _start(self, status: int, content_type: str, request_id: str, **headers: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("request-id", request_id)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        if self.close_connection:
            self.send_header("connection", "close")
        self.end_headers()

    def _send_json(
        self, status: int, obj: Any, request_id: str | None = None, **headers: str
    ) -> None:
        payload = dumps(obj).encode()
        self._start(
            status,
            "application/json",
            request_id or random_id("req_"),
            content_length=str(len(payload)),
            **headers,
        )
        self.wfile.write(payload)

    def _send_error(self, status: int, error_type: str, message: str, **headers: str) -> None:
        request_id = random_id("req_")
        self._send_json(status, error_body(error_type, message, request_id), request_id, **headers)

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _route(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    # -- verbs ---------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._read_body()
        route = self._route()
        stub = self.server.stub
        if route == "/_stub/health":
            self._send_json(200, {"ok": True, "served": stub.served})
        elif route == "/_stub/requests":
            self._send_json(200, stub.received())
        else:
            self._not_found()

    def do_POST(self) -> None:
        raw = self._read_body()
        route = self._route()
        if route == "/v1/messages":
            self._messages(raw)
        elif route in (openai_reply.CHAT, openai_reply.RESPONSES):
            self._openai(route, raw)
        elif gemini_reply.endpoint(route):
            self._gemini(route, raw)
        elif bedrock_reply.endpoint(route):
            self._bedrock(route, raw)
        elif route == "/v1/messages/count_tokens":
            self._count_tokens(raw)
        elif route == "/_stub/script":
            self._load_script(raw)
        else:
            self._not_found()

    def _other(self) -> None:
        self._read_body()
        self._not_found()

    do_PUT = do_PATCH = do_DELETE = _other

    def _not_found(self) -> None:
        self._send_error(404, "not_found_error", f"Not found: {self.command} {self._route()}")

    # -- endpoints -----------------------------------------------------------------------

    def _parse_json(self, raw: bytes) -> tuple[dict | None, str | None]:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return None, f"There was an error parsing the body of your request: {exc}"
        except RecursionError:  # answered as the API answers it, not a dropped connection
            return None, "There was an error parsing the body of your request: nested too deeply"
        if not isinstance(body, dict):
            return None, "Request body must be a JSON object"
        return body, None

    def _load_script(self, raw: bytes) -> None:
        body, problem = self._parse_json(raw)
        if body is None:
            self._send_error(400, "invalid_request_error", problem or "invalid script")
            return
        try:
            self.server.stub.load(body)
        except StubScriptError as exc:
            self._send_error(400, "invalid_request_error", str(exc))
            return
        counts = {key: len(body.get(key) or []) for key in ("turns", "rules")}
        self._send_json(200, {"ok": True, **counts})

    def _count_tokens(self, raw: bytes) -> None:
        body, problem = self._parse_json(raw)
        if body is None:
            self._send_error(400, "invalid_request_error", problem or "invalid body")
            return
        for field in ("model", "messages"):
            if field not in body:
                self._send_error(400, "invalid_request_error", f"{field}: Field required")
                return
        self._send_json(200, {"input_tokens": input_tokens(body)})

    def _messages(self, raw: bytes) -> None:
        stub = self.server.stub
        body, problem = self._parse_json(raw)
        headers = {k.lower(): v for k, v in self.headers.items()}
        stub.receive(self.path, headers, body)
        if body is None:
            self._send_error(400, "invalid_request_error", problem or "invalid body")
            return
        problem = _validate_request(body)
        if problem:
            self._send_error(400, "invalid_request_error", problem)
            return

        turn, script_model = stub.turn_for(body, attempt(headers), "/v1/messages")
        if turn is None:
            # Retrying cannot help, so tell the SDK not to (keeps failing tests fast).
            self._send_error(500, "api_error", _exhausted(body), x_should_retry="false")
            return

        delay = turn.get("delay_ms")
        if delay:
            time.sleep(delay / 1000)

        stream = body.get("stream") is True
        if turn.get("drop") == "before_headers":
            self._drop()
            return
        if "error" in turn:
            self._scripted_error(turn, turn["error"], 500)
            return
        if "sse_error" in turn and not stream:
            self._scripted_error(turn, turn["sse_error"], 529, default_type="overloaded_error")
            return

        reply = reply_for(turn, body, script_model)
        if stream:
            self._stream(reply, turn)
        elif reply.stream_error is not None:  # a recorded stream that failed, asked as JSON
            err = reply.stream_error
            self._scripted_error(turn, {"status": 529, **err}, 529)
        else:
            self._reply_json(reply, turn)

    # -- OpenAI ----------------------------------------------------------------------------

    def _openai_error(self, status: int, error_type: str, message: str, **headers: str) -> None:
        request_id = random_id("req_", 32)
        self._send_json(status, openai_reply.error_body(status, error_type, message),
                        request_id, x_request_id=request_id, **headers)

    def _openai_scripted_error(self, turn: dict, err: dict, default_status: int) -> None:
        status = err.get("status", default_status)
        status, error_type, message, headers = scripted_error(
            turn, err, status, openai_reply.error_type(status))
        if not err.get("message"):
            message = openai_reply.default_message(status)
        self._openai_error(status, error_type, message, **headers)

    def _openai(self, api: str, raw: bytes) -> None:
        """``POST /v1/chat/completions`` or ``/v1/responses``: chosen as a Messages request
        is, answered in OpenAI's format."""
        stub = self.server.stub
        body, problem = self._parse_json(raw)
        headers = {k.lower(): v for k, v in self.headers.items()}
        stub.receive(self.path, headers, body)
        problem = problem if body is None else openai_reply.validate(api, body)
        if body is None or problem:
            self._openai_error(400, "invalid_request_error", problem or "invalid body")
            return
        turn, script_model = stub.turn_for(body, attempt(headers), api)
        if turn is None:
            self._openai_error(500, "server_error", _exhausted(body), x_should_retry="false")
            return
        if turn.get("delay_ms"):
            time.sleep(turn["delay_ms"] / 1000)
        stream = body.get("stream") is True
        if turn.get("drop") == "before_headers":
            self._drop()
            return
        if "error" in turn:
            self._openai_scripted_error(turn, turn["error"], 500)
            return
        if "sse_error" in turn and not stream:
            self._openai_scripted_error(turn, turn["sse_error"], 500)
            return
        reply = openai_reply.OpenAIReply(api, turn, body, script_model)
        request_id = random_id("req_", 32)
        if not stream:
            payload = dumps(reply.message()).encode()
            self._start(200, "application/json", request_id, x_request_id=request_id,
                        content_length=str(len(payload)))
            if turn.get("drop") == "after_headers":
                self._drop()
                return
            self.wfile.write(payload)
            return
        self._start(200, "text/event-stream; charset=utf-8", request_id,
                    x_request_id=request_id, cache_control="no-cache",
                    transfer_encoding="chunked")
        events = reply.event_bytes()
        if "sse_error" in turn:
            events = reply.stream_error(events, turn["sse_error"])
        self._send_events(events, turn)

    def _gemini(self, route: str, raw: bytes) -> None:
        """A Gemini request: what to send is :func:`recorder.testing.gemini_reply.answer`'s."""
        headers = {k.lower(): v for k, v in self.headers.items()}
        out = gemini_reply.answer(self.server.stub, self.path, route, raw, headers)
        self._send_outcome(out, "text/event-stream")

    def _bedrock(self, route: str, raw: bytes) -> None:
        """A Claude request on Bedrock: what to send is
        :func:`recorder.testing.bedrock_reply.answer`'s."""
        headers = {k.lower(): v for k, v in self.headers.items()}
        out = bedrock_reply.answer(self.server.stub, self.path, route, raw, headers)
        self._send_outcome(out, bedrock_reply.EVENT_STREAM)

    def _send_outcome(self, out: gemini_reply.Outcome, stream_type: str) -> None:
        """Send what a provider's reply module answered: its stream's events (as
        ``stream_type``) or its JSON body, dropped where its turn says."""
        drop = out.turn.get("drop")
        if drop == "before_headers":
            self._drop()
        elif out.events is not None:
            self._start(200, stream_type, random_id("req_"), transfer_encoding="chunked",
                        **out.headers)
            self._send_events(out.events, out.turn)
        else:
            payload = dumps(out.body).encode()
            self._start(out.status, "application/json", random_id("req_"),
                        content_length=str(len(payload)), **out.headers)
            if drop == "after_headers":
                self._drop()
            else:
                self.wfile.write(payload)

    def _send_events(self, events: list[bytes], turn: dict) -> None:
        event_delay = (turn.get("event_delay_ms") or 0) / 1000
        for i, event in enumerate(events):
            if i and event_delay:
                time.sleep(event_delay)
            self.wfile.write(chunk(event))
            if turn.get("drop") == "after_headers":
                self._drop()
                return
        self.wfile.write(b"0\r\n\r\n")

    def _scripted_error(
        self, turn: dict, err: dict, default_status: int, default_type: str | None = None
    ) -> None:
        status, error_type, message, headers = scripted_error(
            turn, err, default_status, default_type
        )
        self._send_error(status, error_type, message, **headers)

    def _reply_json(self, reply: Answer, turn: dict) -> None:
        payload = dumps(reply.message()).encode()
        self._start(
            200,
            "application/json",
            random_id("req_"),
            content_length=str(len(payload)),
        )
        if turn.get("drop") == "after_headers":
            self._drop()
            return
        self.wfile.write(payload)

    def _stream(self, reply: Answer, turn: dict) -> None:
        self._start(
            200,
            "text/event-stream; charset=utf-8",
            random_id("req_"),
            cache_control="no-cache",
            transfer_encoding="chunked",
        )
        self._send_events(stream_events(reply, turn), turn)


def _exhausted(body: dict) -> str:
    return (
        "stub script exhausted: no rule, turn or default of the script answers this request "
        f"(position {position(body)} of its conversation)"
    )


def _validate_request(body: dict) -> str | None:
    """Return an error message like the real API's for a malformed Messages request."""
    for field in ("model", "max_tokens", "messages"):
        if field not in body:
            return f"{field}: Field required"
    if not isinstance(body["model"], str) or not body["model"]:
        return "model: Input should be a valid string"
    max_tokens = body["max_tokens"]
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        return "max_tokens: Input should be a valid integer"
    if max_tokens < 1:
        return "max_tokens: Input should be greater than or equal to 1"
    if not isinstance(body["messages"], list):
        return "messages: Input should be a valid list"
    return None


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


class StubServer:
    """A scripted Anthropic Messages API (and OpenAI API) stub serving HTTP/1.1 in a daemon
    thread.

    ``requests`` lists every received ``POST /v1/messages``, ``/v1/chat/completions``,
    ``/v1/responses``, Gemini ``:generateContent`` and Bedrock ``/model/{id}/invoke``
    (including invalid ones) as
    ``{"path", "headers", "body"}``; ``served`` counts the requests answered from the script
    (default turns included, the exhausted-script 500 not) since the last :meth:`load`. Which
    turn answers a request is decided by :func:`recorder.testing.match.pick`; only the
    ``"sequence"`` mode's pointer is kept between requests.
    """

    def __init__(
        self, script: dict | str | os.PathLike, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.host = host
        self._requested_port = port
        self._lock = threading.Lock()
        self._script = load_script(script)
        self._next = 0  # "sequence": index of the next turn
        self.served = 0
        self.requests: list[dict] = []
        self._httpd: HttpServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound port (the requested one until :meth:`start`)."""
        if self._httpd is not None:
            return int(self._httpd.server_address[1])
        return self._requested_port

    @property
    def url(self) -> str:
        """Base URL to give the SDK, e.g. ``http://127.0.0.1:PORT``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> StubServer:
        """Bind and serve in a daemon thread; returns ``self``. No-op if already running."""
        if self._httpd is not None:
            return self
        httpd = HttpServer((self.host, self._requested_port), _Handler, self)
        self._thread = serve_in_thread(httpd, f"deja-stub-{httpd.server_address[1]}")
        self._httpd = httpd
        log.debug("stub server listening on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and close every socket, including open keep-alive connections."""
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        httpd.close_connections()
        if thread is not None:
            thread.join(timeout=5)
        self._httpd = None
        self._thread = None
        log.debug("stub server stopped")

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- script --------------------------------------------------------------------------

    def load(self, script: dict | str | os.PathLike) -> None:
        """Replace the script; reset the sequence pointer and ``served``."""
        loaded = load_script(script)
        with self._lock:
            self._script = loaded
            self._next = 0
            self.served = 0

    # -- what the request handler asks ---------------------------------------------------

    def receive(self, path: str, headers: dict[str, str], body: dict | None) -> None:
        """Note a model request in :attr:`requests` (``body`` is ``None`` if unreadable)."""
        with self._lock:
            self.requests.append({"path": path, "headers": headers, "body": body})

    def received(self) -> list[dict]:
        """A copy of :attr:`requests`, taken while no request is being noted."""
        with self._lock:
            return list(self.requests)

    def turn_for(self, body: dict, attempt_number: int = 0,
                 endpoint: str | None = None) -> tuple[dict | None, str | None]:
        """The turn answering a valid request to ``endpoint`` (``None``: script exhausted) and
        the script model.

        A turn found counts as served.
        """
        with self._lock:
            script = self._script
            turn = pick(script, body, attempt_number, self._next_in_sequence, endpoint)
            if turn is not None:
                self.served += 1
            return turn, script.get("model")

    def _next_in_sequence(self) -> dict | None:
        turns = self._script["turns"]
        if self._next < len(turns):
            self._next += 1
            return turns[self._next - 1]
        return None

