"""How the proxy answers a request its run has taken: from a cassette or from the upstream.

A served run (a replay, a fork's prefix) is answered from its cassette
(:meth:`Responder.serve`): the recorded status, headers and bytes. Any other request goes
to the upstream (:meth:`Responder.forward`) through one aiohttp client that passes bytes
through as they come (no decompression, no headers of its own): a stream's response goes
back to the client chunk by chunk as it arrives and is teed; a whole (JSON) response is
passed on once complete; both within ``max_response`` bytes (:mod:`deja.proxy._bounds`).
``end_http`` logs the exchange once it is complete, after its last byte is sent, so the
client does not wait for the write (a large one is logged in a worker thread, the run's
next request waiting for it). Either way the run is told how its call went: failed, when
it was answered, and, read by its provider, whether its reply left the turn to the agent
(asked for tools) and the calls a Responses reply asks for (:mod:`deja.proxy._tool_steps`);
every response carries the run's id (``x-deja-run-id``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp
import yarl

from deja.proxy._bounds import (
    OFFLOAD_BYTES,
    Passing,
    cut_tail,
    decoded_within,
    off_loop,
    said,
    too_large,
)
from deja.proxy._tool_steps import is_responses, read_reply
from deja.proxy._wire import ProxyError, served_headers
from deja.proxy.runs import ProxyRun, Registry
from recorder import providers
from recorder.capture.exchange import HttpRequest, HttpResponse
from recorder.capture.session import Timing
from recorder.errors import ResponseTooLarge

__all__ = ["RUN_ID_HEADER", "ClientGone", "Exchange", "Receive", "Responder", "Send"]

log = logging.getLogger("deja.proxy")

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

RUN_ID_HEADER = b"x-deja-run-id"

# What the upstream client raises when the upstream is unreachable, times out or cuts a
# response short.
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


class ClientGone(ConnectionError):
    """The client disconnected before its response was complete."""


@dataclass
class Exchange:
    """One request's state, for its log line and for the error it may end with."""

    method: str
    path: str
    t0: float = field(default_factory=time.perf_counter)
    status: int | None = None
    started: bool = False
    run: str | None = None
    note: str = ""
    answered: bool = False  # the response came whole, with a status below 400


@dataclass
class _Forwarding:
    """One request on its way through :meth:`Responder.forward`: what its phases share."""

    run: ProxyRun
    rec: Any  # the session that logs it, if any
    request: HttpRequest
    send: Send
    ex: Exchange
    start: float  # epoch seconds
    t0: float  # perf_counter
    gone: asyncio.Future[Any]  # completes when the client disconnects
    meta: HttpResponse = field(default_factory=lambda: HttpResponse(status=0, headers=[],
                                                                     body=b""))
    passing: Passing = field(init=False)
    held: bool = False  # run.logging, taken before the last byte goes out when it is large

    def failed(self, error: BaseException) -> None:
        """The exchange failed before a response: logged as failed."""
        self.run.last_failed = True
        if self.rec is not None:
            self.rec.end_http(self.request, None,
                              Timing(self.start, (time.perf_counter() - self.t0) * 1000), error)

    async def started(self, response: aiohttp.ClientResponse, body_length: int | None) -> None:
        """Send the response's start (its status and headers) to the client."""
        headers = served_headers(self.meta.headers, body_length)
        headers.append((RUN_ID_HEADER, self.run.run_id.encode()))
        self.ex.status, self.ex.started = response.status, True
        await self.send({"type": "http.response.start", "status": response.status,
                         "headers": headers})


