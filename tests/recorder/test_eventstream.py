"""AWS's binary event-stream framing (``recorder.providers._eventstream``), checked against
what reads it in the client: botocore's ``EventStreamBuffer`` and the anthropic SDK's Bedrock
decoder (``AWSEventStreamDecoder``).
"""

from __future__ import annotations

import base64
import json
import random
import struct
import zlib

import pytest
from anthropic.lib.bedrock._stream_decoder import AWSEventStreamDecoder
from botocore.eventstream import ChecksumMismatch, EventStreamBuffer

from recorder.providers._anthropic_sse import synthesize
from recorder.providers._eventstream import (
    CHUNK_HEADERS,
    PADDING,
    Frame,
    decode,
    encode,
    from_text,
    restream,
    text_view,
)

MESSAGE = {
    "id": "msg_bdrk_01", "type": "message", "role": "assistant",
    "model": "anthropic.claude-stub-v1:0",
    "content": [{"type": "thinking", "thinking": "Let me look.", "signature": "sig"},
                {"type": "text", "text": "Grüße, the key is sk-SECRET-123."},
                {"type": "tool_use", "id": "toolu_01", "name": "search", "input": {"q": "x"}}],
    "stop_reason": "tool_use", "stop_sequence": None,
    "usage": {"input_tokens": 12, "output_tokens": 7},
}
TEXT = synthesize(MESSAGE)
THROTTLED = ('event: error\ndata: {"type":"error","error":{"type":"throttlingException",'
             '"message":"Too many tokens, please wait before trying again."}}\n\n')


def botocore_frames(body: bytes) -> list:
    buffer = EventStreamBuffer()
    buffer.add_data(body)
    return list(buffer)


def sdk_events(body: bytes, piece: int = 7) -> list[tuple[str | None, str]]:
    """What the SDK's Bedrock decoder yields for ``body``, fed ``piece`` bytes at a time."""
    pieces = (body[i:i + piece] for i in range(0, len(body), piece))
    return [(sse.event, sse.data) for sse in AWSEventStreamDecoder().iter_bytes(pieces)]


def view_events(text: str) -> list[tuple[str, str]]:
    """(event, data) of each block of a text as text_view renders it."""
    out = []
    for block in text.split("\n\n")[:-1]:
        lines = block.split("\n")
        assert lines[0].startswith("event: ")
        out.append((lines[0][7:], "\n".join(line[6:] for line in lines[1:])))
    return out


def chunk(data: str, padding: str = "abc", **extra: str | int | bool | bytes) -> bytes:
    """A chunk frame as Bedrock sends one, with ``extra`` headers after the standard ones."""
    payload = json.dumps({"bytes": base64.b64encode(data.encode()).decode(), "p": padding},
                         separators=(",", ":")).encode()
    return encode({**CHUNK_HEADERS, **extra}, payload)


def exception(kind: str, message: str) -> bytes:
    return encode({":exception-type": kind, ":content-type": "application/json",
                   ":message-type": "exception"}, json.dumps({"message": message}).encode())


def bedrock_stream() -> bytes:
    """The message's events as Bedrock frames them: padding of varying length, and a
    frame the SDK yields nothing for (an event of another type) among them."""
    events = [data for _, data in view_events(text_view(from_text(TEXT)))]
    frames = [chunk(data, PADDING[: 5 + 7 * i % 50]) for i, data in enumerate(events)]
    frames.insert(2, encode({":event-type": "initial-response", ":message-type": "event"}, b"{}"))
    return b"".join(frames)


# ----------------------------------------------------------------------- frames


def frame_by_hand(headers: list[tuple[str, int, bytes]], payload: bytes) -> bytes:
    """A frame built from the spec alone: each header's name, type number and value bytes."""
    raw = b"".join(bytes([len(n.encode())]) + n.encode() + bytes([t]) + v for n, t, v in headers)
    prelude = struct.pack(">II", 16 + len(raw) + len(payload), len(raw))
    prelude += struct.pack(">I", zlib.crc32(prelude))
    body = prelude + raw + payload
    return body + struct.pack(">I", zlib.crc32(body))


