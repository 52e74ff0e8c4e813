"""How much of an upstream's response the proxy takes, and which work leaves the event loop.

A response is bounded by ``--max-response`` bytes (default 64 MiB), counted two ways as it
arrives: the bytes received, and, for a gzip, deflate, br or zstd body, the bytes it inflates to
(what deja reads to log the call: its usage, its stop reason, the secrets it redacts). A
2 MB body can inflate to 2 GiB, so the inflated size is counted in steps of
:data:`STEP` bytes that are dropped once counted (:class:`Inflation`), and counting stops
at the limit: memory stays at one step, work at the limit's worth.

Past the limit the response is refused with :class:`recorder.errors.ResponseTooLarge`:
a whole (JSON) response, which the proxy holds until its last byte, is answered with a
502 instead; a stream (SSE), already under way, is cut there and ended with an ``error``
event (:func:`cut_tail`, which both the Anthropic and the OpenAI SDKs raise as an API
error; a compressed stream, into which no event can be put, just ends). Either way the
call's line names the error, and a cut stream's line holds what was passed on, no more.

Work that grows with a body (inflating it, parsing a large request, redacting and
signing a large line) runs in a worker thread once the body is over
:data:`OFFLOAD_BYTES`, so that the other clients' calls go on meanwhile; smaller bodies
stay on the loop, where a thread would cost more than the work.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from recorder.canonical import CODINGS, ZSTD_WINDOW
from recorder.capture.session import Timing
from recorder.errors import ResponseTooLarge

__all__ = ["BODY_TIMEOUT", "MAX_RESPONSE", "OFFLOAD_BYTES", "STEP", "Inflation", "Passing",
           "coding_of", "cut_tail", "decoded_within", "event_end", "is_stream", "off_loop",
           "said", "too_large"]

T = TypeVar("T")

MAX_RESPONSE = 64 * 1024 * 1024  # bytes of a response, as received and as inflated
BODY_TIMEOUT = 60.0  # seconds a request body may stall between two of its pieces
OFFLOAD_BYTES = 256 * 1024  # bodies above this are worked on in a thread
STEP = 1024 * 1024  # inflated bytes produced (and dropped) at a time
INLINE_INFLATE = 16 * 1024  # compressed bytes inflated on the loop (at most ~16 MiB out)

INFLATED = CODINGS  # what deja inflates to read: gzip, deflate, br and zstd
ZSTD_SLICE = 256  # compressed bytes of a zstd body fed at a time (a zstd decoder has no
# output bound: 256 bytes of RLE blocks inflate to about 10 MiB at most)


def coding_of(headers: Sequence[tuple[str, str]]) -> str:
    """A response's ``content-encoding``, lower-cased ("" for none)."""
    return next((v for k, v in headers if k.lower() == "content-encoding"), "").strip().lower()


def is_stream(headers: Sequence[tuple[str, str]]) -> bool:
    """Is a response with these headers a stream of server-sent events?"""
    return any(k.lower() == "content-type" and "event-stream" in v.lower() for k, v in headers)


