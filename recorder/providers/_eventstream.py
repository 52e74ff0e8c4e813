"""AWS's binary event-stream framing, as Amazon Bedrock streams a model's events in it.

A response of ``invoke-with-response-stream`` (``application/vnd.amazon.eventstream``) is a
run of frames, each::

    total length (u32 BE) | headers length (u32 BE) | CRC32 of those 8 bytes
    headers: name length (u8), name, value type (u8), value
    payload | CRC32 of everything before it

A frame with ``:message-type`` ``event`` and ``:event-type`` ``chunk`` carries one Anthropic
Messages event: its payload is ``{"bytes": "<base64 of the event's JSON>", "p": "..."}``
(``p`` is padding that hides the event's length). A frame with ``:message-type``
``exception`` carries an error (``:exception-type``, payload ``{"message": ...}``).

:func:`decode` and :func:`encode` read and write frames; :func:`text_view` shows a stream as
the Server-Sent Events the anthropic SDK's Bedrock decoder makes of it, the text the
Messages codec reads; :func:`restream` writes an edited text back into the frames it came
from (padding and headers kept); :func:`from_text` frames a Messages event text afresh.
What is accepted follows botocore's ``EventStreamBuffer`` and the SDK's
``AWSEventStreamDecoder``, which read these streams in the client. Standard library only.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

__all__ = ["CHUNK_HEADERS", "PADDING", "STREAM_EXCEPTIONS", "Frame", "HeaderValue", "decode",
           "encode", "from_text", "restream", "text_view"]

HeaderValue = str | bytes | int | bool

_PRELUDE = 12  # total length, headers length, prelude CRC
_OVERHEAD = _PRELUDE + 4  # and the message CRC
# botocore's limits: a frame past them is refused by the client, so it is no frame here.
_MAX_HEADERS = 128 * 1024
_MAX_PAYLOAD = 24 * 1024 * 1024
# The value types of a header, by their number: a fixed size, or a u16 length first (None).
_BOOL_TRUE, _BOOL_FALSE, _BYTE, _SHORT, _INT, _LONG, _BYTES, _STRING, _TIMESTAMP, _UUID = \
    range(10)
_FIXED = {_BYTE: ">b", _SHORT: ">h", _INT: ">i", _LONG: ">q", _TIMESTAMP: ">q"}

CHUNK_HEADERS: Mapping[str, str] = {":event-type": "chunk", ":content-type": "application/json",
                                    ":message-type": "event"}
# The padding of a chunk :func:`from_text` writes: fixed, so the same text frames the same.
PADDING = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
# The exceptions of Bedrock's ``ResponseStream``: the SDK reads an exception frame of one of
# these types from its payload, any other from its ``:error-code``/``:error-message`` headers.
STREAM_EXCEPTIONS = frozenset({"internalServerException", "modelStreamErrorException",
                               "validationException", "throttlingException",
                               "modelTimeoutException", "serviceUnavailableException"})
_COMPACT = (",", ":")


class Frame(NamedTuple):
    """One frame: its headers by name, and its payload.

    A header's value is read as its type says: a bool; an int for a byte, short, integer,
    long or timestamp (milliseconds since the epoch); bytes for a byte array or a UUID (16
    bytes); a str for a string.
    """

    headers: dict[str, HeaderValue]
    payload: bytes


class _Located(NamedTuple):
    """A frame and where it lies in the body, with its headers as they were written."""

    frame: Frame
    start: int
    end: int
    raw_headers: bytes


# ----------------------------------------------------------------------- frames


def _crc(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _headers(raw: bytes) -> dict[str, HeaderValue] | None:
    """The headers a frame's header bytes hold; None when they are malformed (a name twice,
    an unknown type, a value running past the end), as botocore refuses them."""
    headers: dict[str, HeaderValue] = {}
    pos = 0
    try:
        while pos < len(raw):
            size = raw[pos]
            name = raw[pos + 1:pos + 1 + size].decode()
            kind, pos = raw[pos + 1 + size], pos + 2 + size
            value: HeaderValue
            if kind in (_BOOL_TRUE, _BOOL_FALSE):
                value = kind == _BOOL_TRUE
            elif kind in _FIXED:
                (value,) = struct.unpack_from(_FIXED[kind], raw, pos)
                pos += struct.calcsize(_FIXED[kind])
            elif kind == _UUID:
                value, pos = raw[pos:pos + 16], pos + 16
            elif kind in (_BYTES, _STRING):
                (length,) = struct.unpack_from(">H", raw, pos)
                value, pos = raw[pos + 2:pos + 2 + length], pos + 2 + length
                value = value.decode() if kind == _STRING else value
            else:
                return None
            if pos > len(raw) or len(name.encode()) != size or name in headers:
                return None
            headers[name] = value
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return headers


def _frames(body: bytes) -> Iterator[_Located]:
    """The whole, intact frames at the start of ``body``, in order."""
    pos = 0
    while len(body) - pos >= _PRELUDE:
        total, head_len, prelude_crc = struct.unpack_from(">III", body, pos)
        if prelude_crc != _crc(body[pos:pos + 8]) or head_len > _MAX_HEADERS \
                or total < _OVERHEAD + head_len or total - _OVERHEAD - head_len > _MAX_PAYLOAD \
                or len(body) - pos < total:
            return
        (message_crc,) = struct.unpack_from(">I", body, pos + total - 4)
        if message_crc != _crc(body[pos:pos + total - 4]):
            return
        raw_headers = body[pos + _PRELUDE:pos + _PRELUDE + head_len]
        headers = _headers(raw_headers)
        if headers is None:
            return
        frame = Frame(headers, body[pos + _PRELUDE + head_len:pos + total - 4])
        yield _Located(frame, pos, pos + total, raw_headers)
        pos += total


def decode(body: bytes) -> tuple[list[Frame], int]:
    """The whole frames of ``body`` and the offset where the rest, not decoded, starts.

    A stream cut short mid-frame leaves that frame to the rest; so does a frame whose CRC is
    wrong, whose lengths are impossible or whose headers are malformed (decoding ends there).
    Never raises.
    """
    body = bytes(body)
    located = list(_frames(body))
    return [f.frame for f in located], located[-1].end if located else 0


def _header(name: str, value: HeaderValue) -> bytes:
    """One header's bytes: a bool as its own type, an int as a 32-bit integer when it fits
    (else 64-bit), bytes as a byte array, a str as a string."""
    raw_name = name.encode()
    if len(raw_name) > 255:
        raise ValueError(f"event-stream header name {name!r}: at most 255 bytes of UTF-8")
    head = bytes([len(raw_name)]) + raw_name
    if isinstance(value, bool):
        return head + bytes([_BOOL_TRUE if value else _BOOL_FALSE])
    if isinstance(value, int):
        kind = _INT if -2**31 <= value < 2**31 else _LONG
        try:
            return head + bytes([kind]) + struct.pack(_FIXED[kind], value)
        except struct.error:
            raise ValueError(f"event-stream header {name!r}: {value} is past 64 bits") from None
    if isinstance(value, str | bytes):
        raw = value.encode() if isinstance(value, str) else value
        if len(raw) > 0xFFFF:
            raise ValueError(f"event-stream header {name!r}: a value of {len(raw)} bytes "
                             "(at most 65535)")
        kind = _STRING if isinstance(value, str) else _BYTES
        return head + bytes([kind]) + struct.pack(">H", len(raw)) + raw
    raise TypeError(f"event-stream header {name!r}: a str, bytes, int or bool, "
                    f"not {type(value).__name__}")


def _pack(raw_headers: bytes, payload: bytes) -> bytes:
    prelude = struct.pack(">II", _OVERHEAD + len(raw_headers) + len(payload), len(raw_headers))
    message = prelude + struct.pack(">I", _crc(prelude)) + raw_headers + payload
    return message + struct.pack(">I", _crc(message))


def encode(headers: Mapping[str, HeaderValue], payload: bytes) -> bytes:
    """One frame of ``headers`` (in their order) and ``payload``."""
    return _pack(b"".join(_header(name, value) for name, value in headers.items()), payload)


# ----------------------------------------------------------------------- events


def _json(raw: bytes | str) -> Any:
    """JSON as botocore reads a frame's payload: nothing is ``{}``, text that is not JSON is
    ``{"message": text}``; None when it is not even text."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        return None
    if not text:
        return {}
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return {"message": text}


