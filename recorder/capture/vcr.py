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

import base64
import contextlib
import contextvars
import functools
import http.client
import importlib
import io
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock
from urllib.parse import urlencode

import vcr.stubs as vcr_stubs

from recorder.canonical import content_coding, content_decoded, content_encoded
from recorder.capture import _httpx as _httpx_stub
from recorder.capture import _vcr_errors as _errors
from recorder.capture.exchange import HttpRequest, HttpResponse
from recorder.capture.session import Session, Timing
from recorder.errors import DejaError

_HTTPX_MODULES = ("httpx", "httpx2")



class _Call:
    """One exchange a vcrpy stub handles, while it handles it: which client's it is
    (``"urllib3"``, so requests' and botocore's; ``"aiohttp"``; ``"http.client"``), and
    the request whose start the bridge noted."""

    __slots__ = ("appended", "client", "decodes", "json", "request")

    def __init__(self, client: str, decodes: frozenset[str] = frozenset()) -> None:
        self.client = client
        # the content codings the client decodes itself: vcrpy takes a body so encoded
        # from it decoded, and hands it what it hands on to the program
        self.decodes = decodes
        self.json: Callable[[Any], str] | None = None  # an aiohttp json= body's encoder
        self.request: Any = None
        self.appended = False  # a response of it (or of a redirect it followed) logged


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("deja_vcr_call",
                                                                    default=None)


@functools.cache
def urllib3_decodes() -> frozenset[str]:
    """The content codings urllib3 decodes itself (br once brotli is installed, zstd once
    its zstd module is)."""
    from urllib3.response import BaseHTTPResponse

    return frozenset(BaseHTTPResponse.CONTENT_DECODERS) | {"gzip", "x-gzip", "deflate"}


@functools.cache
def aiohttp_decodes() -> frozenset[str]:
    """The content codings aiohttp decodes itself: not x-gzip, which it hands on as is."""
    from aiohttp import compression_utils

    return frozenset({"gzip", "deflate"}
                     | ({"br"} if getattr(compression_utils, "HAS_BROTLI", False) else set())
                     | ({"zstd"} if getattr(compression_utils, "HAS_ZSTD", False) else set()))


def _decodes(headers: list[tuple[str, str]]) -> bool:
    """The client of the exchange under way decodes a body with these headers itself."""
    call = _CALL.get()
    return call is not None and content_coding(headers) in call.decodes


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
    """A request body as vcrpy's stub holds it, as bytes: what the client sends, or for an
    aiohttp form, which aiohttp encodes only as it sends it, the same bytes every time
    for the same fields (its urlencoded text; one with files as JSON of its fields)."""
    if body is None:
        return b""
    if isinstance(body, str):
        return body.encode("utf-8")
    if isinstance(body, (bytes, bytearray, memoryview)):
        return bytes(body)
    if hasattr(body, "read"):
        return _vcr_body(_read_back(body))
    fields = _form_fields(body)
    if fields is not None:
        if all(isinstance(v, str) and not opts for _, v, opts in fields):
            return urlencode([(name, v) for name, v, _ in fields]).encode()
        return json.dumps([{"name": name, **opts, **_field_value(v)}
                           for name, v, opts in fields], sort_keys=True).encode()
    payload = getattr(body, "_value", None)  # an aiohttp payload (BytesPayload ...)
    if isinstance(payload, (str, bytes, bytearray)) or hasattr(payload, "read"):
        return _vcr_body(payload)
    if isinstance(body, (list, tuple)):  # chunks (vcrpy keeps an async generator's so)
        return b"".join(_vcr_body(chunk) for chunk in body)
    # no bytes to be had without using the body up: its type, which a replay gives again
    return f"<{type(body).__module__}.{type(body).__qualname__}>".encode()


def _read_back(stream: Any) -> Any:
    """What a file-like body holds, read and put back where it was (the client sends it
    after); one that cannot be put back is not read: its type stands for it."""
    try:
        at = stream.tell()
        data = stream.read()
        stream.seek(at)
    except (AttributeError, OSError, ValueError):
        return f"<{type(stream).__module__}.{type(stream).__qualname__}>"
    return data


def _form_fields(body: Any) -> list[tuple[str, Any, dict[str, str]]] | None:
    """The fields of a form (a mapping, a list of pairs, an aiohttp ``FormData``): name,
    value and options (filename, content type); None for any other body."""
    if isinstance(body, dict):
        return [(str(k), v, {}) for k, v in body.items()]
    if isinstance(body, (list, tuple)) and body and all(
            isinstance(f, tuple) and len(f) == 2 for f in body):
        return [(str(k), v, {}) for k, v in body]
    raw = getattr(body, "_fields", None)  # aiohttp.FormData: (options, headers, value)
    if type(body).__name__ == "FormData" and isinstance(raw, list):
        out = []
        for options, headers, value in raw:
            opts = {k: str(v) for k, v in dict(options).items() if k != "name"}
            kind = dict(headers).get("Content-Type") or dict(headers).get("content-type")
            if kind:
                opts["content_type"] = str(kind)
            out.append((str(dict(options).get("name")), value, opts))
        return out
    return None