class Inflation:
    """The inflated size of a compressed body (gzip, deflate, br or zstd), counted as its
    bytes arrive, up to ``limit``; with ``keep``, the inflated bytes too (for a body known
    to be within it).

    It reads a body as :func:`recorder.canonical.content_decoded` does (gzip; deflate as
    zlib data, else raw deflate; the first gzip member only; every zstd frame): a body
    that is not valid compressed data inflates to nothing more, and is read as it is."""

    def __init__(self, coding: str, limit: int, *, keep: bool = False) -> None:
        self.coding, self.limit, self.keep = coding, limit, keep
        self.size = 0  # inflated bytes so far
        self.over = False  # the body inflates past the limit
        self.broken = False  # not valid compressed data (deja reads it as it is)
        self.ended = False  # the compressed data ended
        self.parts: list[bytes] = []
        self._wbits = 16 + zlib.MAX_WBITS if coding != "deflate" else zlib.MAX_WBITS
        self._inflater: Any = zlib.decompressobj(self._wbits) if coding in ZLIB else \
            _Brotli() if coding == "br" else _Zstd()
        self._fed = False

    @classmethod
    def of(cls, headers: Sequence[tuple[str, str]], limit: int, *, keep: bool = False
           ) -> Inflation | None:
        """The counter for a response with these headers; None: deja does not inflate it."""
        coding = coding_of(headers)
        return cls(coding, limit, keep=keep) if coding in INFLATED else None

    def feed(self, data: bytes) -> bool:
        """Count ``data``'s inflated bytes; True once the body is over the limit."""
        if self.over or self.broken or self.ended or not data:
            return self.over
        if self.coding not in ZLIB:
            try:
                self._count(self._inflater.pieces(data))
                self.ended = self._inflater.ended()
            except self._inflater.error:
                self.broken = True
            self._fed = True
            return self.over
        try:
            self._inflate(data)
        except zlib.error:
            if self._fed or self._wbits != zlib.MAX_WBITS:
                self.broken = True
                return False
            self._wbits = -zlib.MAX_WBITS  # raw deflate, as some servers send it
            self._inflater = zlib.decompressobj(self._wbits)
            self.size, self.parts = 0, []
            try:
                self._inflate(data)
            except zlib.error:
                self.broken = True
        self._fed = True
        return self.over

    def _count(self, pieces: Iterable[bytes]) -> None:
        for out in pieces:
            self.size += len(out)
            if self.size > self.limit:
                self.over, self.parts = True, []
                return
            if self.keep and out:
                self.parts.append(out)

    def _inflate(self, data: bytes) -> None:
        self._count(self._zlib_pieces(data))

    def _zlib_pieces(self, data: bytes) -> Iterator[bytes]:
        """``data`` inflated by zlib :data:`STEP` bytes at a time (``ended`` at its end)."""
        inflater = self._inflater
        pending = data
        while True:
            out = inflater.decompress(pending, STEP)
            yield out
            if inflater.eof:
                self.ended = True
                return
            pending = inflater.unconsumed_tail
            if not pending and len(out) < STEP:
                return

    def body(self, raw: bytes) -> bytes:
        """The body as deja reads it (``keep``): inflated when it was whole, valid data
        (a zstd body: valid data, every frame of it)."""
        whole = self.ended or (self.coding == "zstd" and self._fed)
        return b"".join(self.parts) if whole and not self.broken else raw


ZLIB = ("gzip", "x-gzip", "deflate")


class _Brotli:
    """A br body inflated :data:`STEP` bytes at a time (brotli's own output bound)."""

    def __init__(self) -> None:
        import brotli

        self._d, self.error = brotli.Decompressor(), brotli.error

    def pieces(self, data: bytes) -> Iterator[bytes]:
        yield self._d.process(data, output_buffer_limit=STEP)
        while not self._d.can_accept_more_data():
            yield self._d.process(b"", output_buffer_limit=STEP)

    def ended(self) -> bool:
        return bool(self._d.is_finished())


class _Zstd:
    """A zstd body inflated :data:`ZSTD_SLICE` compressed bytes at a time, every frame."""

    def __init__(self) -> None:
        import zstandard

        self._d = zstandard.ZstdDecompressor(max_window_size=ZSTD_WINDOW).decompressobj(
            read_across_frames=True)
        self.error = zstandard.ZstdError

    def pieces(self, data: bytes) -> Iterator[bytes]:
        for at in range(0, len(data), ZSTD_SLICE):
            yield self._d.decompress(data[at:at + ZSTD_SLICE])

    def ended(self) -> bool:
        return False  # frames may follow: the body is whole when its bytes are


def decoded_within(body: bytes, headers: Sequence[tuple[str, str]], limit: int) -> bytes:
    """:func:`recorder.canonical.content_decoded` of ``body``, refused with
    :class:`ResponseTooLarge` when it inflates past ``limit`` bytes (a cassette is untrusted
    input too: a replayed body is read within the same bound)."""
    inflation = Inflation.of(headers, limit, keep=True)
    if inflation is None:
        return body
    if inflation.feed(body):
        raise too_large(limit, inflated=inflation.coding)
    return inflation.body(body)


def too_large(limit: int, *, inflated: str | None = None, where: str = "",
              cut_at: int | None = None) -> ResponseTooLarge:
    """The error of a response over ``limit``: ``inflated`` names the coding of a body that
    inflates past it, ``cut_at`` the bytes of a stream that were passed on."""
    how = f" once inflated ({inflated})" if inflated else ""
    what = f"the upstream's response{f' to {where}' if where else ''}"
    done = (f"the stream was cut after {cut_at} bytes" if cut_at is not None
            else "it was not passed on")
    return ResponseTooLarge(
        f"{what} is over the proxy's limit of {limit} bytes{how}; {done}. If such a "
        "response is expected, raise the limit: deja proxy --max-response BYTES",
        limit=limit)


