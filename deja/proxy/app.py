"""The recording proxy as an ASGI application: every request of every client, one
exchange at a time.

A request is checked for whom it comes from (:class:`deja.proxy._wire.Callers`), read whole (up
to ``max_body``), given the path it has upstream (``/messages`` is ``/v1/messages``:
:func:`deja.proxy._wire.upstream_path`), routed to its run (:mod:`deja.proxy.runs`), and handed to
the run's session exactly as the in-process capture hands an exchange over: the tool
results it brings are logged as the run's tool steps (:mod:`deja.proxy._tool_steps`),
``begin_http`` runs the guards and answers from a cassette when the run is served (replay,
a fork's prefix); otherwise the request goes to the upstream. Both answers are
:mod:`deja.proxy._respond`'s: a stream's response goes back to the client chunk by chunk as it
arrives and is teed; a whole (JSON) response is passed on once complete; both within
``max_response`` bytes (:mod:`deja.proxy._bounds`). ``end_http`` logs the exchange once it is
complete, after its last byte is sent, so the client does not wait for the write (a large
one is logged in a worker thread, the run's next request waiting for it). Runs left idle
are closed by a reaper.

Errors the proxy answers itself are in the provider's shape (:mod:`deja.proxy._wire`), never a
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
from collections.abc import Callable, MutableMapping
from typing import Any

from deja.proxy._bounds import BODY_TIMEOUT, MAX_RESPONSE, off_loop
from deja.proxy._mcp import McpEndpoint, is_mcp_path
from deja.proxy._respond import RUN_ID_HEADER, ClientGone, Exchange, Receive, Responder, Send
from deja.proxy._tool_steps import (
    Reading,
    boundary,
    check_results,
    follow,
    read_results,
    substitute,
)
from deja.proxy._wire import Callers, ProxyError, error_body, forwardable, upstream_path
from deja.proxy.runs import (
    RUN_NAME,
    ProxyRun,
    Registry,
    Starting,
    conversation_items,
    credential,
    message_keys,
    parse_labels,
    start_key,
)
from recorder.capture.exchange import HttpRequest, RequestReader
from recorder.errors import (
    CircuitOpen,
    DejaError,
    Divergence,
    RunStopped,
    UnserializableValue,
)
from recorder.providers import Provider, for_url
from recorder.serving import BodyStalled, BodyTooLarge, ClientLeft, read_body

__all__ = ["Proxy"]

log = logging.getLogger("deja.proxy")

Scope = MutableMapping[str, Any]

RUN_HEADER = "x-deja-run"
LABELS_HEADER = "x-deja-labels"
TOKEN_HEADER = "x-deja-token"


class Proxy:
    """The ASGI app. ``new_run`` makes a new recorded run (record mode); ``single`` is the
    one run every request goes to (replay, fork, replay-then-live)."""

    def __init__(self, *, upstream: str, new_run: Callable[[str | None, dict[str, str]],
                                                           ProxyRun] | None = None,
                 single: ProxyRun | None = None, token: str | None = None,
                 max_body: int = 32 * 1024 * 1024, body_timeout: float = BODY_TIMEOUT,
                 idle: float = 300.0,
                 timeout: float = 600.0, mode: str = "record",
                 max_response: int = MAX_RESPONSE, callers: Callers | None = None,
                 mcp: str | None = None) -> None:
        if (new_run is None) == (single is None):
            raise ValueError("give exactly one of new_run and single")
        self.upstream = upstream.rstrip("/")
        self.mode = mode
        self._new_run, self.single = new_run, single
        self.token = token
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.callers = callers or Callers.of("127.0.0.1")
        self.idle = idle
        self.registry = Registry()
        if single is not None:
            self.registry.add(single)
        self._reader = RequestReader()  # for routing: a conversation's history is read once
        self._responder = Responder(self.upstream, self.registry, timeout=timeout,
                                    max_response=max_response)
        # /mcp: the MCP server at ``mcp`` carried (deja proxy --mcp; "" in a served run
        # whose recording names none: served, never live)
        self.mcp = McpEndpoint(mcp or None, self, max_response=max_response) \
            if mcp is not None else None
        self._reaper: asyncio.Task[None] | None = None
        self._starting = Starting()  # the runs being started, by what could join them
        self.requests = 0
        self.closed = False

    # -- lifecycle

    async def startup(self) -> None:
        self._responder.open()
        if self.mcp is not None:
            self.mcp.open()
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
        await self._responder.close()
        if self.mcp is not None:
            await self.mcp.close()

    def close_all(self, why: str) -> None:
        for run in self.registry.open_runs():
            if run is not self.single or self.mode != "replay":  # a replay writes nothing
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
        ex = Exchange(scope["method"], scope["path"])
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

    async def _answer_error(self, send: Send, ex: Exchange, err: ProxyError) -> None:
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

    async def _http(self, scope: Scope, receive: Receive, send: Send, ex: Exchange) -> None:
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
        if self.mcp is not None and is_mcp_path(ex.path):  # an MCP client's: deja.proxy._mcp
            await self.mcp.handle(ex, named, headers, body, receive, send)
            return
        ex.path = upstream_path(self.upstream, ex.path)  # /messages is /v1/messages
        query = scope.get("query_string") or b""
        url = self.upstream + ex.path + (f"?{query.decode('latin-1')}" if query else "")
        request = HttpRequest(ex.method, url, forwardable(headers), body)
        parsed: Any = None
        keys: list[str] | None = None
        provider = for_url(ex.method, url)
        if provider is not None:
            parsed, keys = await off_loop(len(body), self._read_model_request, provider, body,
                                          ex)
        previous = parsed.get("previous_response_id") if isinstance(parsed, dict) else None
        run = await self._route(named, headers, keys, ex,
                                previous if isinstance(previous, str) else None)
        ex.run = run.run_id
        run.in_flight += 1
        run.used = time.monotonic()
        try:
            await self._exchange(run, request, (provider, parsed, keys, _retry(named)),
                                 receive, send, ex)
        finally:
            run.in_flight -= 1
            run.used = time.monotonic()

    async def _health(self, send: Send, ex: Exchange) -> None:
        body = json.dumps({"ok": True, "mode": self.mode, "runs_open": len(self.registry),
                           "requests": self.requests}).encode()
        ex.status = 200
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _body(self, receive: Receive, named: dict[str, str]) -> bytes:
        """The request's body (:func:`recorder.serving.read_body`), refused in the
        provider's shape: 413 over ``max_body``, 408 stalled for ``body_timeout``."""
        try:
            return await read_body(receive, named, limit=self.max_body,
                                   timeout=self.body_timeout)
        except BodyTooLarge:
            raise ProxyError(413, "request_too_large",
                             f"deja proxy: the request body is over the proxy's limit of "
                             f"{self.max_body} bytes (deja proxy --max-body)") from None
        except BodyStalled:
            raise ProxyError(408, "request_timeout",
                             f"deja proxy: the request body stalled: nothing came for "
                             f"{self.body_timeout:g} s (deja proxy --body-timeout)") from None
        except ClientLeft:
            raise ClientGone("the client went away while sending its request") from None

    def _read_model_request(self, provider: Provider, body: bytes,
                            ex: Exchange) -> tuple[Any, list[str] | None]:
        parsed, problem, texts = self._reader.read(body, provider.history_field)
        if not isinstance(parsed, dict):
            what = problem or ("is not JSON" if parsed is not None or body else "is empty")
            if isinstance(parsed, (list, str, int, float, bool)) or (parsed is None and body):
                what = problem or "is not a JSON object"
            raise ProxyError(400, "invalid_request_error",
                             f"deja proxy: the body of {ex.method} {ex.path} {what}; a model "
                             "request is a JSON object. Nothing was sent upstream")
        items = conversation_items(parsed, provider)
        if items is None:
            return parsed, None
        # the body's texts are those of its history: the conversation's items when they are
        # the list its provider names (else, as for an input that is one string, by JSON)
        history = provider.history_field(parsed)
        known = texts[1] if texts and history is not None and items is parsed.get(history) \
            else None
        return parsed, message_keys(items, known)

    async def _route(self, named: dict[str, str], headers: list[tuple[str, str]],
                     keys: list[str] | None, ex: Exchange,
                     previous: str | None = None) -> ProxyRun:
        if self.single is not None:
            return self.single
        name = named.get(RUN_HEADER)
        if name is not None and not RUN_NAME.match(name):
            raise ProxyError(400, "invalid_request_error",
                             f"deja proxy: {RUN_HEADER} must be 1-128 letters, digits and "
                             "_ . : @ -, starting with a letter or digit")
        who = credential(headers)
        retry = _retry(named)
        run = self.registry.find(who, name, keys if name is None else None, retry, previous)
        if run is None and name is None and keys is not None:
            run = self.registry.waiting()  # its agent opened an MCP session first
            if run is not None:
                run.who = who
        if run is not None:
            return run
        assert self._new_run is not None
        # two requests never start one run twice; other conversations start theirs at once
        async with self._starting.of(start_key(who, name, keys if name is None else None)):
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

    async def _exchange(self, run: ProxyRun, request: HttpRequest,
                        model: tuple[Provider | None, Any, list[str] | None, bool | None],
                        receive: Receive, send: Send, ex: Exchange) -> None:
        """Hand one request to its run: ``model`` is its provider, parsed body, message
        keys (None for each: not a model call) and whether the client says it retries."""
        provider, parsed, keys, retry = model
        if run.logging.locked():  # a large line of this run is being written: it goes first
            async with run.logging:
                pass
        if run.stopped is not None:
            raise _stop_error(run, run.stopped)
        if run.closed and run is not self.single:
            raise ProxyError(400, "invalid_request_error",
                             f"deja proxy: run {run.run_id} is closed")
        reading: Reading | None = None
        try:
            rec = run.recording
            if provider is not None and isinstance(parsed, dict):
                reading = self._results(run, rec, provider, parsed, keys, request, retry)
            if reading is not None and rec is not None:
                boundary(run, rec, reading)
            elif reading is not None and run.recorded:
                check_results(run, reading)
            writer = None if run.session.consults_log else run.session.recorder()
            if writer is not None:  # a recording: the body is read for the log later
                writer.before_call(request)
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
        run.model = run.model or provider is not None
        dialogue = follow(run, reading)
        if run.following is not None:
            run.following.answered(served is not None)
        if served is not None:
            await self._responder.serve(run, served, send, ex)
        else:
            await self._responder.forward(run, run.recording, request, receive, send, ex)
        if dialogue is not None:  # a repeat of an answered request is no retry of it
            dialogue.settled = ex.answered

    @staticmethod
    def _results(run: ProxyRun, rec: Any, provider: Provider, parsed: dict[str, Any],
                 keys: list[str] | None, request: HttpRequest,
                 retry: bool | None) -> Reading | None:
        """The request's tool results, read by its provider, with their ids in the run;
        in a fork, the edited ones put in place, and in a replay-then-live the tool
        policy's answers (in a copy of the body: the reader keeps the messages it parsed).
        Every one is read where every one counts: edited, or checked against a served
        run's recording."""
        following, policy = run.following, run.policy
        if run.edits or (policy is not None and policy.tools.rules):
            parsed = copy.deepcopy(parsed)  # it may be edited
        served = rec is None or (following is not None and following.serving)
        reading = read_results(run, parsed, keys, provider, retry=retry,
                               whole=bool(run.edits) or (served and bool(run.recorded)))
        if reading is not None and policy is not None:
            policy.take(run, reading)  # it may leave the recording; the policy's answers
        if reading is not None and run.edits:
            request.body = substitute(reading, run.edits, request.body, run.edit_errors)
        return reading

    # -- what the MCP endpoint asks of the proxy

    async def mcp_run(self, named: dict[str, str], headers: list[tuple[str, str]],
                      ex: Exchange) -> ProxyRun:
        """The run a new MCP session joins: the one run of a served proxy; the open run
        its ``x-deja-run`` names, else the one used last; else a new one."""
        if self.single is not None:
            return self.single
        found = self.registry.latest(named.get(RUN_HEADER))
        return found if found is not None else await self._route(named, headers, None, ex)

    def stop_run(self, run: ProxyRun, stop: RunStopped) -> None:
        self._stopped(run, stop)

    async def end_run(self, run: ProxyRun, why: str) -> None:
        await asyncio.to_thread(self._close, run, why)

    def _stopped(self, run: ProxyRun, stop: RunStopped) -> None:
        """A guard stopped the run (or a replay reached the recorded stop): close it."""
        run.stopped = stop
        self._close(run, stop.reason, error=stop)
        log.warning("run %s stopped: %s", run.run_id, stop)


def _retry(named: dict[str, str]) -> bool | None:
    """Whether the client says a request is a retry (the SDKs' ``x-stainless-retry-count``
    above 0); None when it does not say."""
    count = named.get("x-stainless-retry-count", "")
    return (count != "0") if count.isdigit() else None


def _writer_of(run: ProxyRun) -> Any:
    """The session that writes ``run`` (a fork's, even while it serves its prefix)."""
    return run.session.recorder()


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
