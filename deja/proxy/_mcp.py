"""MCP servers through the proxy: ``deja proxy --mcp URL``.

An agent in any language whose MCP client speaks Streamable HTTP (:mod:`deja.proxy._mcp_wire`)
points it at the proxy's ``/mcp`` instead of the server. Each request it sends is an
:class:`recorder.capture.mcp.McpCall` handed to its run's session exactly as the in-process
capture hands one over (``mcp_answer``, then ``mcp_log``), so the lines are the same: a
``tools/call`` is a ``tool`` line with an ``mcp`` field (the server's URL and transport,
the name and version it gave, whether the tool is destructive, the notifications that came
with the answer), any other request an ``mcp`` line. JSON-RPC ids and session ids are never
stored: an answer the proxy serves carries the id the client sent now, and every client
session gets an id the proxy mints (mapped to the server's own while one is open).

- **record**: every message goes on to the server, its answer (JSON, or a stream of
  events passed on event by event) back to the client, and the exchange is logged before
  the client has the answer;
- **replay**: the session serves every request from the cassette and the server is never
  contacted; a request it does not hold is a divergence, answered as a JSON-RPC error;
- **fork**, **replay then live**: served while the cassette answers; the first request
  that goes live opens a session with the server then, saying to it what the client was
  served (its own ``initialize``, then the notifications it sent meanwhile), and from
  there passes messages through as a recording does. The tool policy is the session's: a
  destructive tool is answered from the recording or refused, never sent, unless named live.

A client's notifications and its answers to the server's requests go on to the server
while a session with it is open (else a notification is held for a late handshake). A
request the server makes of the client while a call is pending (sampling, elicitation) is
kept among the call's notifications with the client's answer, as the in-process capture
keeps one; a served call does not ask the client again. A GET
opens the server's own stream while a session with it is open (405 otherwise, which
clients take as "no such stream"); its notifications join the next request's line. A
DELETE ends the session, and a recorded run that only talked MCP ends with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import aiohttp
import yarl

from deja.proxy._mcp_wire import (
    EVENT_STREAM,
    SESSION_HEADER,
    accepts_stream,
    answer_in,
    client_headers,
    diverged,
    divergence_data,
    media_type,
    parsed,
    rpc_answer,
    rpc_body,
    rpc_error,
    rpc_kind,
    sse_event,
    sse_events,
    until_gone,
    upstream_headers,
)
from deja.proxy.runs import ProxyRun
from recorder.capture.mcp import TOOLS_CALL, McpCall, McpReply, McpSeam
from recorder.capture.mcp.calls import (
    answered,
    destructive,
    is_server_request,
    notification,
    server_request,
    without_meta,
)
from recorder.capture.session import Timing
from recorder.errors import CircuitOpen, DejaError, Divergence, RunStopped

if TYPE_CHECKING:
    from deja.proxy._respond import Exchange, Receive, Send
    from deja.proxy.app import Proxy

__all__ = ["MCP_PATH", "McpEndpoint", "is_mcp_path", "recorded_server"]

log = logging.getLogger("deja.proxy")

MCP_PATH = "/mcp"
TRANSPORT = "http"  # as the in-process capture names Streamable HTTP
DEJA_ERROR = -32000  # JSON-RPC's range for a server's own errors: deja's refusals
HANDSHAKE_ID = "deja-handshake"
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def is_mcp_path(path: str) -> bool:
    """Is ``path`` the proxy's MCP endpoint?"""
    return path.rstrip("/") == MCP_PATH


def recorded_server(observations: Sequence[Mapping[str, Any]]) -> str | None:
    """The URL of the Streamable HTTP server a recording's MCP lines name, if any."""
    for obs in observations:
        server = (obs.get("mcp") or {}).get("server") or {}
        if server.get("transport") == TRANSPORT and isinstance(server.get("url"), str):
            return str(server["url"])
    return None