def said(error: ResponseTooLarge) -> str:
    """``error`` as the client is told it."""
    return f"deja proxy: {type(error).__name__}: {error}"


HOLD_AT_MOST = 64 * 1024  # bytes of an unfinished event held back, at most


def event_end(data: bytes) -> int:
    """Where the last complete server-sent event of ``data`` ends (0: none does): a stream
    is passed on up to there, so that a cut leaves no half event before its error event
    (a client acts on an event only at its end, so holding the rest back costs nothing);
    more than :data:`HOLD_AT_MOST` bytes without an end are passed on as they are."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
    return end if len(data) - end <= HOLD_AT_MOST else len(data)


def cut_tail(headers: Sequence[tuple[str, str]], message: str) -> bytes:
    """What ends a stream the proxy cut: an ``error`` event in the Anthropic shape, which
    the Anthropic and OpenAI SDKs both raise as an API error; nothing for a compressed
    stream (an event cannot be put into it)."""
    if coding_of(headers) not in ("", "identity"):
        return b""
    data = json.dumps({"type": "error", "error": {"type": "api_error", "message": message}},
                      ensure_ascii=False, separators=(",", ":"))
    return f"\n\nevent: error\ndata: {data}\n\n".encode()


class Passing:
    """One upstream response on its way to the client, within ``limit`` bytes.

    :meth:`take` is given each chunk as it arrives and returns what to pass on now: for a
    stream, its complete events (:func:`event_end`); for a whole body, nothing (it is
    passed on by :meth:`body` once complete). Past the limit, :attr:`refused` holds the
    error (what :meth:`take` returned last is still passed on) and nothing more is
    taken."""

    def __init__(self, headers: Sequence[tuple[str, str]], limit: int, where: str) -> None:
        self.headers, self.limit, self.where = headers, limit, where
        self.stream = is_stream(headers)
        self.plain = coding_of(headers) in ("", "identity")
        self.inflation = Inflation.of(headers, limit)
        self.chunks: list[bytes] = []
        self.size = 0  # bytes taken
        self.sent = 0  # bytes of a stream passed on
        self.held = b""  # the unfinished event at a stream's end
        self.first: float | None = None  # when the first byte came (perf_counter)
        self.refused: ResponseTooLarge | None = None

    async def take(self, chunk: bytes) -> bytes:
        if self.first is None:
            self.first = time.perf_counter()
        room = self.limit - self.size
        if len(chunk) > room:
            # a plain stream passes on its complete events up to the limit, then is cut
            out = await self.take(chunk[:room]) if self.stream and self.plain and room else b""
            self._refuse(None)
            return out
        if self.inflation is not None:
            over = self.inflation.feed(chunk) if len(chunk) <= INLINE_INFLATE \
                else await asyncio.to_thread(self.inflation.feed, chunk)
            if over:
                self._refuse(self.inflation.coding)
                return b""
        self.size += len(chunk)
        self.chunks.append(chunk)
        if not self.stream:
            return b""
        if not self.plain:
            self.sent += len(chunk)
            return chunk
        data = self.held + chunk if self.held else chunk
        end = event_end(data)
        self.held = data[end:]
        self.sent += end
        return data[:end] if end < len(data) else data

    def _refuse(self, inflated: str | None) -> None:
        self.refused = too_large(self.limit, inflated=inflated, where=self.where,
                                 cut_at=self.sent if self.stream else None)

    def body(self) -> bytes:
        """A whole body, complete."""
        return b"".join(self.chunks)

    def tail(self) -> bytes:
        """What ends a stream: its held-back rest, or the error event of a cut one."""
        if self.refused is not None:
            return cut_tail(self.headers, said(self.refused))
        return self.held

    def recorded(self) -> bytes:
        """The body the log keeps: what came, or, of a stream that was cut, what was
        passed on (the error event aside: a replay adds it again)."""
        data = b"".join(self.chunks)
        if self.refused is not None and self.stream:
            return data[:self.sent]
        return data

    def timing(self, start: float, t0: float) -> Timing:
        now = time.perf_counter()
        return Timing(start, (now - t0) * 1000,
                      (self.first - t0) * 1000 if self.first is not None else None)


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a worker thread when it works on more than
    :data:`OFFLOAD_BYTES` (the other clients are served meanwhile)."""
    if size > OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
