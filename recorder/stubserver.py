"""A scripted stub of the Anthropic Messages API, served over HTTP on 127.0.0.1.

The stub lets the real ``anthropic`` SDK be driven with no network and no API key: tests,
benchmarks and the demo point ``anthropic.Anthropic(base_url=server.url, api_key="sk-test")``
at it. It speaks the wire protocol of ``POST /v1/messages``: JSON responses, SSE streaming
(``"stream": true``) with chunked transfer encoding, tool use, thinking blocks, and error
responses with the real error body and retry headers. Standard library only.

A *script* (a dict, a JSON file, or JSON text) lists the turns to answer with, in order, one
per ``POST /v1/messages``::

    {
      "model": "claude-sonnet-4-5",
      "turns": [
        {"text": "Hello!", "usage": {"input_tokens": 12, "output_tokens": 3}},
        {"text": "Let me search.", "tool_use": {"name": "search", "input": {"query": "x"}}},
        {"tool_use": [{"name": "a", "input": {}}, {"name": "b", "input": {"k": 1}}]},
        {"thinking": "hmm", "text": "answer"},
        {"error": {"status": 529, "type": "overloaded_error", "message": "Overloaded",
                   "retry_after": 0}},
        {"text": "partial", "sse_error": {"type": "overloaded_error", "after_events": 3}},
        {"drop": "before_headers"},
        {"text": "slow", "delay_ms": 50, "event_delay_ms": 5}
      ],
      "default": {"text": "ok"}
    }

Turn fields: ``text``, ``thinking``, ``tool_use`` (a dict or a list of dicts with ``name``,
optional ``input`` and ``id``), ``stop_reason``, ``stop_sequence``, ``usage``, ``error``,
``sse_error``, ``drop`` (``"before_headers"`` / ``"after_headers"``), ``delay_ms`` and
``event_delay_ms``. The placeholder ``{echo}`` in ``text`` or ``thinking`` is replaced by the
text of the last user message. Keys starting with ``_`` (and ``comment``/``description``) are
ignored, so scripts can carry notes.

Control endpoints for other processes: ``GET /_stub/health``, ``GET /_stub/requests`` and
``POST /_stub/script`` (body: a script). ``POST /v1/messages/count_tokens`` answers with a rough
token count.

Typical use::

    with StubServer({"turns": [{"text": "hi"}]}) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="sk-test")
        client.messages.create(model="m", max_tokens=10, messages=[...])
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import secrets
import socket
import string
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["StubScriptError", "StubServer", "load_script", "serve"]

log = logging.getLogger(__name__)

_BASE62 = string.ascii_letters + string.digits

_DROP_MODES = ("before_headers", "after_headers")

_DEFAULT_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}

_DEFAULT_ERROR_MESSAGES: dict[str, str] = {
    "overloaded_error": "Overloaded",
    "api_error": "Internal server error",
    "rate_limit_error": "Rate limited",
    "not_found_error": "Not found",
}

_USAGE_KEYS = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
)

_NOTE_KEYS = frozenset({"comment", "description", "name"})
_SCRIPT_KEYS = frozenset({"model", "turns", "default"})
_TURN_KEYS = frozenset(
    {
        "text",
        "thinking",
        "tool_use",
        "stop_reason",
        "stop_sequence",
        "usage",
        "error",
        "sse_error",
        "drop",
        "delay_ms",
        "event_delay_ms",
        "should_retry",
    }
)
_ERROR_KEYS = frozenset({"status", "type", "message", "retry_after", "should_retry"})
_SSE_ERROR_KEYS = frozenset({"type", "message", "after_events", "status"})
_TOOL_KEYS = frozenset({"name", "input", "id"})

_JSON_SEPARATORS = (",", ":")


class StubScriptError(ValueError):
    """A stub script is malformed; the message names the bad turn and field."""


def _random_id(prefix: str, n: int = 24) -> str:
    return prefix + "".join(secrets.choice(_BASE62) for _ in range(n))


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=_JSON_SEPARATORS, ensure_ascii=False)


# --------------------------------------------------------------------------------------------
# Script loading and validation
# --------------------------------------------------------------------------------------------


def _is_note(key: Any) -> bool:
    return isinstance(key, str) and (key.startswith("_") or key in _NOTE_KEYS)


def _check_keys(where: str, obj: dict, allowed: frozenset[str], *, notes: bool = False) -> None:
    for key in obj:
        if key in allowed or (notes and _is_note(key)):
            continue
        raise StubScriptError(
            f"{where}: unknown field {key!r} (expected one of {', '.join(sorted(allowed))})"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_non_negative_number(where: str, field: str, value: Any) -> None:
    if not _is_number(value) or value < 0:
        raise StubScriptError(f"{where}: field {field!r} must be a number >= 0, got {value!r}")


def _check_non_negative_int(where: str, field: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise StubScriptError(f"{where}: field {field!r} must be an integer >= 0, got {value!r}")


def _check_str(where: str, field: str, value: Any, *, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, str):
        raise StubScriptError(f"{where}: field {field!r} must be a string, got {value!r}")


def _validate_tool(where: str, field: str, tool: Any) -> None:
    if not isinstance(tool, dict):
        raise StubScriptError(f"{where}: field {field!r} must be an object, got {tool!r}")
    _check_keys(f"{where}: {field}", tool, _TOOL_KEYS)
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise StubScriptError(f"{where}: field '{field}.name' must be a non-empty string")
    if "input" in tool and not isinstance(tool["input"], dict):
        raise StubScriptError(
            f"{where}: field '{field}.input' must be an object, got {tool['input']!r}"
        )
    if "id" in tool and (not isinstance(tool["id"], str) or not tool["id"]):
        raise StubScriptError(f"{where}: field '{field}.id' must be a non-empty string")


def _validate_turn(where: str, turn: Any) -> None:
    if not isinstance(turn, dict):
        raise StubScriptError(f"{where}: must be an object, got {turn!r}")
    _check_keys(where, turn, _TURN_KEYS, notes=True)

    for field in ("text", "thinking"):
        if field in turn:
            _check_str(where, field, turn[field])
    if "stop_reason" in turn:
        _check_str(where, "stop_reason", turn["stop_reason"])
    if "stop_sequence" in turn:
        _check_str(where, "stop_sequence", turn["stop_sequence"], nullable=True)

    if "tool_use" in turn:
        tool_use = turn["tool_use"]
        if isinstance(tool_use, list):
            if not tool_use:
                raise StubScriptError(f"{where}: field 'tool_use' must not be an empty list")
            for i, tool in enumerate(tool_use):
                _validate_tool(where, f"tool_use[{i}]", tool)
        else:
            _validate_tool(where, "tool_use", tool_use)

    if "usage" in turn:
        usage = turn["usage"]
        if not isinstance(usage, dict):
            raise StubScriptError(f"{where}: field 'usage' must be an object, got {usage!r}")
        _check_keys(f"{where}: usage", usage, frozenset(_USAGE_KEYS))
        for key, value in usage.items():
            _check_non_negative_int(where, f"usage.{key}", value)

    if "should_retry" in turn and not isinstance(turn["should_retry"], bool):
        raise StubScriptError(f"{where}: field 'should_retry' must be true or false")

    failures = [key for key in ("error", "sse_error", "drop") if key in turn]
    if len(failures) > 1:
        raise StubScriptError(
            f"{where}: fields {' and '.join(repr(f) for f in failures)} cannot be combined"
        )

    if "error" in turn:
        err = turn["error"]
        if not isinstance(err, dict):
            raise StubScriptError(f"{where}: field 'error' must be an object, got {err!r}")
        _check_keys(f"{where}: error", err, _ERROR_KEYS)
        status = err.get("status")
        if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
            raise StubScriptError(
                f"{where}: field 'error.status' must be an HTTP status 400-599, got {status!r}"
            )
        for key in ("type", "message"):
            if key in err:
                _check_str(where, f"error.{key}", err[key])
        if "retry_after" in err:
            _check_non_negative_number(where, "error.retry_after", err["retry_after"])
        if "should_retry" in err and not isinstance(err["should_retry"], bool):
            raise StubScriptError(f"{where}: field 'error.should_retry' must be true or false")

    if "sse_error" in turn:
        err = turn["sse_error"]
        if not isinstance(err, dict):
            raise StubScriptError(f"{where}: field 'sse_error' must be an object, got {err!r}")
        _check_keys(f"{where}: sse_error", err, _SSE_ERROR_KEYS)
        for key in ("type", "message"):
            if key in err:
                _check_str(where, f"sse_error.{key}", err[key])
        if "after_events" in err:
            _check_non_negative_int(where, "sse_error.after_events", err["after_events"])
        if "status" in err:
            status = err["status"]
            if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
                raise StubScriptError(
                    f"{where}: field 'sse_error.status' must be an HTTP status 400-599, "
                    f"got {status!r}"
                )

    if "drop" in turn and turn["drop"] not in _DROP_MODES:
        raise StubScriptError(
            f"{where}: field 'drop' must be 'before_headers' or 'after_headers', "
            f"got {turn['drop']!r}"
        )

    for field in ("delay_ms", "event_delay_ms"):
        if field in turn:
            _check_non_negative_number(where, field, turn[field])


def _read_script_source(script: dict | str | os.PathLike) -> Any:
    if isinstance(script, dict):
        return copy.deepcopy(script)
    if isinstance(script, str) and script.lstrip().startswith("{"):
        try:
            return json.loads(script)
        except json.JSONDecodeError as exc:
            raise StubScriptError(f"script: invalid JSON: {exc}") from exc
    if isinstance(script, str | os.PathLike):
        path = Path(script)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise StubScriptError(f"script: cannot read {str(path)!r}: {exc}") from exc
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise StubScriptError(f"script {str(path)!r}: invalid JSON: {exc}") from exc
    raise StubScriptError(
        f"script must be a dict, a JSON file path or JSON text, got {type(script).__name__}"
    )


def load_script(script: dict | str | os.PathLike) -> dict:
    """Load and validate a stub script.

    ``script`` is a dict, a path to a JSON file, or a string of JSON text (starting with ``{``).
    Returns a validated deep copy that always has a ``"turns"`` list. Raises
    :class:`StubScriptError` naming the bad turn (``turn 3``, or ``default``) and field.
    """
    data = _read_script_source(script)
    if not isinstance(data, dict):
        raise StubScriptError(f"script: top level must be an object, got {type(data).__name__}")
    _check_keys("script", data, _SCRIPT_KEYS, notes=True)
    if "model" in data:
        _check_str("script", "model", data["model"])
    turns = data.setdefault("turns", [])
    if not isinstance(turns, list):
        raise StubScriptError(f"script: field 'turns' must be a list, got {type(turns).__name__}")
    for index, turn in enumerate(turns):
        _validate_turn(f"turn {index}", turn)
    if "default" in data and data["default"] is not None:
        _validate_turn("default", data["default"])
    return data


# --------------------------------------------------------------------------------------------
# Building responses
# --------------------------------------------------------------------------------------------


def _rough_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def _block_text(block: Any) -> str:
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        return ""
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "\n".join(t for t in (_block_text(b) for b in content) if t)
    return ""


def _last_user_text(body: dict) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "\n".join(t for t in (_block_text(b) for b in content) if t)
            return ""
    return ""


def _input_tokens(body: dict) -> int:
    text = _dumps(body.get("messages"))
    for key in ("system", "tools"):
        if key in body:
            text += _dumps(body[key])
    return _rough_tokens(text)


def _split_words(text: str, words_per_chunk: int = 3) -> list[str]:
    """Split text into chunks of a few words; the chunks concatenate back to ``text``."""
    if not text:
        return []
    pieces = re.split(r"(?<=\s)(?=\S)", text)
    return [
        "".join(pieces[i : i + words_per_chunk]) for i in range(0, len(pieces), words_per_chunk)
    ]


def _split_json(raw: str) -> list[str]:
    """Split a JSON string into 2-3 chunks (as input_json_delta partial_json values)."""
    if len(raw) < 2:
        return [raw]
    if len(raw) < 6:
        mid = len(raw) // 2
        return [raw[:mid], raw[mid:]]
    a, b = len(raw) // 3, 2 * len(raw) // 3
    return [raw[:a], raw[a:b], raw[b:]]


class _Reply:
    """A successful message reply built from a turn, renderable as JSON or SSE events."""

    def __init__(self, turn: dict, body: dict, script_model: str | None) -> None:
        echo = _last_user_text(body) if _turn_uses_echo(turn) else ""
        self.model = body.get("model") or script_model or "claude-stub"
        self.id = _random_id("msg_")
        self.content: list[dict] = []
        output_parts: list[str] = []

        if "thinking" in turn:
            thinking = turn["thinking"].replace("{echo}", echo)
            self.content.append(
                {"type": "thinking", "thinking": thinking, "signature": _random_id("", 64)}
            )
            output_parts.append(thinking)
        if "text" in turn:
            text = turn["text"].replace("{echo}", echo)
            self.content.append({"type": "text", "text": text})
            output_parts.append(text)
        tools = turn.get("tool_use")
        if isinstance(tools, dict):
            tools = [tools]
        for tool in tools or []:
            tool_input = copy.deepcopy(tool.get("input", {}))
            self.content.append(
                {
                    "type": "tool_use",
                    "id": tool.get("id") or _random_id("toolu_"),
                    "name": tool["name"],
                    "input": tool_input,
                }
            )
            output_parts.append(tool["name"] + _dumps(tool_input))

        self.stop_reason = turn.get("stop_reason") or ("tool_use" if tools else "end_turn")
        self.stop_sequence = turn.get("stop_sequence")
        given = turn.get("usage") or {}
        self.usage = {
            "input_tokens": given.get("input_tokens", _input_tokens(body)),
            "output_tokens": given.get("output_tokens", _rough_tokens("".join(output_parts))),
            "cache_creation_input_tokens": given.get("cache_creation_input_tokens", 0),
            "cache_read_input_tokens": given.get("cache_read_input_tokens", 0),
        }

    def message(self) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage,
        }

    def events(self) -> list[tuple[str, dict]]:
        start_usage = dict(self.usage, output_tokens=1)
        events: list[tuple[str, dict]] = [
            (
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": self.id,
                        "type": "message",
                        "role": "assistant",
                        "model": self.model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": start_usage,
                    },
                },
            ),
            ("ping", {"type": "ping"}),
        ]
        for index, block in enumerate(self.content):
            kind = block["type"]
            if kind == "thinking":
                start = {"type": "thinking", "thinking": "", "signature": ""}
                deltas = [
                    {"type": "thinking_delta", "thinking": chunk}
                    for chunk in _split_words(block["thinking"])
                ]
                deltas.append({"type": "signature_delta", "signature": block["signature"]})
            elif kind == "text":
                start = {"type": "text", "text": ""}
                deltas = [
                    {"type": "text_delta", "text": chunk} for chunk in _split_words(block["text"])
                ]
            else:
                start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                deltas = [
                    {"type": "input_json_delta", "partial_json": chunk}
                    for chunk in _split_json(_dumps(block["input"]))
                ]
            events.append(
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": start},
                )
            )
            for delta in deltas:
                events.append(
                    (
                        "content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": delta},
                    )
                )
            events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        events.append(
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                    "usage": {"output_tokens": self.usage["output_tokens"]},
                },
            )
        )
        events.append(("message_stop", {"type": "message_stop"}))
        return events


def _turn_uses_echo(turn: dict) -> bool:
    return "{echo}" in turn.get("text", "") or "{echo}" in turn.get("thinking", "")


def _sse_bytes(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {_dumps(data)}\n\n".encode()


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _error_body(error_type: str, message: str, request_id: str) -> dict:
    return {
        "type": "error",
        "error": {"type": error_type, "message": message},
        "request_id": request_id,
    }


# --------------------------------------------------------------------------------------------
# HTTP server
# --------------------------------------------------------------------------------------------


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], stub: StubServer) -> None:
        self.stub = stub
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # pragma: no cover - not a TCP socket
            pass
        with self._conns_lock:
            self._conns.add(sock)
        return sock, addr

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
            self._conns.clear()
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:  # pragma: no cover
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("stub server: error while handling %s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "deja-stub/1.0"
    sys_version = ""
    server: _HTTPServer

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
        payload = _dumps(obj).encode()
        self._start(
            status,
            "application/json",
            request_id or _random_id("req_"),
            content_length=str(len(payload)),
            **headers,
        )
        self.wfile.write(payload)

    def _send_error(self, status: int, error_type: str, message: str, **headers: str) -> None:
        request_id = _random_id("req_")
        self._send_json(status, _error_body(error_type, message, request_id), request_id, **headers)

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
            with stub._lock:
                snapshot = list(stub.requests)
            self._send_json(200, snapshot)
        else:
            self._not_found()

    def do_POST(self) -> None:
        raw = self._read_body()
        route = self._route()
        if route == "/v1/messages":
            self._messages(raw)
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
        self._send_json(200, {"ok": True, "turns": len(body.get("turns") or [])})

    def _count_tokens(self, raw: bytes) -> None:
        body, problem = self._parse_json(raw)
        if body is None:
            self._send_error(400, "invalid_request_error", problem or "invalid body")
            return
        for field in ("model", "messages"):
            if field not in body:
                self._send_error(400, "invalid_request_error", f"{field}: Field required")
                return
        self._send_json(200, {"input_tokens": _input_tokens(body)})

    def _messages(self, raw: bytes) -> None:
        stub = self.server.stub
        body, problem = self._parse_json(raw)
        stub._record(
            {
                "path": self.path,
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "body": body,
            }
        )
        if body is None:
            self._send_error(400, "invalid_request_error", problem or "invalid body")
            return
        problem = _validate_request(body)
        if problem:
            self._send_error(400, "invalid_request_error", problem)
            return

        turn, script_model = stub._next_turn()
        if turn is None:
            # Retrying cannot help, so tell the SDK not to (keeps failing tests fast).
            self._send_error(500, "api_error", "stub script exhausted", x_should_retry="false")
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

        reply = _Reply(turn, body, script_model)
        if stream:
            self._stream(reply, turn)
        else:
            self._reply_json(reply, turn)

    def _scripted_error(
        self, turn: dict, err: dict, default_status: int, default_type: str | None = None
    ) -> None:
        status = err.get("status", default_status)
        error_type = err.get("type") or default_type or _DEFAULT_ERROR_TYPES.get(status)
        if error_type is None:
            error_type = "api_error" if status >= 500 else "invalid_request_error"
        message = err.get("message") or _DEFAULT_ERROR_MESSAGES.get(error_type, error_type)
        headers: dict[str, str] = {}
        retry_after = err.get("retry_after")
        if retry_after is not None:
            seconds = int(retry_after) if float(retry_after).is_integer() else retry_after
            headers["retry_after"] = str(seconds)
            headers["retry_after_ms"] = str(round(float(retry_after) * 1000))
        should_retry = err.get("should_retry", turn.get("should_retry"))
        if should_retry is not None:
            headers["x_should_retry"] = "true" if should_retry else "false"
        self._send_error(status, error_type, message, **headers)

    def _reply_json(self, reply: _Reply, turn: dict) -> None:
        payload = _dumps(reply.message()).encode()
        self._start(
            200,
            "application/json",
            _random_id("req_"),
            content_length=str(len(payload)),
        )
        if turn.get("drop") == "after_headers":
            self._drop()
            return
        self.wfile.write(payload)

    def _stream(self, reply: _Reply, turn: dict) -> None:
        self._start(
            200,
            "text/event-stream; charset=utf-8",
            _random_id("req_"),
            cache_control="no-cache",
            transfer_encoding="chunked",
        )
        events = [_sse_bytes(name, data) for name, data in reply.events()]
        sse_error = turn.get("sse_error")
        if sse_error is not None:
            cut = min(sse_error.get("after_events", 0), len(events))
            error_event = _sse_bytes(
                "error",
                {
                    "type": "error",
                    "error": {
                        "type": sse_error.get("type", "overloaded_error"),
                        "message": sse_error.get("message", "Overloaded"),
                    },
                },
            )
            events = [*events[:cut], error_event]
        event_delay = (turn.get("event_delay_ms") or 0) / 1000
        drop_after_headers = turn.get("drop") == "after_headers"
        for i, event in enumerate(events):
            if i and event_delay:
                time.sleep(event_delay)
            self.wfile.write(_chunk(event))
            if drop_after_headers:
                self._drop()
                return
        self.wfile.write(b"0\r\n\r\n")


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
    """A scripted Anthropic Messages API stub serving HTTP/1.1 in a daemon thread.

    ``requests`` lists every received ``POST /v1/messages`` (including invalid ones) as
    ``{"path", "headers", "body"}``; ``served`` counts the turns consumed (default turns
    included) since the last :meth:`load`.
    """

    def __init__(
        self, script: dict | str | os.PathLike, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.host = host
        self._requested_port = port
        self._lock = threading.Lock()
        self._script = load_script(script)
        self._next = 0
        self.served = 0
        self.requests: list[dict] = []
        self._httpd: _HTTPServer | None = None
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
        httpd = _HTTPServer((self.host, self._requested_port), self)
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"deja-stub-{self.port}",
            daemon=True,
        )
        self._thread.start()
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
        """Replace the script and reset the turn pointer (and ``served``)."""
        loaded = load_script(script)
        with self._lock:
            self._script = loaded
            self._next = 0
            self.served = 0

    def _next_turn(self) -> tuple[dict | None, str | None]:
        with self._lock:
            script = self._script
            turns = script["turns"]
            if self._next < len(turns):
                turn = turns[self._next]
                self._next += 1
            else:
                turn = script.get("default")
                if turn is None:
                    return None, script.get("model")
            self.served += 1
            return turn, script.get("model")

    def _record(self, entry: dict) -> None:
        with self._lock:
            self.requests.append(entry)


def serve(script: dict | str | os.PathLike, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve ``script`` in the foreground until interrupted (for ``deja stub``)."""
    if not logging.getLogger().hasHandlers():
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    server = StubServer(script, host=host, port=port).start()
    log.info("deja stub server listening on %s (Ctrl-C to stop)", server.url)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