EVERY_TYPE = [
    ("true", 0, b"", True),
    ("false", 1, b"", False),
    ("byte", 2, struct.pack(">b", -7), -7),
    ("short", 3, struct.pack(">h", -300), -300),
    ("integer", 4, struct.pack(">i", 70_000), 70_000),
    ("long", 5, struct.pack(">q", -(2**40)), -(2**40)),
    ("bytes", 6, struct.pack(">H", 3) + b"\x00\xff\x10", b"\x00\xff\x10"),
    ("string", 7, struct.pack(">H", 6) + "Grüß".encode(), "Grüß"),
    ("timestamp", 8, struct.pack(">q", 1_700_000_000_000), 1_700_000_000_000),
    ("uuid", 9, bytes(range(16)), bytes(range(16))),
]


def test_every_header_type_decodes_as_botocore_reads_it() -> None:
    body = frame_by_hand([(n, t, v) for n, t, v, _ in EVERY_TYPE], b"payload")
    frames, rest = decode(body)
    assert rest == len(body)
    assert frames == [Frame({n: value for n, _, _, value in EVERY_TYPE}, b"payload")]
    (theirs,) = botocore_frames(body)
    assert frames[0].headers == theirs.headers and frames[0].payload == theirs.payload


def test_encode_writes_frames_botocore_reads() -> None:
    headers = {":event-type": "chunk", "flag": True, "off": False, "small": -5,
               "big": 2**40, "raw": b"\x00\x01", "text": "Grüße"}
    body = encode(headers, b'{"x":1}') + encode({}, b"") + encode({"only": "headers"}, b"")
    ours, rest = decode(body)
    theirs = botocore_frames(body)
    assert rest == len(body)
    assert [(f.headers, f.payload) for f in ours] == [(t.headers, t.payload) for t in theirs]
    assert ours[0] == Frame(headers, b'{"x":1}')


def test_encode_refuses_what_a_frame_cannot_hold() -> None:
    with pytest.raises(ValueError, match="255 bytes"):
        encode({"n" * 256: "x"}, b"")
    with pytest.raises(ValueError, match="65535"):
        encode({"big": "x" * 70_000}, b"")
    with pytest.raises(ValueError, match="64 bits"):
        encode({"huge": 2**64}, b"")
    with pytest.raises(TypeError, match="float"):
        encode({"f": 1.5}, b"")  # type: ignore[dict-item]


@pytest.mark.parametrize("where", ["prelude crc", "headers", "payload", "message crc"])
def test_a_frame_with_a_wrong_crc_ends_decoding_there(where: str) -> None:
    first, second, third = chunk('{"type":"ping"}'), chunk('{"type":"a"}'), chunk('{}')
    offset = {"prelude crc": 9, "headers": 14, "payload": len(second) - 6,
              "message crc": len(second) - 1}[where]
    bad = bytearray(second)
    bad[offset] ^= 0x01
    body = first + bytes(bad) + third
    frames, rest = decode(body)
    assert len(frames) == 1 and rest == len(first)
    assert text_view(body) == text_view(first)
    buffer = EventStreamBuffer()
    buffer.add_data(body)
    next(buffer)
    with pytest.raises(ChecksumMismatch):  # botocore refuses it too
        next(buffer)


@pytest.mark.parametrize("lengths", [(15, 0), (16, 1), (100, 90), (2**31, 0), (64, 200_000)])
def test_a_frame_with_impossible_lengths_ends_decoding_there(lengths: tuple[int, int]) -> None:
    prelude = struct.pack(">II", *lengths)
    bad = prelude + struct.pack(">I", zlib.crc32(prelude)) + bytes(200)
    first = chunk('{"type":"ping"}')
    assert decode(first + bad) == ([decode(first)[0][0]], len(first))


