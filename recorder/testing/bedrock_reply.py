"""What the stub server (:mod:`recorder.testing.server`) sends to a Claude request on Amazon
Bedrock.

Bedrock speaks the Messages API on other paths: ``POST /model/{modelId}/invoke`` answers one
message JSON, ``POST /model/{modelId}/invoke-with-response-stream`` the same message as AWS
event-stream frames (``application/vnd.amazon.eventstream``). The body is a Messages request
with ``anthropic_version`` and without ``model`` or ``stream`` (the path says them), which
the stub checks as Bedrock does. ``anthropic.AnthropicBedrock(base_url=server.url, ...)``
is pointed at it.

The answer is chosen from the same scripts, by the same rules, as a ``/v1/messages`` request
(a rule's ``endpoint`` is ``/v1/messages``; ``stream`` holds on the streaming path), and built
by :mod:`recorder.testing.reply` with the model the path names. A stream carries the very
events the Messages stub writes, one chunk frame each (``{"bytes": <base64 of the event's
JSON>, "p": <padding>}``), the last one, ``message_stop``, with Bedrock's
``amazon-bedrock-invocationMetrics``; a stream cut by ``sse_error`` ends with an exception
frame (``throttlingException``, ...). An error before the answer is Bedrock's: its status,
``x-amzn-ErrorType: <Name>Exception:<namespace>`` and ``{"message": ...}``.

The signature is not checked (nothing here knows the secret), but a request must carry an
``authorization`` header, SigV4's (``AWS4-HMAC-SHA256 ...``) or a Bedrock API key's
(``Bearer ...``): without one it gets Bedrock's 403. The frames are written here, with the
standard library: the stub is a witness independent of the recorder's event-stream codec.
"""

from __future__ import annotations

import base64
import json
import random
import struct
import time
import uuid
import zlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from recorder.testing.events import _parsed, compact_json
from recorder.testing.gemini_reply import Outcome, _Stub
from recorder.testing.match import attempt, position
from recorder.testing.reply import Answer, reply_for, scripted_error, stream_events

__all__ = ["EVENT_STREAM", "INVOKE", "INVOKE_STREAM", "answer", "endpoint", "frame", "model_of",
           "validate"]

INVOKE = "/invoke"
INVOKE_STREAM = "/invoke-with-response-stream"
EVENT_STREAM = "application/vnd.amazon.eventstream"
# The Messages endpoint a Bedrock request is matched as (a rule's ``when.endpoint``).
_MATCHED_AS = "/v1/messages"
_NAMESPACE = "http://internal.amazon.com/coral/com.amazon.bedrock/"
_PADDING = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
# Bedrock's error of an HTTP status, and what it says when the script says nothing.
_ERRORS = {400: ("ValidationException", "Malformed input request, please reformat your input "
                 "and try again."),
           403: ("AccessDeniedException", "You don't have access to the model with the "
                 "specified model ID."),
           404: ("ResourceNotFoundException", "The requested resource could not be found."),
           408: ("ModelTimeoutException", "Model has timed out in processing the request."),
           424: ("ModelErrorException", "The model returned an error."),
           429: ("ThrottlingException", "Too many requests, please wait before trying again."),
           500: ("InternalServerException", "The server encountered an internal error while "
                 "processing the request."),
           503: ("ServiceUnavailableException", "Bedrock is unable to process your request.")}
# The Bedrock name of a scripted Messages error type.
_NAMES = {"invalid_request_error": "ValidationException",
          "permission_error": "AccessDeniedException", "not_found_error":
          "ResourceNotFoundException", "rate_limit_error": "ThrottlingException",
          "api_error": "InternalServerException", "timeout_error": "ModelTimeoutException",
          "overloaded_error": "ServiceUnavailableException"}
_EXHAUSTED = ("stub script exhausted: no rule, turn or default of the script answers this "
              "request (position {} of its conversation)")