class McpFailure(Exception):
    """A request the endpoint answers itself with a JSON-RPC error (and an HTTP status)."""

    def __init__(self, status: int, message: str, *, data: Any = None,
                 code: int = DEJA_ERROR) -> None:
        super().__init__(message)
        self.status, self.message, self.data, self.code = status, message, data, code


@dataclass(eq=False)
class McpSession:
    """One client session with the proxy: its run, the server as its lines name it, what
    the server said of its tools, and the session with the server, once one is open."""

    id: str
    run: ProxyRun
    server: dict[str, Any]
    tools: dict[str, bool] = field(default_factory=dict)  # listed tool -> destructive
    handshake: dict[str, Any] | None = None  # the client's initialize, served
    held: list[bytes] = field(default_factory=list)  # its notifications, not yet sent on
    opened: bool = False  # a session with the server is open
    upstream: str | None = None  # the server's id for it
    opening: asyncio.Lock = field(default_factory=asyncio.Lock)
    pending: list[list[dict[str, Any]]] = field(default_factory=list)  # notes in flight
    asked: dict[Any, dict[str, Any]] = field(default_factory=dict)  # its requests, by id
    backlog: list[dict[str, Any]] = field(default_factory=list)  # notes no request claimed

    def learn(self, method: str, result: Any) -> None:
        """What an answer says of the server: its name and version, its tools."""
        result = result if isinstance(result, dict) else {}
        info = result.get("serverInfo") if method == "initialize" else None
        if isinstance(info, dict):
            self.server.update({k: str(info[k]) for k in ("name", "version") if info.get(k)})
        for tool in result.get("tools") or () if method == "tools/list" else ():
            if isinstance(tool, dict):
                self.tools[str(tool.get("name"))] = destructive(tool.get("annotations"))

    def call(self, method: str, params: Mapping[str, Any]) -> McpCall:
        """A request of the client as the run's session takes it (a tool never listed is
        taken as destructive, as the specification's defaults say)."""
        name = params.get("name")
        return McpCall(dict(self.server), method, without_meta(params),
                       destructive=method == TOOLS_CALL and self.tools.get(str(name), True))

    def note(self, message: Mapping[str, Any]) -> None:
        """A notification from the server's own stream: it joins the oldest request in
        flight, else the next one made."""
        method = message.get("method")
        if not isinstance(method, str) or method == "notifications/cancelled":
            return
        (self.pending[0] if self.pending else self.backlog).append(
            notification(method, message.get("params")))