def test_malformed_headers_end_decoding_there() -> None:
    unknown_type = frame_by_hand([("x", 12, b"")], b"")
    twice = frame_by_hand([("x", 7, b"\x00\x01a"), ("x", 7, b"\x00\x01b")], b"")
    past_the_end = frame_by_hand([("x", 4, b"\x00\x01")], b"")
    for bad in (unknown_type, twice, past_the_end):
        assert decode(chunk("{}") + bad)[1] == len(chunk("{}"))


def test_a_stream_cut_at_any_byte_gives_its_whole_frames() -> None:
    body = from_text(TEXT[:600]) + exception("throttlingException", "slow")
    whole, end = decode(body)
    assert end == len(body) and len(whole) >= 3
    ends = [0]
    for frame_ in whole:
        ends.append(ends[-1] + len(encode(frame_.headers, frame_.payload)))
    for cut in range(len(body) + 1):
        frames, rest = decode(body[:cut])
        count = sum(1 for e in ends[1:] if e <= cut)
        assert frames == whole[:count] and rest == ends[count], cut
        assert len(botocore_frames(body[:cut])) == count
        assert view_events(text_view(body[:cut])) == view_events(text_view(body))[:count]


def test_noise_never_raises() -> None:
    rng = random.Random(20240531)
    good = from_text(TEXT)
    for _ in range(400):
        size = rng.randint(0, 80)
        noise = bytes(rng.randrange(256) for _ in range(size))
        prelude = struct.pack(">II", rng.randint(0, 120), rng.randint(0, 120))
        crafted = prelude + struct.pack(">I", zlib.crc32(prelude)) + noise
        spliced = bytearray(good[:300])
        spliced[rng.randrange(300)] = rng.randrange(256)
        for body in (noise, crafted, good[:rng.randint(0, 200)] + noise, bytes(spliced)):
            frames, rest = decode(body)
            assert 0 <= rest <= len(body) and decode(body[:rest]) == (frames, rest)
            text_view(body)


# ----------------------------------------------------------------------- the SDK's events


def test_text_view_is_what_the_sdk_yields() -> None:
    body = bedrock_stream()
    assert view_events(text_view(body)) == sdk_events(body)
    assert view_events(text_view(body)) == [(e, d) for e, d in view_events(TEXT)]


def test_text_view_of_exceptions_is_the_sdks_error_event() -> None:
    body = b"".join([
        chunk('{"type":"message_start","message":{}}'),
        exception("throttlingException", "Too many tokens"),
        exception("modelStreamErrorException", ""),
        # a type the stream does not name: the SDK reads the error from the headers
        encode({":exception-type": "somethingElse", ":message-type": "exception",
                ":error-code": "Weird", ":error-message": "from headers"}, b'{"message":"no"}'),
        encode({":message-type": "error", ":error-code": "InternalFailure",
                ":error-message": "broke"}, b""),
    ])
    ours = view_events(text_view(body))
    assert ours == sdk_events(body)
    assert [json.loads(d)["error"] for _, d in ours[1:]] == [
        {"type": "throttlingException", "message": "Too many tokens"},
        {"type": "modelStreamErrorException", "message": ""},
        {"type": "Weird", "message": "from headers"},
        {"type": "InternalFailure", "message": "broke"}]


def test_text_view_leaves_out_what_the_sdk_skips() -> None:
    body = b"".join([
        chunk('{"no_type": 1}'),  # neither a Messages event nor a completion: skipped
        chunk('{"completion": "hi", "stop_reason": null}'),  # a legacy completion
        chunk('not json at all'),
        chunk('{"type":"ping"}', **{"extra": 5}),
        encode({":event-type": "chunk", ":message-type": "event"}, b'{"p":"pad only"}'),
        encode({":event-type": "other", ":message-type": "event"}, b'{"bytes":"e30="}'),
    ])
    ours = view_events(text_view(body))
    assert ours == sdk_events(body)
    assert [name for name, _ in ours] == ["completion", "completion", "ping"]