# The exceptions a Bedrock response stream is cut by.
_STREAM_EXCEPTIONS = ("internalServerException", "modelStreamErrorException",
                      "validationException", "throttlingException", "modelTimeoutException",
                      "serviceUnavailableException")


def endpoint(route: str) -> str | None:
    """Which Bedrock endpoint a request path is (None: not one)."""
    if not route.startswith("/model/"):
        return None
    return next((e for e in (INVOKE_STREAM, INVOKE) if route.endswith(e)
                 and len(route) > len("/model/") + len(e)), None)


def model_of(route: str) -> str:
    """The model id a Bedrock path names (``/model/{modelId}/invoke``, the id quoted)."""
    return unquote(route[len("/model/"):].rpartition("/")[0])


def _error_name(status: int, kind: str | None) -> str:
    """Bedrock's exception name for a scripted error: its type when it is one of Bedrock's
    names already, a Messages type's counterpart, else the status's."""
    if kind and kind.endswith("Exception"):
        return kind[0].upper() + kind[1:]
    if kind in _NAMES:
        return _NAMES[kind]
    fallback = _ERRORS[500 if status >= 500 else 400]
    return _ERRORS.get(status, fallback)[0]


def _error_headers(name: str) -> dict[str, str]:
    """The headers of a Bedrock error named ``name`` (``ThrottlingException``)."""
    return {"x-amzn-ErrorType": f"{name}:{_NAMESPACE}", "x-amzn-RequestId": str(uuid.uuid4())}


def _error(status: int, message: str | None = None, name: str | None = None,
           **headers: str) -> Outcome:
    name = name or _error_name(status, None)
    default = next((m for n, m in _ERRORS.values() if n == name), name)
    return Outcome(status, {"message": message or default}, {**_error_headers(name), **headers})


def _scripted(turn: dict, err: dict, default_status: int) -> Outcome:
    status, _, _, headers = scripted_error(turn, err, default_status, "-")
    return _error(status, err.get("message"), _error_name(status, err.get("type")), **headers)


def validate(body: dict) -> str | None:
    """Bedrock's message for a malformed Messages body (None: it is well formed)."""
    for key in ("anthropic_version", "max_tokens", "messages"):
        if key not in body:
            return f"Malformed input request: #: required key [{key}] not found, please " \
                   "reformat your input and try again."
    for key in ("model", "stream"):
        if key in body:
            return f"Malformed input request: #: extraneous key [{key}] is not permitted, " \
                   "please reformat your input and try again."
    return None


# ------------------------------------------------------------------ the frames


def frame(headers: Mapping[str, str], payload: bytes) -> bytes:
    """One event-stream frame of string headers and ``payload``, its CRCs computed."""
    raw = b""
    for name, value in headers.items():
        name_bytes, value_bytes = name.encode(), value.encode()
        raw += struct.pack(">B", len(name_bytes)) + name_bytes + \
            struct.pack(">BH", 7, len(value_bytes)) + value_bytes
    head = struct.pack(">II", 16 + len(raw) + len(payload), len(raw))
    head += struct.pack(">I", zlib.crc32(head))
    message = head + raw + payload
    return message + struct.pack(">I", zlib.crc32(message))


def _chunk(event: Mapping[str, Any]) -> bytes:
    """The chunk frame of one Messages event, padded by a random length as Bedrock pads."""
    padding = _PADDING[:random.randint(1, len(_PADDING))]
    part = {"bytes": base64.b64encode(compact_json(event).encode()).decode(), "p": padding}
    return frame({":event-type": "chunk", ":content-type": "application/json",
                  ":message-type": "event"}, compact_json(part).encode())


def _exception(error: Mapping[str, Any]) -> bytes:
    """The exception frame that cuts a stream, for the ``error`` of an error event."""
    name = _error_name(500, error.get("type"))
    kind = name[0].lower() + name[1:]
    kind = kind if kind in _STREAM_EXCEPTIONS else "modelStreamErrorException"
    message = error.get("message") or next((m for n, m in _ERRORS.values() if n == name), name)
    return frame({":exception-type": kind, ":content-type": "application/json",
                  ":message-type": "exception"}, compact_json({"message": message}).encode())


