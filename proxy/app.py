"""The recording proxy as an ASGI application: every request of every client, one
exchange at a time.

A request is checked for whom it comes from (:class:`proxy._wire.Callers`), read whole (up
to ``max_body``), routed to its run (:mod:`proxy.runs`), and handed to the run's session
exactly as the in-process capture hands an exchange over: ``begin_http`` runs the guards
and answers from a cassette when the run is served (replay, a fork's prefix); otherwise
the request goes to the upstream. A stream's response goes back to the client chunk by
chunk as it arrives and is teed; a whole (JSON) response is passed on once complete;
both within ``max_response`` bytes (:mod:`proxy._bounds`). ``end_http`` logs the exchange
once it is complete, after its last byte is sent, so the client does not wait for the
write (a large one is logged in a worker thread, the run's next request waiting for it).

Errors the proxy answers itself are in the provider's shape (:mod:`proxy._wire`), never a
traceback: a malformed body (400), a body over the limit (413), a wrong token (401), a
path under ``/_deja/`` it does not serve (404), an unreachable upstream (502, which the SDKs
retry as they retry a connection error), a response over ``max_response`` (502, not
retried), a stopped run or a divergence (400 with ``x-should-retry: false``), an open
circuit (503, not retried), a foreign ``Host`` (421) or a web page's request (403).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import yarl

from proxy._bounds import (
    BODY_TIMEOUT,
    MAX_RESPONSE,
    OFFLOAD_BYTES,
    Passing,
    cut_tail,
    decoded_within,
    said,
    too_large,
)
from proxy._wire import Callers, ProxyError, error_body, forwardable, served_headers
from proxy.runs import (
    RUN_NAME,
    ProxyRun,
    Registry,
    conversation_items,
    credential,
    message_keys,
    parse_labels,
    tool_calls,
    tool_results,
)
from recorder import providers
from recorder.capture.exchange import HttpRequest, HttpResponse, RequestReader
from recorder.capture.session import Timing
from recorder.errors import (
    CircuitOpen,
    DejaError,
    Divergence,
    DivergenceInfo,
    ResponseTooLarge,
    RunStopped,
    UnserializableValue,
)
from recorder.providers import model_provider
from recorder.record import RecordSession

__all__ = ["Proxy"]

log = logging.getLogger("deja.proxy")

T = TypeVar("T")
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

RUN_HEADER = "x-deja-run"
LABELS_HEADER = "x-deja-labels"
TOKEN_HEADER = "x-deja-token"
RUN_ID_HEADER = b"x-deja-run-id"

# What the upstream client raises when the upstream is unreachable, times out or cuts a
# response short.
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


class ClientGone(ConnectionError):
    """The client disconnected before its response was complete."""


@dataclass
class _Exchange:
    """One request's state, for its log line and for the error it may end with."""

    method: str
    path: str
    t0: float = field(default_factory=time.perf_counter)
    status: int | None = None
    started: bool = False
    run: str | None = None
    note: str = ""