def test_pretty_printed_chunks_keep_their_lines() -> None:
    data = json.dumps({"type": "ping", "note": "a\nb"}, indent=2)
    body = chunk(data)
    assert sdk_events(body) == [("ping", data)]
    assert view_events(text_view(body)) == [("ping", data)]
    assert restream(body, text_view(body)) == body


# ----------------------------------------------------------------------- restream


def test_restream_unedited_gives_the_same_bytes() -> None:
    body = bedrock_stream() + exception("throttlingException", "slow")
    assert restream(body, text_view(body)) == body


def test_restream_writes_the_edit_back_keeping_padding_and_headers() -> None:
    events = [data for _, data in view_events(TEXT)]
    frames = [chunk(d, PADDING[: 3 + i], **{":date": 1_700_000_000_000 + i, "n": i})
              for i, d in enumerate(events)]
    frames.insert(1, encode({":event-type": "initial-response", ":message-type": "event"},
                            b'{"keep":"me"}'))
    body = b"".join(frames)
    edited = text_view(body).replace("sk-SECRET-123", "[REDACTED]")
    assert edited != text_view(body)
    out = restream(body, edited)
    assert text_view(out) == edited
    assert view_events(edited) == sdk_events(out)
    before, after = decode(body)[0], decode(out)[0]
    assert [f.headers for f in after] == [f.headers for f in before]
    assert after[1] == before[1]
    paddings = [json.loads(f.payload).get("p") for f in before]
    assert [json.loads(f.payload).get("p") for f in after] == paddings
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert len(changed) == 1 and b"sk-SECRET" not in out
    assert [(t.headers, t.payload) for t in botocore_frames(out)] == \
        [(f.headers, f.payload) for f in after]


def test_restream_carries_an_edited_error_message_and_keeps_the_rest() -> None:
    body = chunk('{"type":"ping"}') + exception("validationException", "bad key sk-SECRET-123")
    tail = chunk('{"type":"ping"}')[:20]
    edited = text_view(body).replace("sk-SECRET-123", "[REDACTED]")
    out = restream(body + tail, edited)
    assert out.endswith(tail) and b"sk-SECRET" not in out
    assert json.loads(decode(out)[0][1].payload) == {"message": "bad key [REDACTED]"}
    assert sdk_events(out) == view_events(edited)


def test_restream_refuses_a_text_of_other_events() -> None:
    body = bedrock_stream()
    text = text_view(body)
    with pytest.raises(ValueError, match="events"):
        restream(body, text + 'event: ping\ndata: {"type":"ping"}\n\n')
    with pytest.raises(ValueError, match="events"):
        restream(body, text.split("\n\n", 1)[1])


# ----------------------------------------------------------------------- from_text


def test_from_text_is_read_by_the_sdk_as_the_text() -> None:
    body = from_text(TEXT + THROTTLED)
    assert sdk_events(body) == [(e, d) if e != "error" else
                                (e, json.dumps(json.loads(d))) for e, d in
                                view_events(TEXT + THROTTLED)]
    frames = botocore_frames(body)
    assert all(f.headers == dict(CHUNK_HEADERS) for f in frames[:-1])
    assert {json.loads(f.payload)["p"] for f in frames[:-1]} == {PADDING}
    assert frames[-1].headers[":exception-type"] == "throttlingException"
    assert frames[-1].headers[":message-type"] == "exception"
    assert from_text(TEXT + THROTTLED) == body  # the same text, the same bytes


def test_from_text_keeps_an_error_type_bedrock_does_not_name() -> None:
    text = 'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",' \
           '"message":"Overloaded"}}\n\n'
    ((name, data),) = sdk_events(from_text(text))
    assert name == "error"
    assert json.loads(data)["error"] == {"type": "overloaded_error", "message": "Overloaded"}
    assert view_events(text_view(from_text(text))) == [(name, data)]


def test_from_text_then_text_view_gives_the_text_back() -> None:
    assert text_view(from_text(TEXT)) == TEXT
    crlf = TEXT.replace("\n", "\r\n")
    assert from_text(crlf) == from_text(TEXT)