def _text(value: Any) -> Any:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _chunk_event(frame: Frame) -> tuple[str, str] | None:
    """The event name and data the SDK makes of a chunk frame (None: it yields nothing)."""
    part = _json(frame.payload)
    encoded = part.get("bytes") if isinstance(part, dict) else None
    if not isinstance(encoded, str | bytes):
        return None
    try:
        data = base64.b64decode(encoded).decode()
    except (binascii.Error, ValueError):
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return "completion", data
    if not isinstance(doc, dict):
        return "completion", data
    kind = doc.get("type")
    if isinstance(kind, str):
        return kind, data
    return ("completion", data) if "completion" in doc else None


def _error_event(frame: Frame) -> tuple[str, str]:
    """The ``error`` event the SDK makes of an exception (or error) frame."""
    kind = frame.headers.get(":exception-type")
    code: Any = frame.headers.get(":error-code", "")
    message: Any = frame.headers.get(":error-message", "")
    if isinstance(kind, str) and kind in STREAM_EXCEPTIONS:
        body = _json(frame.payload)
        given = body.get("message") if isinstance(body, dict) else None
        code, message = kind, "" if given is None else given
    error = {"type": "error", "error": {"type": _text(code), "message": _text(message)}}
    return "error", json.dumps(error)


def _is_failure(frame: Frame) -> bool:
    return frame.headers.get(":message-type") in ("error", "exception")