def _field_value(value: Any) -> dict[str, str]:
    """A form field's value in a form's JSON: text, or base64 of its bytes (a file's,
    read and put back where it was)."""
    if hasattr(value, "read"):
        value = _read_back(value)
    if isinstance(value, (bytes, bytearray)):
        return {"base64": base64.b64encode(bytes(value)).decode("ascii")}
    return {"value": str(value)}


def _from_vcr_request(vcr_request: Any) -> HttpRequest:
    body = vcr_request.body
    call = _CALL.get()
    if call is not None and call.json is not None \
            and not isinstance(body, (str, bytes, bytearray)):
        body = call.json(body)  # aiohttp's json=: the text its encoder makes
    return HttpRequest(method=vcr_request.method, url=vcr_request.uri,
                       headers=_vcr_headers(vcr_request.headers), body=_vcr_body(body))


class _VcrBridge:
    """Looks like a vcrpy cassette to vcrpy's stubs; defers every decision to a session."""

    skip_patchers = _HTTPX_MODULES

    def __init__(self, session: Session) -> None:
        self._session = session
        self._path = str(session.path)
        # each exchange under way: when it started, and its request as first seen (an
        # aiohttp form's fields are gone once it is sent)
        self._starts: dict[int, tuple[float, float, HttpRequest | None]] = {}
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
                self._starts[id(vcr_request)] = (time.time(), time.perf_counter(), None)
        if first:
            call = _CALL.get()
            if call is not None:
                call.request = vcr_request  # a failure of it is logged (failed, below)
            request = _from_vcr_request(vcr_request)
            with self._lock:
                start, t0, _ = self._starts[id(vcr_request)]
                self._starts[id(vcr_request)] = (start, t0, request)
            try:
                served = self._session.begin_http(request)
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
            call = _CALL.get()
            raise _errors.replayed(served.extra["error"],
                                   call.client if call is not None else "http.client")
        headers: dict[str, list[str]] = {}
        for key, value in served.headers:
            headers.setdefault(key, []).append(value)
        body = content_decoded(served.body, served.headers) if _decodes(served.headers) \
            else served.body
        return {"status": {"code": served.status, "message": served.reason},
                "headers": headers, "body": {"string": body}}

    def append(self, vcr_request: Any, vcr_response: dict[str, Any]) -> None:
        with self._lock:
            start, t0, request = self._starts.pop(id(vcr_request),
                                                  (time.time(), time.perf_counter(), None))
        status = vcr_response.get("status", {})
        headers = _vcr_headers(vcr_response.get("headers"))
        body = _vcr_body((vcr_response.get("body") or {}).get("string"))
        response = HttpResponse(status=int(status.get("code", 0)),
                                reason=str(status.get("message") or ""), headers=headers,
                                body=content_encoded(body, headers, decoded=True)
                                if _decodes(headers) else body)
        call = _CALL.get()
        if call is not None:
            call.appended = True
        timing = Timing(start, (time.perf_counter() - t0) * 1000)
        self._session.end_http(request or _from_vcr_request(vcr_request), response, timing)

    def failed(self, call: _Call, error: Exception) -> None:
        """The exchange of ``call`` failed before a response (the connection was refused,
        it timed out, the client refused what came back): logged as failed, as the httpx
        stub logs one, so that a replay raises it where the program met it."""
        vcr_request = call.request
        if vcr_request is None:
            return
        with self._lock:
            started = self._starts.pop(id(vcr_request), None)
            served = self._served.pop(id(vcr_request), None)
        if started is None or served is not None or call.appended \
                or isinstance(error, DejaError):
            return  # logged already (or a response it was redirected to), answered by the
            # session, or deja's own refusal
        start, t0, request = started
        self._session.end_http(request or _from_vcr_request(vcr_request), None,
                               Timing(start, (time.perf_counter() - t0) * 1000), error)

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


def _framed(body: Any) -> bool:
    """A body already in chunked framing (the last chunk, empty, ends it)."""
    return isinstance(body, (bytes, bytearray)) and bytes(body).endswith(b"0\r\n\r\n") \
        and bytes(body[:1]).isalnum()


def _of_urllib3(stub: type) -> bool:
    """A vcrpy connection stub standing in for a connection of urllib3's (requests',
    botocore's), which vcrpy records through urllib3's decoding ``data``."""
    return any(c.__module__.partition(".")[0] == "urllib3" for c in stub.__mro__)


@contextlib.contextmanager
def _noted(bridge: _VcrBridge, call: _Call) -> Iterator[None]:
    """``call`` is the exchange under way while the block runs; if it fails, it is
    logged as failed."""
    token = _CALL.set(call)
    try:
        yield
    except Exception as exc:
        bridge.failed(call, exc)
        raise
    finally:
        _CALL.reset(token)


