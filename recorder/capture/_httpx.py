"""deja's own stub for the httpx and httpx2 transports (the anthropic SDK 2.x uses httpx2).

vcrpy's httpx stub reads a whole response before handing it over, which delays the first
SSE event until the stream has ended. This stub hands the response over at once and tees
its stream: each chunk goes to the caller as it arrives and into a buffer; when the
stream ends (or fails, or the caller closes it) the exchange is logged as one line.
On replay it serves the recorded bytes without touching the network.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from recorder.capture.exchange import HttpRequest, HttpResponse, header_bytes
from recorder.capture.session import Session, Timing, stopping
from recorder.errors import DejaError, sdk_passthrough

_CLASSES: dict[tuple[str, str], type] = {}


class _Headers(Sequence[tuple[str, str]]):
    """An httpx request's headers as ``(name, value)`` pairs, decoded when first read: a
    replay that knows a request by its bytes never reads them."""

    __slots__ = ("_pairs", "_real")

    def __init__(self, real: Any) -> None:
        self._real = real
        self._pairs: list[tuple[str, str]] | None = None

    def _list(self) -> list[tuple[str, str]]:
        if self._pairs is None:
            self._pairs = self._real.multi_items()  # a new list each call
        return self._pairs

    def __getitem__(self, index: Any) -> Any:
        return self._list()[index]

    def __len__(self) -> int:
        return len(self._list())

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._list())


def _request(real: Any, body: bytes) -> HttpRequest:
    return HttpRequest(method=real.method, url=str(real.url), headers=_Headers(real.headers),
                       body=body)


def _response_meta(real: Any) -> HttpResponse:
    return HttpResponse(status=real.status_code, headers=list(real.headers.multi_items()),
                        body=b"", reason=real.reason_phrase)


def _served(httpx: ModuleType, request: Any, served: HttpResponse) -> Any:
    error = served.extra.get("error")
    if error and not served.extra.get("has_response"):
        raise _transport_error(httpx, error, request)
    stream = _replay_stream_class(httpx)(served.body, error, request)
    extensions = {"reason_phrase": served.reason.encode("ascii", "replace"),
                  "http_version": b"HTTP/1.1"}
    try:
        return httpx.Response(served.status, headers=served.headers, stream=stream,
                              extensions=extensions)
    except UnicodeEncodeError:  # httpx takes a header given as text to be ASCII
        return httpx.Response(served.status, headers=header_bytes(served.headers),
                              stream=stream, extensions=extensions)


def _transport_error(httpx: ModuleType, error: dict[str, Any], request: Any) -> Exception:
    cls = getattr(httpx, str(error.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, httpx.TransportError)):
        cls = httpx.RemoteProtocolError
    return cls(error.get("message") or "recorded transport error", request=request)


def _replay_stream_class(httpx: ModuleType) -> type:
    key = (httpx.__name__, "replay")
    if key not in _CLASSES:
        # the base is a class of the httpx module given at run time: not a type here
        class ReplayStream(httpx.SyncByteStream, httpx.AsyncByteStream):  # type: ignore[name-defined]
            def __init__(self, body: bytes, error: dict[str, Any] | None, request: Any) -> None:
                self._body, self._error, self._request = body, error, request

            def __iter__(self):
                if self._body:
                    yield self._body
                if self._error:
                    raise _transport_error(httpx, self._error, self._request)

            async def __aiter__(self):
                if self._body:
                    yield self._body
                if self._error:
                    raise _transport_error(httpx, self._error, self._request)

        _CLASSES[key] = ReplayStream
    return _CLASSES[key]


class _Recording:
    """The state of one live exchange until its stream is done."""

    def __init__(self, session: Session, request: HttpRequest, meta: HttpResponse | None,
                 start: float, t0: float) -> None:
        self.session, self.request, self.meta = session, request, meta
        self.start, self.t0 = start, t0
        self.chunks: list[bytes] = []
        self.first: float | None = None
        self.done = False

    def chunk(self, data: bytes) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.chunks.append(data)

    def abandon(self) -> None:
        """The program is being stopped mid-response: log nothing (a resume asks again)."""
        self.done = True

    def cut(self, error: BaseException | None) -> None:
        """The stream ended early (``close`` before the end, or an exception in the read)."""
        if isinstance(error, KeyboardInterrupt) or stopping():
            self.abandon()
        else:
            self.finish(error)

    def finish(self, error: BaseException | None) -> None:
        if self.done:
            return
        self.done = True
        now = time.perf_counter()
        ttfb = (self.first - self.t0) * 1000 if self.first is not None else None
        timing = Timing(self.start, (now - self.t0) * 1000, ttfb)
        response = self.meta
        if response is not None:
            response.body = b"".join(self.chunks)
        try:
            self.session.end_http(self.request, response, timing, error)
        except DejaError as exc:  # e.g. the cassette could not be written: never retried
            raise sdk_passthrough(exc) from None


def _tee_class(httpx: ModuleType, kind: str) -> type:
    key = (httpx.__name__, kind)
    if key in _CLASSES:
        return _CLASSES[key]
    if kind == "sync":
        # the base is a class of the httpx module given at run time: not a type here
        class SyncTee(httpx.SyncByteStream):  # type: ignore[name-defined]
            def __init__(self, inner: Any, rec: _Recording) -> None:
                self._inner, self._rec = inner, rec

            def __iter__(self):
                try:
                    for chunk in self._inner:
                        self._rec.chunk(chunk)
                        yield chunk
                except GeneratorExit:
                    raise
                except BaseException as exc:
                    self._rec.cut(exc)
                    raise
                self._rec.finish(None)

            def close(self) -> None:
                try:
                    self._inner.close()
                finally:
                    self._rec.cut(None)

        _CLASSES[key] = SyncTee
    else:
        # the base is a class of the httpx module given at run time: not a type here
        class AsyncTee(httpx.AsyncByteStream):  # type: ignore[name-defined]
            def __init__(self, inner: Any, rec: _Recording) -> None:
                self._inner, self._rec = inner, rec

            async def __aiter__(self):
                try:
                    async for chunk in self._inner:
                        self._rec.chunk(chunk)
                        yield chunk
                except GeneratorExit:
                    raise
                except BaseException as exc:
                    self._rec.cut(exc)
                    raise
                self._rec.finish(None)

            async def aclose(self) -> None:
                try:
                    await self._inner.aclose()
                finally:
                    self._rec.cut(None)

        _CLASSES[key] = AsyncTee
    return _CLASSES[key]


def _begin(session: Session, httpx: ModuleType, request: Any, req: HttpRequest) -> Any:
    try:
        served = session.begin_http(req)
    except DejaError as exc:
        raise sdk_passthrough(exc) from None
    if served is None:
        # the headers as sent, read before anything changes them (below, or an auth flow
        # answering this request's 401); a request served from the cassette never reads them
        req.headers = list(req.headers)
    if served is None and req.original_body is not None:  # a guard rewrote the body
        request.headers["content-length"] = str(len(req.body))
        request.stream = httpx.ByteStream(req.body)
        request._content = req.body
    return served


def sync_handler(session: Session, httpx: ModuleType, real: Callable[..., Any]) -> Callable:
    tee = _tee_class(httpx, "sync")

    def handle_request(self: Any, request: Any) -> Any:
        req = _request(request, request.read())
        served = _begin(session, httpx, request, req)
        if served is not None:
            return _served(httpx, request, served)
        start, t0 = time.time(), time.perf_counter()
        try:
            response = real(self, request)
        except Exception as exc:
            _Recording(session, req, None, start, t0).finish(exc)
            raise
        response.stream = tee(response.stream, _Recording(session, req, _response_meta(response),
                                                          start, t0))
        return response

    return handle_request


def async_handler(session: Session, httpx: ModuleType, real: Callable[..., Any]) -> Callable:
    tee = _tee_class(httpx, "async")

    async def handle_async_request(self: Any, request: Any) -> Any:
        req = _request(request, await request.aread())
        served = _begin(session, httpx, request, req)
        if served is not None:
            return _served(httpx, request, served)
        start, t0 = time.time(), time.perf_counter()
        try:
            response = await real(self, request)
        except Exception as exc:
            _Recording(session, req, None, start, t0).finish(exc)
            raise
        response.stream = tee(response.stream, _Recording(session, req, _response_meta(response),
                                                          start, t0))
        return response

    return handle_async_request