def _event(frame: Frame) -> tuple[str, str] | None:
    """The event (name, data) the SDK yields for a frame; None when it yields none."""
    if _is_failure(frame):
        return _error_event(frame)
    if frame.headers.get(":event-type") != "chunk":
        return None
    return _chunk_event(frame)


def _render(name: str, data: str) -> str:
    lines = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"event: {name}\n{lines}\n"


def text_view(body: bytes) -> str:
    """The stream as the Server-Sent Events the SDK's Bedrock decoder yields from it: a chunk
    as ``event: <its type>`` with its JSON as it was sent, an exception as an ``error``
    event; frames the SDK yields nothing for are left out, as is an unfinished frame."""
    events = (_event(f.frame) for f in _frames(bytes(body)))
    return "".join(_render(*event) for event in events if event is not None)


def _events(text: str) -> Iterator[tuple[str, str]]:
    """(event, data) of each block of an event-stream text that has data, its ``data:``
    lines joined by newlines (one space after the colon taken off, as SSE says)."""
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        if data:
            yield name, "\n".join(data)


def _edited_error(frame: Frame, data: str) -> bytes | None:
    """An exception frame's payload with the message of the edited ``error`` event ``data``;
    None when its message is not its payload's (a type the stream does not name)."""
    try:
        payload = json.loads(frame.payload)
    except (ValueError, RecursionError):
        return None
    if frame.headers.get(":exception-type") not in STREAM_EXCEPTIONS \
            or not isinstance(payload, dict) or "message" not in payload:
        return None
    try:
        payload["message"] = json.loads(data)["error"]["message"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"an edited error event is not an error's JSON: {data!r}") from exc
    return json.dumps(payload, separators=_COMPACT, ensure_ascii=False).encode()


def _rewritten(at: _Located, shown: str, data: str) -> bytes:
    """A frame the SDK yields the event data ``shown`` for, with ``data`` instead: a chunk's
    bytes, an exception's message (when it is its payload's); unchanged, the frame as it was."""
    frame = at.frame
    if data == shown:
        return _pack(at.raw_headers, frame.payload)
    if _is_failure(frame):
        payload = _edited_error(frame, data)
        return _pack(at.raw_headers, frame.payload if payload is None else payload)
    part = json.loads(frame.payload)
    part["bytes"] = base64.b64encode(data.encode()).decode()
    return _pack(at.raw_headers, json.dumps(part, separators=_COMPACT).encode())


def restream(body: bytes, text: str) -> bytes:
    """``body`` with each chunk's event replaced by the data of the same event of ``text``
    (as :func:`text_view` renders it, maybe edited): headers, padding and frames the SDK
    yields nothing for are kept, CRCs recomputed; an error event's edited message goes back
    into its frame's payload. The unfinished rest of ``body`` is kept as it was.

    Raises ValueError when ``text`` has not one event for each event of ``body``.
    """
    body = bytes(body)
    located = [(f, _event(f.frame)) for f in _frames(body)]
    datas = [data for _, data in _events(text)]
    shown = sum(1 for _, event in located if event is not None)
    if shown != len(datas):
        raise ValueError(f"the text has {len(datas)} events, the stream {shown}: an edited "
                         "text keeps every event of the stream, in order")
    out: list[bytes] = []
    given = iter(datas)
    for at, event in located:
        out.append(body[at.start:at.end] if event is None
                   else _rewritten(at, event[1], next(given)))
    return b"".join(out) + body[located[-1][0].end if located else 0:]


def _exception(data: str) -> bytes:
    """The exception frame of an ``error`` event; a type Bedrock's stream does not name is
    carried in the headers the SDK reads it from."""
    doc = _json(data)
    error = doc.get("error") if isinstance(doc, dict) else None
    error = error if isinstance(error, dict) else {"message": data}
    kind = error.get("type")
    kind = kind if isinstance(kind, str) and kind else "internalServerException"
    message = error.get("message")
    message = message if isinstance(message, str) else "" if message is None else str(message)
    headers: dict[str, HeaderValue] = {":exception-type": kind,
                                       ":content-type": "application/json",
                                       ":message-type": "exception"}
    if kind not in STREAM_EXCEPTIONS:
        headers.update({":error-code": kind, ":error-message": message})
    return encode(headers, json.dumps({"message": message}, separators=_COMPACT,
                                      ensure_ascii=False).encode())


def from_text(text: str) -> bytes:
    """The frames that deliver the events of a Messages event-stream text: a chunk frame for
    each event (standard headers, fixed padding), an exception frame for an ``error`` event.
    The same text always gives the same bytes."""
    frames = []
    for name, data in _events(text):
        if name == "error":
            frames.append(_exception(data))
            continue
        part = {"bytes": base64.b64encode(data.encode()).decode(), "p": PADDING}
        frames.append(encode(CHUNK_HEADERS, json.dumps(part, separators=_COMPACT).encode()))
    return b"".join(frames)