def _metrics(reply: Answer, started: float) -> dict[str, int]:
    usage = reply.message().get("usage") or {}
    elapsed = max(1, round((time.monotonic() - started) * 1000))
    return {"inputTokenCount": usage.get("input_tokens", 0),
            "outputTokenCount": usage.get("output_tokens", 0),
            "invocationLatency": elapsed, "firstByteLatency": elapsed}


def _frames(reply: Answer, turn: dict, started: float) -> list[bytes]:
    """The frames of a streamed answer: the Messages stub's events, one a frame."""
    frames = []
    for event in stream_events(reply, turn):
        for name, doc in _parsed(event.decode()):
            if not isinstance(doc, dict):
                continue
            if name == "error" or doc.get("type") == "error":
                frames.append(_exception(doc.get("error") or {}))
                continue
            if doc.get("type") == "message_stop":
                doc.setdefault("amazon-bedrock-invocationMetrics", _metrics(reply, started))
            frames.append(_chunk(doc))
    return frames


# ------------------------------------------------------------------ what the server sends


def _authorized(headers: Mapping[str, str]) -> bool:
    auth = headers.get("authorization", "")
    return auth.startswith(("AWS4-HMAC-SHA256", "Bearer "))


def _success(reply: Answer, turn: dict, stream: bool, started: float) -> Outcome:
    request_id = {"x-amzn-RequestId": str(uuid.uuid4())}
    if stream:
        return Outcome(headers={**request_id, "X-Amzn-Bedrock-Content-Type": "application/json"},
                       events=_frames(reply, turn, started), turn=turn)
    if reply.stream_error is not None:  # a recorded stream that failed, asked as JSON
        return _scripted(turn, {"status": 503, **reply.stream_error}, 503)
    message = reply.message()
    metrics = _metrics(reply, started)
    return Outcome(body=message, turn=turn, headers={
        **request_id, "X-Amzn-Bedrock-Invocation-Latency": str(metrics["invocationLatency"]),
        "X-Amzn-Bedrock-Input-Token-Count": str(metrics["inputTokenCount"]),
        "X-Amzn-Bedrock-Output-Token-Count": str(metrics["outputTokenCount"])})


def answer(stub: _Stub, path: str, route: str, raw: bytes,
           headers: Mapping[str, str]) -> Outcome:
    """The answer to a Bedrock request (``route``, its path without the query, is one of
    :func:`endpoint`'s), chosen from the script as a Messages request's is."""
    started = time.monotonic()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        body = None
    body = body if isinstance(body, dict) else None
    stub.receive(path, dict(headers), body)
    if not _authorized(headers):
        return Outcome(403, {"message": "Missing Authentication Token"},
                       _error_headers("MissingAuthenticationTokenException"))
    problem = _ERRORS[400][1] if body is None else validate(body)
    if body is None or problem:
        return _error(400, problem)
    stream = endpoint(route) == INVOKE_STREAM
    # Matched and answered as the Messages request it is: the path's model, and its stream.
    asked = {**body, "model": model_of(route), **({"stream": True} if stream else {})}
    turn, script_model = stub.turn_for(asked, attempt(headers), _MATCHED_AS)
    if turn is None:  # retrying cannot help, so the SDK is told not to
        return _error(500, _EXHAUSTED.format(position(body)), x_should_retry="false")
    time.sleep((turn.get("delay_ms") or 0) / 1000)
    failure = turn.get("error") or (None if stream else turn.get("sse_error"))
    if failure is not None:
        return _scripted(turn, failure, 500 if "error" in turn else 503)
    return _success(reply_for(turn, asked, script_model), turn, stream, started)