class McpEndpoint:
    """The proxy's ``/mcp``: MCP client sessions, each of one run of ``host``, carried to
    the server at ``url`` (None: none to go live to; a replay needs none)."""

    def __init__(self, url: str | None, host: Proxy, *, max_response: int) -> None:
        self.url = url
        self.host = host
        self.max_response = max_response
        self.sessions: dict[str, McpSession] = {}
        self.client: aiohttp.ClientSession | None = None

    def open(self) -> None:
        self.client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=None),
            trust_env=False)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    # -- a request

    async def handle(self, ex: Exchange, named: dict[str, str], headers: list[tuple[str, str]],
                     body: bytes, receive: Receive, send: Send) -> None:
        """One HTTP request to ``/mcp``: a message posted, the server's stream asked for,
        or the session ended."""
        message: Any = None
        try:
            if ex.method == "POST":
                message = parsed(body.decode("utf-8", "replace")) if body else None
                await self._post(ex, named, headers, body, message, send)
            elif ex.method == "GET":
                await self._stream(ex, named, headers, receive, send)
            elif ex.method == "DELETE":
                await self._end(ex, named, headers, send)
            else:
                raise McpFailure(405, f"deja proxy: {ex.method} is not an MCP request")
        except McpFailure as failure:
            rid = message.get("id") if isinstance(message, dict) else None
            ex.note = failure.message[:200]
            await self._send(send, ex, failure.status, rpc_body(rpc_error(
                rid, failure.code, failure.message, failure.data)), None)

    async def _post(self, ex: Exchange, named: dict[str, str], headers: list[tuple[str, str]],
                    body: bytes, message: Any, send: Send) -> None:
        kind = rpc_kind(message)
        if kind is None:
            raise McpFailure(400, "deja proxy: the body is not a JSON-RPC message (a batch is "
                                  "not taken: send one message per request)", code=-32600)
        assert isinstance(message, dict)
        if kind == "request" and message["method"] == "initialize":
            session = await self._new_session(named, headers, ex)
        else:
            session = self._session_of(named)
        ex.run = session.run.run_id
        with _busy(session.run):
            if kind == "request":
                await self._request(session, message, named, headers, body, ex, send)
            elif session.opened:
                if kind == "response" and message["id"] in session.asked:  # its answer
                    error = message.get("error")
                    answered(session.asked.pop(message["id"]), message.get("result"),
                             error if isinstance(error, dict) else None)
                await self._pass(session, "POST", headers, body, ex, send)
            else:  # no session with the server (yet): a notification waits for one
                if kind == "notification":
                    session.held.append(body)
                await self._send(send, ex, 202, b"", session.id)

    async def _new_session(self, named: dict[str, str], headers: list[tuple[str, str]],
                           ex: Exchange) -> McpSession:
        run = await self.host.mcp_run(named, headers, ex)
        session = McpSession(secrets.token_hex(16), run, {"transport": TRANSPORT,
                                                          "url": self.url or ""})
        self.sessions[session.id] = session
        run.mcp = True
        run.mcp_sessions.add(session.id)
        return session

    def _session_of(self, named: dict[str, str]) -> McpSession:
        given = named.get(SESSION_HEADER)
        if given is None:
            raise McpFailure(400, f"deja proxy: no {SESSION_HEADER} header: a session starts "
                                  "with initialize", code=-32600)
        session = self.sessions.get(given)
        if session is None:
            raise McpFailure(404, f"deja proxy: no MCP session {given}: it ended, or another "
                                  "proxy started it; start a new one with initialize")
        return session

    async def _request(self, session: McpSession, message: dict[str, Any],
                       named: dict[str, str], headers: list[tuple[str, str]], body: bytes,
                       ex: Exchange, send: Send) -> None:
        """A request: answered by the run's session (served, or its tool policy's answer),
        else sent to the server and logged."""
        method = message["method"]
        params = _params(message)
        call = session.call(method, params)
        run = session.run
        if method == TOOLS_CALL:
            run.called_over_mcp(params.get("name"), params.get("arguments"))
        if run.stopped is not None or (run.closed and run is not self.host.single):
            raise McpFailure(400, f"deja: run {run.run_id} is "
                                  f"{'stopped' if run.stopped else 'closed'}; start a new "
                                  "MCP session")
        try:
            reply = _seam(run).mcp_answer(call)
        except RunStopped as exc:
            self.host.stop_run(run, exc)
            raise McpFailure(400, f"deja: run {run.run_id} was stopped by the harness "
                                  f"({exc.reason}): {exc}") from None
        except Divergence as exc:
            log.warning("run %s: %s", run.run_id, exc)
            raise McpFailure(200, diverged(exc), data=divergence_data(exc)) from None
        except (CircuitOpen, DejaError) as exc:
            raise McpFailure(200, f"deja: {exc}") from None
        if reply is not None:
            if method == "initialize":
                session.handshake = dict(params)
            session.learn(method, reply.result)
            await self._serve(session, message, reply, named, ex, send)
            return
        await self._go_live(session, headers)
        await self._forward(session, call, message, headers, body, ex, send)

    # -- served answers

    async def _serve(self, session: McpSession, message: dict[str, Any], reply: McpReply,
                     named: dict[str, str], ex: Exchange, send: Send) -> None:
        """A reply from the cassette, with the id the client sent now: its recorded
        notifications first, as events of a stream (progress with the request's token),
        when it has any and the client takes a stream; else a JSON answer."""
        answer = rpc_answer(message["id"], reply.result, reply.error)
        token = (_params(message).get("_meta") or {}).get("progressToken")
        events = []
        for note in reply.notifications:
            method = str(note.get("method", ""))
            if is_server_request(note) or (method == "notifications/progress"
                                           and token is None):
                continue  # the server's request (its answer is in the reply), or progress
                # nobody asked for
            note_params = dict(note.get("params") or {})
            if method == "notifications/progress":
                note_params = {"progressToken": token, **note_params}
            events.append({"jsonrpc": "2.0", "method": method,
                           **({"params": note_params} if note_params else {})})
        ex.note = "replayed"
        if events and accepts_stream(named):
            stream = b"".join(sse_event(e) for e in [*events, answer])
            await self._send(send, ex, 200, stream, session.id, EVENT_STREAM)
        else:
            await self._send(send, ex, 200, rpc_body(answer), session.id)

    async def _send(self, send: Send, ex: Exchange, status: int, body: bytes,
                    session: str | None, content_type: str = "application/json") -> None:
        headers = [(b"content-length", str(len(body)).encode())]
        if body:
            headers.append((b"content-type", content_type.encode()))
        if session is not None:
            headers.append((SESSION_HEADER.encode(), session.encode()))
        ex.status, ex.started = status, True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    # -- the server

    def _target(self) -> yarl.URL:
        if not self.url:
            raise McpFailure(502, "deja proxy: this call goes live, and there is no MCP server "
                                  "to send it to: give deja proxy --mcp URL")
        return yarl.URL(self.url)

    async def _send_on(self, method: str, headers: list[tuple[str, str]],
                       body: bytes = b"") -> aiohttp.ClientResponse:
        """A request to the server (its response open: the caller reads and releases it)."""
        assert self.client is not None
        try:
            return await self.client.request(method, self._target(), headers=headers,
                                             data=body or None, allow_redirects=False)
        except UPSTREAM_ERRORS as exc:
            raise McpFailure(502, f"deja proxy: the MCP server {self.url} could not be "
                                  f"reached ({type(exc).__name__}: {exc})") from None

    async def _go_live(self, session: McpSession, headers: list[tuple[str, str]]) -> None:
        """A session with the server, opened now if the client's was served so far: the
        client's own ``initialize`` said to it, then the notifications it sent."""
        if session.opened:
            return
        async with session.opening:
            if session.opened:
                return
            if session.handshake is not None:
                hello = rpc_body({"jsonrpc": "2.0", "id": HANDSHAKE_ID, "method": "initialize",
                                  "params": session.handshake})
                response = await self._send_on("POST", upstream_headers(
                    headers, None, handshake=True), hello)
                try:
                    answer = await self._answer_of(response, HANDSHAKE_ID, [])
                finally:
                    response.release()
                if answer is None or "error" in answer:
                    raise McpFailure(502, f"deja proxy: the MCP server {self.url} refused the "
                                          f"handshake: {(answer or {}).get('error')}")
                session.upstream = response.headers.get(SESSION_HEADER)
                log.info("MCP session %s: live from here; the handshake it was served was "
                         "said to the server at %s", session.id, self.url)
            session.opened = True
            for held in session.held:
                response = await self._send_on("POST", upstream_headers(
                    headers, session.upstream), held)
                response.release()
            session.held.clear()

    async def _answer_of(self, response: aiohttp.ClientResponse, rid: Any,
                         notes: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The answer to request ``rid`` in a whole response (JSON, or a stream read to its
        end), the notifications before it added to ``notes``."""
        if media_type(list(response.headers.items())) == EVENT_STREAM:
            async for _, message in sse_events(response.content.iter_any(), self.max_response):
                found = answer_in(message, rid, notes)
                if found is not None:
                    return found
            return None
        body = await response.content.read(self.max_response + 1)
        if len(body) > self.max_response:
            raise McpFailure(502, f"deja proxy: the MCP server's answer is over "
                                  f"{self.max_response} bytes (deja proxy --max-response)")
        message = parsed(body.decode("utf-8", "replace")) if body else None
        for item in message if isinstance(message, list) else [message]:
            found = answer_in(item, rid, notes)
            if found is not None:
                return found
        return None

    async def _forward(self, session: McpSession, call: McpCall, message: dict[str, Any],
                       headers: list[tuple[str, str]], body: bytes, ex: Exchange,
                       send: Send) -> None:
        """A request sent to the server as the client sent it (its id too), the answer
        passed back (a stream event by event), the exchange logged before the answer
        reaches the client."""
        notes, session.backlog = session.backlog, []
        session.pending.append(notes)
        start, t0 = time.time(), time.perf_counter()
        try:
            response = await self._send_on("POST", upstream_headers(headers, session.upstream),
                                           body)
            try:
                if call.method == "initialize":
                    session.opened = True
                    session.upstream = response.headers.get(SESSION_HEADER)
                logged = _Logged(self, session, call, message["id"], notes, start, t0)
                if response.status == 200 and \
                        media_type(list(response.headers.items())) == EVENT_STREAM:
                    await self._relay(response, session, logged, ex, send)
                else:
                    await self._whole(response, session, logged, ex, send)
            finally:
                response.release()
        finally:
            session.pending.remove(notes)

    async def _whole(self, response: aiohttp.ClientResponse, session: McpSession,
                     logged: _Logged, ex: Exchange, send: Send) -> None:
        """A whole (JSON) answer: logged, then passed back."""
        body = await response.content.read(self.max_response + 1)
        if len(body) > self.max_response:
            raise McpFailure(502, f"deja proxy: the MCP server's answer is over "
                                  f"{self.max_response} bytes (deja proxy --max-response)")
        message = parsed(body.decode("utf-8", "replace")) if body else None
        answer = next((m for m in (message if isinstance(message, list) else [message])
                       if answer_in(m, logged.rid, logged.notes) is not None), None)
        if answer is None and response.status >= 400:  # refused over HTTP: an error reply
            answer = {"error": {"code": DEJA_ERROR, "message": f"HTTP {response.status}: "
                                f"{body[:500].decode('utf-8', 'replace')}"}}
        if answer is not None:
            logged.log(answer)
        ex.status, ex.started = response.status, True
        await send({"type": "http.response.start", "status": response.status,
                    "headers": client_headers(list(response.headers.items()), session.id,
                                              len(body))})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _relay(self, response: aiohttp.ClientResponse, session: McpSession,
                     logged: _Logged, ex: Exchange, send: Send) -> None:
        """A stream of events, passed on as each arrives: the notifications in it join the
        request's line, which is written before the event with the answer goes on."""
        ex.status, ex.started = 200, True
        await send({"type": "http.response.start", "status": 200,
                    "headers": client_headers(list(response.headers.items()), session.id,
                                              None)})
        try:
            async for raw, message in sse_events(response.content.iter_any(),
                                                 self.max_response):
                answer = answer_in(message, logged.rid, logged.notes)
                if answer is not None:
                    logged.log(answer)
                elif rpc_kind(message) == "request" and message["method"] != "ping":
                    asked = server_request(message["method"], message.get("params"))
                    session.asked[message["id"]] = asked  # the client's answer joins it
                    logged.notes.append(asked)
                await send({"type": "http.response.body", "body": raw, "more_body": True})
        except (ValueError, *UPSTREAM_ERRORS) as exc:
            ex.note = f"the MCP server's stream broke off: {exc}"
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pass(self, session: McpSession, method: str, headers: list[tuple[str, str]],
                    body: bytes, ex: Exchange, send: Send) -> None:
        """A message that is no request (a notification, an answer to the server's request)
        or a DELETE: sent on, its answer passed back whole, nothing logged."""
        response = await self._send_on(method, upstream_headers(headers, session.upstream),
                                       body)
        try:
            answer = await response.content.read(self.max_response)
        finally:
            response.release()
        ex.status, ex.started = response.status, True
        await send({"type": "http.response.start", "status": response.status,
                    "headers": client_headers(list(response.headers.items()), session.id,
                                              len(answer))})
        await send({"type": "http.response.body", "body": answer, "more_body": False})

    # -- the server's stream, and the end of a session

    async def _stream(self, ex: Exchange, named: dict[str, str],
                      headers: list[tuple[str, str]], receive: Receive, send: Send) -> None:
        """The server's own stream (GET), passed on while the client holds it; its
        notifications join the next request's line. Without a session with the server
        (a served one), there is none: 405."""
        session = self._session_of(named)
        ex.run = session.run.run_id
        if not session.opened:
            raise McpFailure(405, "deja proxy: the MCP session is served from a recording: "
                                  "there is no server stream")
        with _busy(session.run):
            response = await self._send_on("GET", upstream_headers(headers, session.upstream))
            try:
                if response.status != 200:
                    body = await response.content.read(self.max_response)
                    await self._send(send, ex, response.status, body, session.id,
                                     response.headers.get("content-type", "text/plain"))
                    return
                ex.status, ex.started = 200, True
                await send({"type": "http.response.start", "status": 200, "headers":
                            client_headers(list(response.headers.items()), session.id, None)})
                async for raw, message in sse_events(until_gone(response, receive),
                                                     self.max_response):
                    if rpc_kind(message) == "notification":
                        session.note(message)
                    await send({"type": "http.response.body", "body": raw, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except (ValueError, *UPSTREAM_ERRORS) as exc:
                ex.note = f"the MCP server's stream broke off: {exc}"
            finally:
                response.close()

    async def _end(self, ex: Exchange, named: dict[str, str], headers: list[tuple[str, str]],
                   send: Send) -> None:
        """DELETE: the session ends (with the server's too, if one is open); a recorded
        run that only talked MCP ends with its last session."""
        session = self._session_of(named)
        ex.run = session.run.run_id
        if session.opened and session.upstream is not None:
            with contextlib.suppress(McpFailure):  # the server may be gone: the end is ours
                await self._pass(session, "DELETE", headers, b"", ex, send)
        if not ex.started:
            await self._send(send, ex, 200, b"", None)
        self.sessions.pop(session.id, None)
        run = session.run
        run.mcp_sessions.discard(session.id)
        if not run.mcp_sessions and not run.model and run is not self.host.single:
            await self.host.end_run(run, "its last MCP session ended")


@dataclass
class _Logged:
    """One request sent to the server, logged once its answer comes."""

    endpoint: McpEndpoint
    session: McpSession
    call: McpCall
    rid: Any
    notes: list[dict[str, Any]]
    start: float
    t0: float

    def log(self, answer: Mapping[str, Any]) -> None:
        """The answer (a JSON-RPC result or error) learnt from and logged."""
        error = answer.get("error")
        reply = McpReply(result=answer.get("result"),
                         error=dict(error) if isinstance(error, dict) else None,
                         notifications=list(self.notes))
        self.session.learn(self.call.method, reply.result)  # the server as named now
        call = McpCall(dict(self.session.server), self.call.method, self.call.params,
                       self.call.destructive)
        timing = Timing(self.start, (time.perf_counter() - self.t0) * 1000)
        try:
            _seam(self.session.run).mcp_log(call, reply, timing)
        except DejaError as exc:
            log.error("run %s: an MCP exchange could not be logged: %s",
                      self.session.run.run_id, exc)


def _params(message: Mapping[str, Any]) -> dict[str, Any]:
    params = message.get("params")
    return params if isinstance(params, dict) else {}


def _seam(run: ProxyRun) -> McpSeam:
    """The run's session as an MCP connection asks it (every session a proxy runs takes
    MCP requests: a recording, a replay, a run that continues another)."""
    return cast("McpSeam", run.session)


@contextlib.contextmanager
def _busy(run: ProxyRun) -> Any:
    """A request of ``run`` in flight: an idle run is one with none."""
    run.in_flight += 1
    run.used = time.monotonic()
    try:
        yield
    finally:
        run.in_flight -= 1
        run.used = time.monotonic()
