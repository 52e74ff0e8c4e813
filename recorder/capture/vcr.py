"""HTTP capture: vcrpy's patchers, driven by a deja session instead of a vcrpy cassette.

vcrpy knows how to intercept requests, urllib3, http.client, aiohttp, boto3 and tornado.
deja hands it a small object that answers the questions vcrpy's stubs ask of a cassette
(``can_play_response_for``, ``play_response``, ``append`` ...) by asking the active
session. The httpx and httpx2 transports are left out of vcrpy's set (``skip_patchers``)
and patched with deja's streaming stub instead (``custom_patches``), so that recording
never buffers a stream.

:func:`install` is the whole interface: it returns a context manager that holds the
patches for as long as the session is active.
"""

from __future__ import annotations

import contextlib
import contextvars
import http.client
import importlib
import io
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import vcr.stubs as vcr_stubs

from recorder.canonical import content_decoded, content_encoded
from recorder.capture import _httpx as _httpx_stub
from recorder.capture.exchange import HttpRequest, HttpResponse
from recorder.capture.session import Session, Timing
from recorder.errors import DejaError

_HTTPX_MODULES = ("httpx", "httpx2")

# Set while a stub of a client that decodes a response body itself (urllib3, so requests
# and botocore; aiohttp) records or serves an exchange: the body vcrpy takes from it is
# decoded, and the one it hands it must be.
_DECODES: contextvars.ContextVar[bool] = contextvars.ContextVar("deja_vcr_decodes",
                                                                default=False)


def _vcr_headers(headers: Any) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for key, value in dict(headers or {}).items():
        values = value if isinstance(value, (list, tuple)) else [value]
        out.extend((_text(key), _text(v)) for v in values)
    return out


def _text(value: Any) -> str:
    """A header as a cassette holds it: bytes read as Latin-1, as http.client reads them;
    a text aiohttp read with the bytes that are not UTF-8 escaped (lone surrogates, which
    no cassette line can hold) read as Latin-1 too."""
    if isinstance(value, bytes):
        return value.decode("latin-1")
    text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")  # the bytes aiohttp read
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "surrogatepass")
        return raw.decode("latin-1")
    return text


def _parse_headers(header_list: dict[str, list[str]]) -> Any:
    """vcrpy's stub response headers, as http.client reads a response's: vcrpy writes them
    out as UTF-8 for http.client to read back as Latin-1, which turns every character
    that is not ASCII into two or three. Written as Latin-1 they read back as they were
    (a character Latin-1 has not, which http.client never reads, as UTF-8)."""
    lines = []
    for key, values in header_list.items():
        for value in values:
            line = f"{key}:{value}\r\n"
            try:
                lines.append(line.encode("latin-1"))
            except UnicodeEncodeError:
                lines.append(line.encode("utf-8", "surrogatepass"))
    return http.client.parse_headers(io.BytesIO(b"".join(lines)))


def _vcr_body(body: Any) -> bytes:
    if body is None:
        return b""
    if isinstance(body, str):
        return body.encode("utf-8")
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    return bytes(body.read()) if hasattr(body, "read") else b"".join(body)


def _from_vcr_request(vcr_request: Any) -> HttpRequest:
    return HttpRequest(method=vcr_request.method, url=vcr_request.uri,
                       headers=_vcr_headers(vcr_request.headers),
                       body=_vcr_body(vcr_request.body))