class Responder:
    """The answers to the requests the runs take, from a cassette (:meth:`serve`) or from
    ``upstream`` (:meth:`forward`), through the client :meth:`open` makes."""

    def __init__(self, upstream: str, registry: Registry, *, timeout: float,
                 max_response: int) -> None:
        self.upstream = upstream
        self.registry = registry
        self.timeout = timeout
        self.max_response = max_response
        self.client: aiohttp.ClientSession | None = None

    def open(self) -> None:
        # Bytes pass through as they come: no decompression, no headers of its own added
        # (the client's own user-agent, accept and content-type go upstream as sent).
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30,
                                          sock_read=self.timeout),
            auto_decompress=False, trust_env=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def serve(self, run: ProxyRun, served: HttpResponse, send: Send,
                    ex: Exchange) -> None:
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
        ex.status, ex.note = served.status, "replayed"
        await send({"type": "http.response.start", "status": served.status,
                    "headers": headers})
        ex.started = True  # once sent: a start the server refused is not a response under way
        await send({"type": "http.response.body", "body": body, "more_body": False})
        run.last_failed = served.status >= 400 or refused
        run.answered = time.time()
        ex.answered = not run.last_failed
        if seam is not None and served.status < 400:
            try:
                plain = await off_loop(len(served.body), decoded_within, served.body,
                                       served.headers, self.max_response)
            except ResponseTooLarge as exc:  # a cassette is untrusted input too
                log.warning("run %s: a recorded response is not read: %s", run.run_id, exc)
                return
            summary = seam.summarize(served.status, served.headers, plain)
            run.last_stop_reason = summary.get("stop_reason")
            run.awaiting_tools = None
            await off_loop(len(plain), partial(read_reply, chained=is_responses(ex.path)),
                           self.registry, run, seam, served.headers, plain)

    async def forward(self, run: ProxyRun, rec: Any, request: HttpRequest, receive: Receive,
                      send: Send, ex: Exchange) -> None:
        """Send the request upstream and pass its response back within ``max_response``
        bytes, teed into the log: a stream event by event as it arrives, a whole body
        once complete (so that one over the limit can still be answered with a 502)."""
        # an http.disconnect, if the client leaves
        f = _Forwarding(run, rec, request, send, ex, time.time(), time.perf_counter(),
                        asyncio.ensure_future(receive()))
        response = await self._open(f)
        error = await self._pass_on(f, response)
        self._ended(run, response, f.gone, ex, f.passing, f.meta, error)
        await self._log(f, error)
        if not ex.started and error is not None:  # the client has been sent nothing yet
            if isinstance(error, ResponseTooLarge):
                raise ProxyError(502, "api_error", said(error))
            if not isinstance(error, ClientGone):
                raise ProxyError(502, "api_error",
                                 f"deja proxy: the upstream {self.upstream} cut its response "
                                 f"short ({type(error).__name__}: {error})", retry=True)

    async def _open(self, f: _Forwarding) -> aiohttp.ClientResponse:
        """The upstream's response to the request, unless the client leaves first (a
        :class:`ClientGone`) or the upstream cannot be reached (a 502)."""
        client = self.client
        assert client is not None
        sending = asyncio.ensure_future(client.request(
            f.request.method, yarl.URL(f.request.url, encoded=True),
            headers=f.request.headers, data=f.request.body, allow_redirects=False))
        try:
            await asyncio.wait((sending, f.gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            sending.cancel()
            f.gone.cancel()
            raise
        if not sending.done():  # the client left before the upstream answered
            sending.cancel()
            f.failed(ClientGone("the client went away before the upstream answered"))
            raise ClientGone("the client went away before the upstream answered")
        try:
            response = sending.result()
        except UPSTREAM_ERRORS as exc:
            f.gone.cancel()
            f.failed(exc)
            raise ProxyError(502, "api_error",
                             f"deja proxy: the upstream {self.upstream} could not be reached "
                             f"({type(exc).__name__}: {exc})", retry=True) from None
        f.meta = HttpResponse(status=response.status,
                              headers=[(k.decode("latin-1"), v.decode("latin-1"))
                                       for k, v in response.raw_headers],
                              body=b"", reason=response.reason or "")
        f.passing = Passing(f.meta.headers, self.max_response, f"{f.request.method} {f.ex.path}")
        return response

    async def _pass_on(self, f: _Forwarding, response: aiohttp.ClientResponse
                       ) -> BaseException | None:
        """Pass the response's body to the client as it arrives (a stream) or once whole;
        what cut it short, if anything. Cancelled (a shutdown's grace ran out), the
        exchange is closed and logged here before the error goes on."""
        passing = f.passing
        length = response.headers.get("content-length")
        chunked = "chunked" in response.headers.get("transfer-encoding", "").lower()
        declared = int(length) if length and length.isdigit() and not chunked else None
        error: BaseException | None = None
        try:
            if declared is not None and declared > self.max_response:
                return too_large(self.max_response, where=passing.where)
            if passing.stream:  # a compressed one may be cut short of its length
                await f.started(response, declared if passing.inflation is None else None)
            async for chunk in response.content.iter_any():
                out = await passing.take(chunk)
                if f.gone.done():
                    error = ClientGone("the client disconnected before the response ended")
                    break
                if out:
                    await f.send({"type": "http.response.body", "body": out,
                                  "more_body": True})
                if passing.refused is not None:
                    error = passing.refused
                    break
            if error is None or (passing.refused is not None and f.ex.started):
                if passing.size + len(f.request.body) > OFFLOAD_BYTES:
                    await f.run.logging.acquire()  # the run's next request waits for it
                    f.held = True
                if not passing.stream and error is None:
                    body = passing.body()
                    await f.started(response, declared if declared is not None else len(body))
                else:  # the rest of a stream, or the error event of one that was cut
                    body = passing.tail()
                await f.send({"type": "http.response.body", "body": body, "more_body": False})
        except UPSTREAM_ERRORS as exc:  # the upstream cut the response short
            error = exc
        except BaseException as exc:  # the grace period of a shutdown ran out, say
            if isinstance(exc, asyncio.CancelledError):
                f.run.cut = True
                exc = ClientGone("cut short: the proxy shut down before the response ended")
            try:
                self._ended(f.run, response, f.gone, f.ex, passing, f.meta, exc)
                if f.rec is not None:  # written here and now: the task is going away
                    f.rec.end_http(f.request, f.meta if f.ex.started else None,
                                   passing.timing(f.start, f.t0), exc)
            finally:
                if f.held:
                    f.run.logging.release()
            raise
        return error

    async def _log(self, f: _Forwarding, error: BaseException | None) -> None:
        """Log the exchange (in a thread when it is large: the other clients are served
        meanwhile) and read what a successful reply says of the run's tools."""
        seam = providers.for_url(f.request.method, f.request.url) \
            if error is None and f.meta.status < 400 else None
        timing = f.passing.timing(f.start, f.t0)

        def log_it() -> None:
            if f.rec is not None:
                obs = f.rec.end_http(f.request, f.meta if f.ex.started else None, timing, error)
                f.run.last_stop_reason = (obs or {}).get("stop_reason")
            if seam is not None:
                read_reply(self.registry, f.run, seam, f.meta.headers,
                           decoded_within(f.meta.body, f.meta.headers, self.max_response),
                           chained=is_responses(f.ex.path))

        try:
            if not f.held and len(f.meta.body) + len(f.request.body) > OFFLOAD_BYTES:
                await f.run.logging.acquire()
                f.held = True
            if f.held:
                await asyncio.to_thread(log_it)
            else:
                log_it()
        finally:
            if f.held:
                f.run.logging.release()

    def _ended(self, run: ProxyRun, response: aiohttp.ClientResponse, gone: asyncio.Future[Any],
               ex: Exchange, passing: Passing, meta: HttpResponse,
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
        ex.answered = not run.last_failed
        run.awaiting_tools = None  # until its reply is read