class Proxy:
    """The ASGI app. ``new_run`` makes a new recorded run (record mode); ``single`` is the
    one run every request goes to (replay, fork)."""

    def __init__(self, *, upstream: str, new_run: Callable[[str | None, dict[str, str]],
                                                           ProxyRun] | None = None,
                 single: ProxyRun | None = None, token: str | None = None,
                 max_body: int = 32 * 1024 * 1024, body_timeout: float = BODY_TIMEOUT,
                 idle: float = 300.0,
                 timeout: float = 600.0, mode: str = "record",
                 max_response: int = MAX_RESPONSE, callers: Callers | None = None) -> None:
        if (new_run is None) == (single is None):
            raise ValueError("give exactly one of new_run and single")
        self.upstream = upstream.rstrip("/")
        self.mode = mode
        self._new_run, self.single = new_run, single
        self.token = token
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.max_response = max_response
        self.callers = callers or Callers.of("127.0.0.1")
        self.idle = idle
        self.timeout = timeout
        self.registry = Registry()
        if single is not None:
            self.registry.add(single)
        self._reader = RequestReader()  # for routing: a conversation's history is read once
        self._client: aiohttp.ClientSession | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()
        self.requests = 0
        self.closed = False

    # -- lifecycle

    async def startup(self) -> None:
        # Bytes pass through as they come: no decompression, no headers of its own added
        # (the client's own user-agent, accept and content-type go upstream as sent).
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30,
                                          sock_read=self.timeout),
            auto_decompress=False, trust_env=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
        if self._new_run is not None:
            self._reaper = asyncio.create_task(self._reap())

    async def shutdown(self) -> None:
        """Close every open run with its end line (idempotent)."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        self.close_all("the proxy shut down")
        if self._client is not None:
            await self._client.close()
            self._client = None

    def close_all(self, why: str) -> None:
        for run in self.registry.open_runs():
            if run is not self.single or self.mode == "fork":
                self._close(run, why)
        self.closed = True

    def _close(self, run: ProxyRun, why: str, error: BaseException | None = None) -> None:
        if run.closed:
            return
        run.closed = True
        rec = _writer_of(run)
        if rec is not None:
            try:
                if error is not None:
                    rec.close(error=error)
                else:
                    status, reason = run.end_status()
                    rec.close(status=status)
                    log.info("run %s closed (%s): %s%s", run.run_id, why, status,
                             f", {reason}" if reason else "")
            except DejaError as exc:
                log.error("run %s: its end line could not be written: %s", run.run_id, exc)
        self.registry.retire(run, keep=error is not None)

    async def _reap(self) -> None:
        tick = max(0.05, min(1.0, self.idle / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for run in self.registry.idle(now - self.idle):
                # its end line is forced to disk: not on the event loop
                await asyncio.to_thread(self._close, run, f"idle for {self.idle:g}s")
            self.registry.forget_stopped(now - max(self.idle, 60.0))

    # -- ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        ex = _Exchange(scope["method"], scope["path"])
        self.requests += 1
        try:
            await self._http(scope, receive, send, ex)
        except ProxyError as err:
            await self._answer_error(send, ex, err)
        except ClientGone as exc:
            ex.note = str(exc)
        except asyncio.CancelledError:  # the shutdown's grace ran out: the line is written
            ex.note = "cut short by the proxy's shutdown"
        except Exception as exc:  # never a traceback to the client
            log.exception("%s %s: unexpected error", ex.method, ex.path)
            await self._answer_error(send, ex, ProxyError(
                500, "api_error", f"deja proxy: internal error ({type(exc).__name__}); "
                "see the proxy's log"))
        finally:
            log.info("%s %s %s%s %.1fms%s", ex.method, ex.path, ex.status or "-",
                     f" run={ex.run}" if ex.run else "", (time.perf_counter() - ex.t0) * 1000,
                     f" ({ex.note})" if ex.note else "")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # noqa: BLE001 - reported by the server, which stops
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _answer_error(self, send: Send, ex: _Exchange, err: ProxyError) -> None:
        ex.note = ex.note or err.message[:200]
        if ex.started:  # the response is under way: all that can be done is to end it
            ex.note += " (after the response started)"
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        body = error_body(err.type, err.message)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()),
                   *((k.encode("latin-1"), v.encode("latin-1")) for k, v in err.headers)]
        if not err.retry:
            headers.append((b"x-should-retry", b"false"))
        if ex.run:
            headers.append((RUN_ID_HEADER, ex.run.encode()))
        ex.status = err.status
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    # -- one request

    async def _http(self, scope: Scope, receive: Receive, send: Send, ex: _Exchange) -> None:
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        named = {k.lower(): v for k, v in headers}
        refused = self.callers.refusal(named)
        if refused is not None:
            raise refused
        if ex.path == "/_deja/health":
            await self._health(send, ex)
            return
        if self.token is not None and not hmac.compare_digest(
                named.get(TOKEN_HEADER, "").encode(), self.token.encode()):
            raise ProxyError(401, "authentication_error",
                             f"deja proxy: this proxy needs its token in the {TOKEN_HEADER} "
                             "header (deja proxy --token)")
        if ex.path.startswith("/_deja/"):
            raise ProxyError(404, "not_found_error",
                             f"deja proxy: no such endpoint {ex.path}; the proxy serves "
                             "/_deja/health and forwards everything else")
        body = await self._body(receive, named)
        query = scope.get("query_string") or b""
        url = self.upstream + ex.path + (f"?{query.decode('latin-1')}" if query else "")
        request = HttpRequest(ex.method, url, forwardable(headers), body)
        parsed: Any = None
        keys: list[str] | None = None
        if model_provider(ex.method, url):
            parsed, keys = await _off_loop(len(body), self._read_model_request, body, ex)
        previous = parsed.get("previous_response_id") if isinstance(parsed, dict) else None
        run = await self._route(named, headers, keys, ex,
                                previous if isinstance(previous, str) else None)
        ex.run = run.run_id
        run.in_flight += 1
        run.used = time.monotonic()
        try:
            await self._exchange(run, request, parsed, keys, receive, send, ex)
        finally:
            run.in_flight -= 1
            run.used = time.monotonic()

    async def _health(self, send: Send, ex: _Exchange) -> None:
        body = json.dumps({"ok": True, "mode": self.mode, "runs_open": len(self.registry),
                           "requests": self.requests}).encode()
        ex.status = 200
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _body(self, receive: Receive, named: dict[str, str]) -> bytes:
        declared = named.get("content-length", "")
        too_big = ProxyError(413, "request_too_large",
                             f"deja proxy: the request body is over the proxy's limit of "
                             f"{self.max_body} bytes (deja proxy --max-body)")
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_big
        chunks: list[bytes] = []
        size = 0
        while True:
            try:  # a body that stops coming would hold its connection for ever
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                raise ProxyError(408, "request_timeout",
                                 f"deja proxy: the request body stalled: nothing came for "
                                 f"{self.body_timeout:g} s (deja proxy --body-timeout)"
                                 ) from None
            if message["type"] == "http.disconnect":
                raise ClientGone("the client went away while sending its request")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise too_big
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    def _read_model_request(self, body: bytes, ex: _Exchange) -> tuple[Any, list[str] | None]:
        parsed, problem, texts = self._reader.read(body)
        if not isinstance(parsed, dict):
            what = problem or ("is not JSON" if parsed is not None or body else "is empty")
            if isinstance(parsed, (list, str, int, float, bool)) or (parsed is None and body):
                what = problem or "is not a JSON object"
            raise ProxyError(400, "invalid_request_error",
                             f"deja proxy: the body of {ex.method} {ex.path} {what}; a model "
                             "request is a JSON object. Nothing was sent upstream")
        items = conversation_items(parsed)
        if items is None:
            return parsed, None
        # the body's texts are those of its messages (a Responses input is keyed by its JSON)
        known = texts[1] if texts and items is parsed.get("messages") else None
        return parsed, message_keys(items, known)

    async def _route(self, named: dict[str, str], headers: list[tuple[str, str]],
                     keys: list[str] | None, ex: _Exchange,
                     previous: str | None = None) -> ProxyRun:
        if self.single is not None:
            return self.single
        name = named.get(RUN_HEADER)
        if name is not None and not RUN_NAME.match(name):
            raise ProxyError(400, "invalid_request_error",
                             f"deja proxy: {RUN_HEADER} must be 1-128 letters, digits and "
                             "_ . : @ -, starting with a letter or digit")
        who = credential(headers)
        count = named.get("x-stainless-retry-count", "")
        retry = (count != "0") if count.isdigit() else None
        run = self.registry.find(who, name, keys if name is None else None, retry, previous)
        if run is not None:
            return run
        assert self._new_run is not None
        async with self._starting:  # one at a time: two requests never start one run twice
            run = self.registry.find(who, name, keys if name is None else None, retry,
                                     previous)
            if run is not None:
                return run
            try:  # a new cassette's header is forced to disk: not on the event loop
                run = await asyncio.to_thread(self._new_run, name,
                                              parse_labels(named.get(LABELS_HEADER)))
            except DejaError as exc:
                log.error("cannot start a run: %s", exc)
                raise ProxyError(500, "api_error", f"deja proxy: cannot start a run: {exc}",
                                 retry=False) from None
            run.who = who
            self.registry.add(run)
        log.info("run %s started%s", run.run_id, f" ({name})" if name else "")
        return run

    async def _exchange(self, run: ProxyRun, request: HttpRequest, parsed: Any,
                        keys: list[str] | None, receive: Receive, send: Send,
                        ex: _Exchange) -> None:
        if run.logging.locked():  # a large line of this run is being written: it goes first
            async with run.logging:
                pass
        if run.stopped is not None:
            raise _stop_error(run, run.stopped)
        if run.closed and run is not self.single:
            raise ProxyError(400, "invalid_request_error",
                             f"deja proxy: run {run.run_id} is closed")
        if isinstance(parsed, dict) and run.edits:
            parsed = copy.deepcopy(parsed)  # the reader keeps the messages it parsed
            request.body = _substitute(parsed, run.edits, request.body)
        try:
            rec = run.recording
            if isinstance(parsed, dict) and rec is not None:
                self._boundary(run, rec, parsed, keys)
            elif isinstance(parsed, dict) and run.recorded:
                _check_results(run, parsed)
            if type(run.session) is RecordSession:  # the body is read for the log later
                run.session.before_call(request)
                served = None
            else:
                served = run.session.begin_http(request)
        except CircuitOpen as exc:
            raise ProxyError(503, "api_error", f"deja proxy: {exc}") from None
        except RunStopped as exc:
            self._stopped(run, exc)
            raise _stop_error(run, exc) from None
        except Divergence as exc:
            log.warning("run %s: %s", run.run_id, exc)
            raise ProxyError(400, "invalid_request_error",
                             f"deja replay: {_divergence_line(exc)}") from None
        except UnserializableValue as exc:
            raise ProxyError(400, "invalid_request_error", f"deja proxy: {exc}") from None
        if keys is not None:
            run.last_keys = keys
        if served is not None:
            await self._serve(run, served, send, ex)
            return
        rec = run.recording
        await self._forward(run, rec, request, receive, send, ex)

    def _boundary(self, run: ProxyRun, rec: Any, body: dict[str, Any],
                  keys: list[str] | None) -> None:
        """Log the tool results this request brings that the run has not seen yet (and
        let the guards see them)."""
        messages = conversation_items(body)
        if messages is None:
            return
        n = len(run.last_keys)
        if isinstance(body.get("previous_response_id"), str):
            new = messages  # a Responses request that continues one: every item is new
        elif keys is not None and keys[:n] == run.last_keys:
            new = messages[n:]
        else:
            new = messages[-1:]
        results = [r for r in tool_results(new) if r["tool_use_id"] not in run.logged]
        if not results:
            return
        calls = {**run.calls, **tool_calls(messages)}
        now = time.time()
        since = run.answered  # the tools ran between the last response and this request
        for block in results:
            call = block["tool_use_id"]
            name, args = calls.get(call, ("unknown", None))
            run.logged.add(call)
            rec.observe_tool(name, args if isinstance(args, dict) else {"input": args},
                             block.get("content", ""), call_id=call,
                             is_error=block.get("is_error") is True, start=since or now,
                             ms=(now - since) * 1000 if since is not None else None)

    def _stopped(self, run: ProxyRun, stop: RunStopped) -> None:
        """A guard stopped the run (or a replay reached the recorded stop): close it."""
        run.stopped = stop
        self._close(run, stop.reason, error=stop)
        log.warning("run %s stopped: %s", run.run_id, stop)

    async def _serve(self, run: ProxyRun, served: HttpResponse, send: Send,
                     ex: _Exchange) -> None:
        """Answer from a cassette: the recorded status, headers and bytes (a stream the
        proxy cut while recording ends as it ended then, with its error event)."""
        error: dict[str, Any] = served.extra.get("error") or {}
        refused = error.get("type") == ResponseTooLarge.__name__
        if error and not served.extra.get("has_response"):
            raise ProxyError(502, "api_error",
                             f"deja replay: the recorded call failed before any response: "
                             f"{error.get('type')}: {error.get('message')}",
                             retry=not refused)
        seam = providers.for_url(ex.method, self.upstream + ex.path)
        stream = seam is not None and seam.is_stream(served.headers)
        body = served.body
        if refused and stream:
            body += cut_tail(served.headers, f"deja proxy: {error.get('type')}: "
                                             f"{error.get('message')}")
        headers = served_headers(served.headers, None if stream else len(body))
        headers.append((RUN_ID_HEADER, run.run_id.encode()))
        ex.status, ex.started, ex.note = served.status, True, "replayed"
        await send({"type": "http.response.start", "status": served.status,
                    "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        run.last_failed = served.status >= 400 or refused
        run.answered = time.time()
        if seam is not None and served.status < 400:
            try:
                plain = await _off_loop(len(served.body), decoded_within, served.body,
                                        served.headers, self.max_response)
            except ResponseTooLarge as exc:  # a cassette is untrusted input too
                log.warning("run %s: a recorded response is not read: %s", run.run_id, exc)
                return
            summary = seam.summarize(served.status, served.headers, plain)
            run.last_stop_reason = summary.get("stop_reason")
            run.awaiting_tools = False
            if _is_responses(ex.path):
                await _off_loop(len(plain), self._read_reply, run, seam, served.headers, plain)

    async def _forward(self, run: ProxyRun, rec: Any, request: HttpRequest, receive: Receive,
                       send: Send, ex: _Exchange) -> None:
        """Send the request upstream and pass its response back within ``max_response``
        bytes, teed into the log: a stream event by event as it arrives, a whole body
        once complete (so that one over the limit can still be answered with a 502)."""
        client = self._client
        assert client is not None
        start, t0 = time.time(), time.perf_counter()

        def failed(error: BaseException) -> None:
            run.last_failed = True
            if rec is not None:
                rec.end_http(request, None, Timing(start, (time.perf_counter() - t0) * 1000),
                             error)

        async def opened() -> aiohttp.ClientResponse:
            return await client.request(request.method, yarl.URL(request.url, encoded=True),
                                        headers=request.headers, data=request.body,
                                        allow_redirects=False)

        gone = asyncio.ensure_future(receive())  # an http.disconnect, if the client leaves
        sending = asyncio.ensure_future(opened())
        try:
            await asyncio.wait((sending, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            sending.cancel()
            gone.cancel()
            raise
        if not sending.done():  # the client left before the upstream answered
            sending.cancel()
            failed(ClientGone("the client went away before the upstream answered"))
            raise ClientGone("the client went away before the upstream answered")
        try:
            response = sending.result()
        except UPSTREAM_ERRORS as exc:
            gone.cancel()
            failed(exc)
            raise ProxyError(502, "api_error",
                             f"deja proxy: the upstream {self.upstream} could not be reached "
                             f"({type(exc).__name__}: {exc})", retry=True) from None
        meta = HttpResponse(status=response.status,
                            headers=[(k.decode("latin-1"), v.decode("latin-1"))
                                     for k, v in response.raw_headers],
                            body=b"", reason=response.reason or "")
        passing = Passing(meta.headers, self.max_response, f"{request.method} {ex.path}")
        length = response.headers.get("content-length")
        chunked = "chunked" in response.headers.get("transfer-encoding", "").lower()
        declared = int(length) if length and length.isdigit() and not chunked else None
        start_message = {"type": "http.response.start", "status": response.status}

        async def started(body_length: int | None) -> None:
            headers = served_headers(meta.headers, body_length)
            headers.append((RUN_ID_HEADER, run.run_id.encode()))
            ex.status, ex.started = response.status, True
            await send({**start_message, "headers": headers})

        error: BaseException | None = None
        held = False  # run.logging, taken before the last byte goes out when the line is large
        try:
            if declared is not None and declared > self.max_response:
                error = too_large(self.max_response, where=passing.where)
            else:
                if passing.stream:  # a compressed one may be cut short of its length
                    await started(declared if passing.inflation is None else None)
                async for chunk in response.content.iter_any():
                    out = await passing.take(chunk)
                    if gone.done():
                        error = ClientGone("the client disconnected before the response ended")
                        break
                    if out:
                        await send({"type": "http.response.body", "body": out,
                                    "more_body": True})
                    if passing.refused is not None:
                        error = passing.refused
                        break
                if error is None or (passing.refused is not None and ex.started):
                    if passing.size + len(request.body) > OFFLOAD_BYTES:
                        await run.logging.acquire()  # the run's next request waits for it
                        held = True
                    if not passing.stream and error is None:
                        body = passing.body()
                        await started(declared if declared is not None else len(body))
                    else:  # the rest of a stream, or the error event of one that was cut
                        body = passing.tail()
                    await send({"type": "http.response.body", "body": body,
                                "more_body": False})
        except UPSTREAM_ERRORS as exc:  # the upstream cut the response short
            error = exc
        except BaseException as exc:  # the grace period of a shutdown ran out, say
            if isinstance(exc, asyncio.CancelledError):
                run.cut = True
                exc = ClientGone("cut short: the proxy shut down before the response ended")
            try:
                self._ended(run, response, gone, ex, passing, meta, exc)
                if rec is not None:  # written here and now: the task is going away
                    rec.end_http(request, meta if ex.started else None,
                                 passing.timing(start, t0), exc)
            finally:
                if held:
                    run.logging.release()
            raise
        self._ended(run, response, gone, ex, passing, meta, error)
        seam = providers.for_url(request.method, request.url) \
            if error is None and meta.status < 400 and _is_responses(ex.path) else None
        timing = passing.timing(start, t0)

        def log_it() -> None:
            if rec is not None:
                obs = rec.end_http(request, meta if ex.started else None, timing, error)
                run.last_stop_reason = (obs or {}).get("stop_reason")
            if seam is not None:
                self._read_reply(run, seam, meta.headers,
                                 decoded_within(meta.body, meta.headers, self.max_response))

        try:
            if not held and len(meta.body) + len(request.body) > OFFLOAD_BYTES:
                await run.logging.acquire()
                held = True
            if held:  # in a thread: the other clients are served meanwhile
                await asyncio.to_thread(log_it)
            else:
                log_it()
        finally:
            if held:
                run.logging.release()
        if not ex.started and error is not None:  # the client has been sent nothing yet
            if isinstance(error, ResponseTooLarge):
                raise ProxyError(502, "api_error", said(error))
            if not isinstance(error, ClientGone):
                raise ProxyError(502, "api_error",
                                 f"deja proxy: the upstream {self.upstream} cut its response "
                                 f"short ({type(error).__name__}: {error})", retry=True)

    def _ended(self, run: ProxyRun, response: aiohttp.ClientResponse, gone: asyncio.Future[Any],
               ex: _Exchange, passing: Passing, meta: HttpResponse,
               error: BaseException | None) -> None:
        """A forwarded response is over: its connection released (or closed, after an
        error), what the log keeps of it in ``meta``, and the run told."""
        gone.cancel()
        if error is None:
            response.release()  # the connection goes back to the pool
        else:
            response.close()
        meta.body = passing.recorded()
        if error is not None:
            ex.note = str(error) or type(error).__name__
        run.last_failed = error is not None or meta.status >= 400
        run.answered = time.time()
        run.awaiting_tools = False

    def _read_reply(self, run: ProxyRun, seam: providers.Provider,
                    headers: list[tuple[str, str]], body: bytes) -> None:
        """What a Responses API reply means for the run's boundaries: the function calls
        it asks for (a request continuing it by ``previous_response_id`` sends their
        results without them), whether it waits for their results (how an idle run ends),
        and its id, by which such a request finds the run."""
        try:
            message = seam.message(headers, body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return
        output = message.get("output") if isinstance(message, dict) else None
        if not isinstance(output, list):
            return
        asked = tool_calls(output)
        run.calls.update(asked)
        run.awaiting_tools = bool(asked)
        if isinstance(message.get("id"), str):
            self.registry.replied(run, message["id"])


def _is_responses(path: str) -> bool:
    """Is this a call of the OpenAI Responses API (``POST /v1/responses``)?"""
    return path.rstrip("/").endswith("/responses")


def _check_results(run: ProxyRun, body: dict[str, Any]) -> None:
    """A served run (a replay, a fork's prefix): a tool result that is not what the
    recording observed for its call is a divergence at that tool's step, the step
    ``deja diff`` would name, rather than at the model request that carries it."""
    from replayer.diff import unified

    for block in tool_results(conversation_items(body) or []):
        obs = run.recorded.get(block["tool_use_id"])
        if obs is None or obs.get("edited"):
            continue
        got = block.get("content", "")
        if got == obs.get("result") and (block.get("is_error") is True) == \
                bool(obs.get("is_error")):
            continue
        expected = {"name": obs["name"], "args": obs.get("args"), "result": obs.get("result")}
        actual = {**expected, "result": got}
        if block.get("is_error") is True:
            actual["is_error"] = True
        if obs.get("is_error"):
            expected["is_error"] = True
        info = DivergenceInfo(
            step=obs["seq"], kind="tool",
            reason=f"the agent's tool {obs['name']!r} returned something other than "
                   f"the recorded result (call {block['tool_use_id']})",
            expected=expected, actual=actual, diff=unified(expected, actual))
        served: Any = getattr(run.session, "prefix", run.session)  # a fork: its prefix
        if getattr(served, "divergence", None) is None:
            served.divergence = info
        raise Divergence(info, path=getattr(served, "path", None))


def _writer_of(run: ProxyRun) -> Any:
    """The session that writes ``run`` (a fork's, even while it serves its prefix)."""
    from recorder.record import RecordSession

    return run.session if isinstance(run.session, RecordSession) else None


def _stop_error(run: ProxyRun, stop: RunStopped) -> ProxyError:
    how = {"cancelled": "It was cancelled (deja cancel); start a new run to go on.",
           }.get(stop.end_status, "To go on, fork it from its cassette with the guard "
                 "raised or the step edited (deja proxy --fork CASSETTE --at STEP), or "
                 "start a new run.")
    return ProxyError(400, "invalid_request_error",
                      f"deja: run {run.run_id} was stopped by the harness "
                      f"({stop.reason}): {stop}. {how}",
                      headers=[("x-deja-stop", str(stop.reason))])


def _divergence_line(exc: Divergence) -> str:
    info = exc.info
    where = f"step {info.step}" if info.step is not None else "the end of the recording"
    return (f"the request diverged from the recording at {where} ({info.kind}): "
            f"{info.reason}. The proxy's log shows the diff")


def _substitute(body: dict[str, Any], edits: dict[str, Any], raw: bytes) -> bytes:
    """The request with each edited tool result in place of what the agent sent (a fork
    at a tool step: the model sees the edit in every later request too)."""
    changed = False
    for message in conversation_items(body) or []:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":  # OpenAI Chat Completions: the message is the result
            targets = [(message, message.get("tool_call_id"), "content")]
        elif message.get("type") == "function_call_output":  # a Responses item: the result
            targets = [(message, message.get("call_id"), "output")]
        else:
            targets = [(block, block.get("tool_use_id"), "content")
                       for block in tool_results([message])]  # Anthropic tool_result blocks
        for target, call, key in targets:
            if isinstance(call, str) and call in edits and target.get(key) != edits[call]:
                target[key] = edits[call]
                changed = True
    if not changed:
        return raw
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


async def _off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a worker thread when it works on more than
    :data:`proxy._bounds.OFFLOAD_BYTES` (the other clients are served meanwhile)."""
    if size > OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