def _call_patches(bridge: _VcrBridge) -> Iterator[Any]:
    """Patches around each exchange a vcrpy stub handles (:class:`_Call`): the bridge
    learns which client it is for (a body is stored as the wire had it, compressed as its
    ``content-encoding`` says, whichever client recorded it, so that any client replays
    it: httpx and the proxy hand the bytes on; urllib3 and aiohttp, under vcrpy, hand
    their program what they are given), and an exchange that fails is logged."""
    getresponse = vcr_stubs.VCRConnection.getresponse

    def getresponse_noted(self: Any, *args: Any, **kwargs: Any) -> Any:
        vcr_request = getattr(self, "_vcr_request", None)
        headers = getattr(vcr_request, "headers", None)
        if headers is not None and "chunked" in str(headers.get("Transfer-Encoding", "")) \
                and not _framed(getattr(vcr_request, "body", None)):
            # vcrpy sends the body it joined in one piece, not in chunks: without the
            # header, http.client gives it its length (with it, the server read it as
            # chunks and waited, or refused it). A body the program framed in chunks
            # itself keeps it.
            del headers["Transfer-Encoding"]
        if _of_urllib3(type(self)):  # vcrpy records urllib3's decoded ``data``
            call = _Call("urllib3", urllib3_decodes())
        else:
            call = _Call("http.client")
        with _noted(bridge, call):
            return getresponse(self, *args, **kwargs)

    yield mock.patch.object(vcr_stubs.VCRConnection, "getresponse", getresponse_noted)
    client = sys.modules.get("aiohttp.client")
    if client is None:
        return  # vcrpy patches aiohttp only once it is imported
    request = client.ClientSession._request  # vcrpy's, its patchers are in place

    async def request_noted(self: Any, *args: Any, **kwargs: Any) -> Any:
        decodes = kwargs.get("auto_decompress")  # the request's, else its session's
        if decodes is None:
            decodes = getattr(self, "_auto_decompress", True)
        call = _Call("aiohttp", aiohttp_decodes() if decodes else frozenset())
        if kwargs.get("json") is not None and kwargs.get("data") is None:
            call.json = getattr(self, "_json_serialize", json.dumps)  # what aiohttp sends
        with _noted(bridge, call):
            return await request(self, *args, **kwargs)

    yield mock.patch.object(client.ClientSession, "_request", request_noted)
    stubs = sys.modules.get("vcr.stubs.aiohttp_stubs")
    if stubs is not None:  # vcrpy's response reads text as UTF-8, json whatever its type
        yield mock.patch.object(stubs.MockClientResponse, "text", client.ClientResponse.text)
        yield mock.patch.object(stubs.MockClientResponse, "json", client.ClientResponse.json)
        yield mock.patch.object(stubs, "play_responses", _play_responses)


def _play_responses(cassette: Any, vcr_request: Any, kwargs: dict[str, Any]) -> Any:
    """vcrpy's replayed aiohttp response, following recorded redirects as aiohttp follows
    them live: each with the method aiohttp sends (vcrpy asks for every one with GET, and a
    POST redirected by a 307 or 308, or a PUT by a 302, was not found)."""
    from vcr.request import Request
    from vcr.stubs import aiohttp_stubs as stubs
    from yarl import URL

    history: list[Any] = []
    response = stubs.build_response(vcr_request, cassette.play_response(vcr_request), history)
    method = vcr_request.method
    while kwargs.get("allow_redirects", True) and 300 <= response.status <= 399 \
            and "location" in response.headers:
        method = redirected_method(response.status, method)
        target = URL(str(response.url)).join(URL(response.headers["location"]))
        vcr_request = Request(method, str(target), None,
                              stubs._serialize_headers(response.request_info.headers))
        history.append(response)
        response = stubs.build_response(vcr_request, cassette.play_response(vcr_request),
                                        history)
    return response


def redirected_method(status: int, method: str) -> str:
    """The method aiohttp follows a redirect with: GET after a 303 (but for HEAD), and
    after a 301 or 302 of a POST; the same method otherwise (307, 308)."""
    if (status == 303 and method != "HEAD") or (status in (301, 302) and method == "POST"):
        return "GET"
    return method


def _stream(self: Any, amt: int = 65536, decode_content: Any = None) -> Iterator[bytes]:
    """vcrpy's stub response's ``stream``, without the empty chunk it yields last (which
    requests hands a program's ``iter_content`` as one chunk more than it had live)."""
    while True:
        chunk = self.read(amt)
        if not chunk:
            return
        yield chunk


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
        for patcher in _call_patches(bridge):
            stack.enter_context(patcher)
        stack.enter_context(mock.patch.object(vcr_stubs.VCRHTTPResponse, "stream", _stream))
        yield bridge