class _VcrBridge:
    """Looks like a vcrpy cassette to vcrpy's stubs; defers every decision to a session."""

    skip_patchers = _HTTPX_MODULES

    def __init__(self, session: Session) -> None:
        self._session = session
        self._path = str(session.path)
        self._starts: dict[int, tuple[float, float]] = {}
        self._served: dict[int, HttpResponse] = {}  # answered by the session (fork, resume)
        self._lock = threading.Lock()
        self.custom_patches = tuple(_httpx_patches(session))

    @property
    def write_protected(self) -> bool:
        return self._session.mode == "replay"

    def filter_request(self, request: Any) -> Any:
        return request

    def can_play_response_for(self, vcr_request: Any) -> bool:
        if self._session.mode == "replay":
            return True
        with self._lock:
            first = id(vcr_request) not in self._starts
            if first:
                self._starts[id(vcr_request)] = (time.time(), time.perf_counter())
        if first:
            try:
                served = self._session.begin_http(_from_vcr_request(vcr_request))
            except DejaError:
                with self._lock:
                    self._starts.pop(id(vcr_request), None)
                raise
            if served is not None:
                with self._lock:
                    self._served[id(vcr_request)] = served
        with self._lock:
            return id(vcr_request) in self._served

    def play_response(self, vcr_request: Any) -> dict[str, Any]:
        with self._lock:
            served = self._served.pop(id(vcr_request), None)
            self._starts.pop(id(vcr_request), None)
        if served is None:
            served = self._session.begin_http(_from_vcr_request(vcr_request))
        if served is None:  # pragma: no cover - replay sessions always serve or raise
            raise DejaError("the session declined to serve a replayed request")
        if served.extra.get("error") and not served.extra.get("has_response"):
            raise ConnectionError(served.extra["error"].get("message") or "recorded error")
        headers: dict[str, list[str]] = {}
        for key, value in served.headers:
            headers.setdefault(key, []).append(value)
        body = content_decoded(served.body, served.headers) if _DECODES.get() else served.body
        return {"status": {"code": served.status, "message": served.reason},
                "headers": headers, "body": {"string": body}}

    def append(self, vcr_request: Any, vcr_response: dict[str, Any]) -> None:
        with self._lock:
            start, t0 = self._starts.pop(id(vcr_request), (time.time(), time.perf_counter()))
        status = vcr_response.get("status", {})
        headers = _vcr_headers(vcr_response.get("headers"))
        body = _vcr_body((vcr_response.get("body") or {}).get("string"))
        response = HttpResponse(status=int(status.get("code", 0)),
                                reason=str(status.get("message") or ""), headers=headers,
                                body=content_encoded(body, headers) if _DECODES.get() else body)
        timing = Timing(start, (time.perf_counter() - t0) * 1000)
        self._session.end_http(_from_vcr_request(vcr_request), response, timing)

    def find_requests_with_most_matches(self, request: Any) -> list[Any]:
        return []


def _httpx_patches(session: Session) -> list[tuple[Any, str, Any]]:
    patches = []
    for name in _HTTPX_MODULES:
        try:
            httpx = importlib.import_module(name)
        except ImportError:
            continue
        sync_real = httpx.HTTPTransport.handle_request
        async_real = httpx.AsyncHTTPTransport.handle_async_request
        patches.append((httpx.HTTPTransport, "handle_request",
                        _httpx_stub.sync_handler(session, httpx, sync_real)))
        patches.append((httpx.AsyncHTTPTransport, "handle_async_request",
                        _httpx_stub.async_handler(session, httpx, async_real)))
    return patches


def _of_urllib3(stub: type) -> bool:
    """A vcrpy connection stub standing in for a connection of urllib3's (requests',
    botocore's), which vcrpy records through urllib3's decoding ``data``."""
    return any(c.__module__.partition(".")[0] == "urllib3" for c in stub.__mro__)


def _decoding_patches() -> Iterator[Any]:
    """Patches that tell the bridge when the client whose exchange a stub handles decodes
    bodies itself (:data:`_DECODES`): a connection of urllib3's, and aiohttp. A body is
    stored as the wire had it, compressed as its ``content-encoding`` says, whichever
    client recorded it, so that any client replays it (httpx and the proxy hand the
    bytes on; urllib3 and aiohttp, under vcrpy, hand their program what they are given)."""
    getresponse = vcr_stubs.VCRConnection.getresponse

    def decoding_getresponse(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _DECODES.set(_of_urllib3(type(self)))
        try:
            return getresponse(self, *args, **kwargs)
        finally:
            _DECODES.reset(token)

    yield mock.patch.object(vcr_stubs.VCRConnection, "getresponse", decoding_getresponse)
    if "aiohttp" not in sys.modules:
        return  # vcrpy patches aiohttp only once it is imported
    from vcr.stubs import aiohttp_stubs

    play, record = aiohttp_stubs.play_responses, aiohttp_stubs.record_response

    def decoding_play(*args: Any, **kwargs: Any) -> Any:
        token = _DECODES.set(True)
        try:
            return play(*args, **kwargs)
        finally:
            _DECODES.reset(token)

    async def decoding_record(*args: Any, **kwargs: Any) -> Any:
        token = _DECODES.set(True)
        try:
            return await record(*args, **kwargs)
        finally:
            _DECODES.reset(token)

    yield mock.patch.object(aiohttp_stubs, "play_responses", decoding_play)
    yield mock.patch.object(aiohttp_stubs, "record_response", decoding_record)


@contextlib.contextmanager
def install(session: Session):
    """Patch every supported HTTP client to go through ``session`` while the block runs."""
    from vcr.patch import CassettePatcherBuilder

    bridge = _VcrBridge(session)
    with contextlib.ExitStack() as stack:
        for patcher in CassettePatcherBuilder(bridge).build():
            stack.enter_context(patcher)
        if callable(getattr(vcr_stubs, "parse_headers", None)):
            stack.enter_context(mock.patch.object(vcr_stubs, "parse_headers", _parse_headers))
        for patcher in _decoding_patches():
            stack.enter_context(patcher)
        yield bridge

