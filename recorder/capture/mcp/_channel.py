"""One connection to an MCP server while a deja session is active: a channel.

An MCP transport (``stdio_client``, ``streamable_http_client``) hands the client session a
pair of streams of JSON-RPC messages. deja's version of each transport hands it a channel's
pair instead:

- **recording**: the server starts as without deja and the channel's streams pass every
  message through, watching them: which request id is which call, which server
  notifications arrive while it is pending (progress is the request's by its token), and
  which requests the server makes of the client meanwhile (sampling, elicitation, roots),
  with the answer the client's callback gave;
- **replay, fork, resume**: the server is not started. Each request is answered from the
  log where the session has the answer; the first request the log does not answer (the live
  part of a fork) starts the server then, in a task of the channel's own, replays the
  handshake the client was served (``initialize`` with the client's own params, then the
  notifications it sent meanwhile) and from there passes messages through as a recording
  does. A replay never asks, so its server never runs and its command need not exist;
  nor does it ask the client's sampling or elicitation callback what the recording's
  server asked it: no server asks, and the recorded answer comes with the call's.

Each request itself is decided in the client's own task, where the SDK sends it
(``JSONRPCDispatcher.send_raw_request``, see :mod:`._patch`): a guard's stop or a
``Divergence`` is raised to the agent there, as from an HTTP call, and the line is
written before the answer reaches the agent.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import anyio
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp_types import (
    SERVER_INFO_META_KEY,
    JSONRPCError,
    JSONRPCNotification,
    JSONRPCRequest,
    JSONRPCResponse,
)

from recorder.capture import session as _session
from recorder.capture.mcp.calls import (
    URL_TRANSPORTS,
    McpCall,
    McpReply,
    McpSeam,
    answered,
    carry,
    destructive,
    is_server_request,
    notification,
    server_request,
    without_meta,
)
from recorder.capture.session import Timing

log = logging.getLogger("deja.recorder")

Opener = Callable[[], AbstractAsyncContextManager[Any]]
HANDSHAKE_SECONDS = 60.0  # how long a server started late may take to answer the handshake


@dataclass
class _Exchange:
    """A request on its way: its method, its id once sent, and the notifications that
    arrived for it."""

    method: str
    notes: list[dict[str, Any]] = field(default_factory=list)
    request_id: Any = None


# The exchange the client's task is sending: the write stream learns its id from it.
_sending: contextvars.ContextVar[_Exchange | None] = contextvars.ContextVar(
    "deja_mcp_sending", default=None)

# Channels by the write stream the client was handed (the dispatcher keeps it).
_channels: dict[int, Channel] = {}


def channel_of(write_stream: Any) -> Channel | None:
    return _channels.get(id(write_stream))


class _Stream:
    """A stream handed to the client in place of ``inner``: closing it closes ``inner``."""

    def __init__(self, inner: Any, channel: Channel) -> None:
        self._inner, self._channel = inner, channel

    def close(self) -> None:
        self._inner.close()

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Send(_Stream):
    """The client's write stream: each message goes on to ``inner`` and is seen first."""

    async def send(self, item: Any) -> None:
        self._channel.sent(item)
        await self._inner.send(item)


class _Receive(_Stream):
    """The client's read stream in a recording: each message read from the server's
    stream is seen, then handed over (with the context it was sent in)."""

    last_context: contextvars.Context | None = None

    async def receive(self) -> Any:
        item = await self._inner.receive()
        self.last_context = getattr(self._inner, "last_context", None)
        self._channel.received(item)
        return item

    def __aiter__(self) -> _Receive:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


class Channel:
    """One MCP connection: what the server is, what its requests are, and whether (and
    when) the real transport runs."""

    def __init__(self, seam: McpSeam, server: dict[str, Any]) -> None:
        self.seam, self.server = seam, server
        self.lazy = False
        self._pending: dict[Any, _Exchange] = {}
        self._backlog: list[dict[str, Any]] = []  # notifications no request claimed
        self._asked: dict[Any, dict[str, Any]] = {}  # the server's requests, by their id
        self._tools: dict[str, bool] = {}  # the listed tools: destructive or not
        self._handshake: Mapping[str, Any] | None = None  # the initialize it was served
        self._held: list[tuple[str, Any]] = []  # notifications sent while not started
        self.read: Any = None
        self.write: Any = None

    # -- the streams

    def attach(self, streams: Any) -> tuple[Any, ...]:
        """A recording: the server's streams, watched."""
        self.read, self.write = _Receive(streams[0], self), _Send(streams[1], self)
        return (self.read, self.write, *tuple(streams)[2:])

    def defer(self) -> tuple[Any, Any]:
        """A replay or a continuing run: streams of the channel's own; the server starts
        the first time a request is not answered from the log (:meth:`pump`)."""
        self.lazy = True
        self._inbox, self.read = anyio.create_memory_object_stream[Any](0)
        outbox, self._outbox = anyio.create_memory_object_stream[Any](math.inf)
        self.write = _Send(outbox, self)
        self._wanted, self._opened = anyio.Event(), anyio.Event()
        self._failure: Exception | None = None
        self._closing = False
        return self.read, self.write

    @contextlib.contextmanager
    def registered(self) -> Iterator[None]:
        """While the client holds the streams: findable by its write stream."""
        _channels[id(self.write)] = self
        try:
            yield
        finally:
            _channels.pop(id(self.write), None)

    @contextlib.contextmanager
    def carrying(self) -> Iterator[None]:
        """While the transport runs (its last requests included: the end of a stream, a
        session's DELETE), an HTTP server's own traffic is no step of the run."""
        url = self.server.get("url") if self.server.get("transport") in URL_TRANSPORTS \
            else None
        origin = self.server.get("transport") == "sse"  # it posts where the server says
        if url:
            carry(url, True, origin=origin)
        try:
            yield
        finally:
            if url:
                carry(url, False, origin=origin)

    def sent(self, item: Any) -> None:
        """A message the client writes: a request names its exchange by its id, an answer
        to a request of the server's joins that request."""
        exchange = _sending.get()
        message = getattr(item, "message", None)
        if isinstance(message, JSONRPCResponse | JSONRPCError):
            asked = self._asked.pop(message.id, None)
            if asked is not None:
                error = message.error.model_dump(mode="json", exclude_none=True) \
                    if isinstance(message, JSONRPCError) else None
                answered(asked, getattr(message, "result", None), error)
        elif exchange is not None and exchange.request_id is None \
                and isinstance(message, JSONRPCRequest) and message.method == exchange.method:
            exchange.request_id = message.id
            self._pending[message.id] = exchange

    def received(self, item: Any) -> None:
        """A message from the server: a notification, or a request of the client's (not a
        ping), joins the request it is for (by its progress token, else the oldest
        pending), or the next request made."""
        message = getattr(item, "message", None)
        if isinstance(message, JSONRPCRequest) and message.method != "ping":
            note = server_request(message.method, message.params)
            self._asked[message.id] = note
        elif isinstance(message, JSONRPCNotification) \
                and message.method != "notifications/cancelled":
            note = notification(message.method, message.params)
        else:
            return
        exchange = self._pending.get((message.params or {}).get("progressToken"))
        if exchange is None and self._pending:
            exchange = next(iter(self._pending.values()))
        (exchange.notes if exchange is not None else self._backlog).append(note)

    # -- requests

    async def request(self, send: Callable[..., Any], method: str,
                      params: Mapping[str, Any] | None, opts: Mapping[str, Any],
                      related: Any) -> dict[str, Any]:
        """One request of the client: served by the session, or sent and logged."""
        call = McpCall(self.server, method, without_meta(params),
                       destructive=method == "tools/call"
                       and self._tools.get(str((params or {}).get("name")), True))
        reply = self.seam.mcp_answer(call)
        if reply is not None:
            if method == "initialize":
                self._handshake = dict(params or {})
            self._learn(method, reply)
            await self._deliver(reply, opts)
            return _outcome(reply)
        await self.ensure_open()
        exchange = _Exchange(method, self._backlog)
        self._backlog = []
        token = _sending.set(exchange)
        start, t0 = time.time(), time.perf_counter()
        try:
            raw = await send(method, params, opts, _related_request_id=related)
        except MCPError as exc:
            reply = McpReply(error=exc.error.model_dump(mode="json", exclude_none=True),
                             notifications=exchange.notes)
            self._log(call, reply, start, t0)
            raise
        finally:
            _sending.reset(token)
            self._pending.pop(exchange.request_id, None)
        self._log(call, McpReply(result=raw, notifications=exchange.notes), start, t0)
        return raw

    def _log(self, call: McpCall, reply: McpReply, start: float, t0: float) -> None:
        self._learn(call.method, reply)
        logged = McpCall(dict(self.server), call.method, call.params, call.destructive)
        self.seam.mcp_log(logged, reply, Timing(start, (time.perf_counter() - t0) * 1000))

    def hold(self, method: str, params: Any) -> bool:
        """A notification the client sends: held back (True) while the server has not
        started, to follow the handshake if it ever does."""
        if not self.lazy or self._opened.is_set():
            return False
        if method != "notifications/cancelled":
            self._held.append((method, params))
        return True

    def _learn(self, method: str, reply: McpReply) -> None:
        """What a reply says of the server: its name and version, and which of its tools
        are destructive (by their annotations; a tool never listed is)."""
        result = reply.result if isinstance(reply.result, dict) else {}
        info = result.get("serverInfo") if method == "initialize" else \
            (result.get("_meta") or {}).get(SERVER_INFO_META_KEY) \
            if method == "server/discover" else None
        if isinstance(info, dict):
            self.server.update({k: str(info[k]) for k in ("name", "version") if info.get(k)})
        for tool in result.get("tools") or () if method == "tools/list" else ():
            self._tools[str(tool.get("name"))] = destructive(tool.get("annotations"))

    async def _deliver(self, reply: McpReply, opts: Mapping[str, Any]) -> None:
        """The recorded notifications of a served reply, in order: progress to the call's
        progress callback, the others to the client as the server sent them. The server's
        requests of the client are not asked again: their answers are in the reply."""
        on_progress = opts.get("on_progress")
        for note in reply.notifications:
            if is_server_request(note):
                continue
            params = dict(note.get("params") or {})
            if note["method"] == "notifications/progress":
                if on_progress is not None:
                    await _progress(on_progress, params)
                continue
            if self.lazy:
                message = JSONRPCNotification(jsonrpc="2.0", method=note["method"],
                                              params=params or None)
                await self._inbox.send(SessionMessage(message))

    # -- the server, started late

    async def ensure_open(self) -> None:
        """Start the server now, if it is not running (a fork going live)."""
        if not self.lazy:
            return
        self._wanted.set()
        await self._opened.wait()
        if self._failure is not None:
            raise self._failure

    async def pump(self, opener: Opener) -> None:
        """The channel's task: wait until a request needs the server, start it, replay
        the handshake, then pass messages both ways until the client is done."""
        try:
            await self._wanted.wait()
            if self._closing:
                return
            async with opener() as streams:
                await self._replay_handshake(streams[0], streams[1])
                self._opened.set()
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(self._inbound, streams[0])
                    async for item in self._outbox:
                        await streams[1].send(item)
                    tasks.cancel_scope.cancel()
        except Exception as exc:  # noqa: BLE001 - the server did not start, or failed its handshake
            if self._opened.is_set():
                log.warning("MCP server %s: %s", self.server, exc)
            else:
                self._failure = exc
                self._opened.set()
        finally:  # cancelled or not: the channel's own streams end with it
            self._inbox.close()
            self._outbox.close()

    async def _replay_handshake(self, read: Any, write: Any) -> None:
        """Say to a server started late what the client was served as said: its
        ``initialize`` (awaiting the answer), then the notifications it sent meanwhile."""
        with anyio.fail_after(HANDSHAKE_SECONDS):
            if self._handshake is not None:
                request = JSONRPCRequest(jsonrpc="2.0", id="deja-handshake",
                                         method="initialize", params=dict(self._handshake))
                await write.send(SessionMessage(request))
                async for item in read:
                    message = getattr(item, "message", None)
                    if getattr(message, "id", None) == "deja-handshake":
                        if not isinstance(message, JSONRPCResponse):
                            raise MCPError.from_error_data(message.error)  # type: ignore[union-attr]
                        break
                else:
                    raise ConnectionError("the MCP server closed before it answered the "
                                          "handshake")
            for method, params in self._held:
                await write.send(SessionMessage(JSONRPCNotification(
                    jsonrpc="2.0", method=method, params=params)))

    async def _inbound(self, read: Any) -> None:
        """The server's messages, seen, to the client; its end is the client's end."""
        async for item in read:
            self.received(item)
            try:
                await self._inbox.send(item)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
        self._inbox.close()

    async def close(self) -> None:
        """The client is done: a pump that never started the server ends, one that did
        stops it."""
        if self.lazy:
            self._closing = True
            self._wanted.set()
            self.write.close()


async def _progress(on_progress: Callable[..., Any], params: Mapping[str, Any]) -> None:
    try:
        await on_progress(float(params.get("progress", 0.0)), params.get("total"),
                          params.get("message"))
    except Exception:  # as the SDK does: a callback's error does not fail the call
        log.exception("MCP progress callback raised")


def _outcome(reply: McpReply) -> dict[str, Any]:
    """A served reply as the SDK's request returns it: the result, or the error raised."""
    if reply.error is not None:
        raise MCPError(code=int(reply.error.get("code", -32603)),
                       message=str(reply.error.get("message", "")), data=reply.error.get("data"))
    return dict(reply.result or {})


def _active_seam() -> tuple[McpSeam, bool] | None:
    """The active session, if it takes MCP requests, and whether it consults a log."""
    current = _session.active()
    return (current, current.consults_log) if isinstance(current, McpSeam) else None


@contextlib.asynccontextmanager
async def connect(server: dict[str, Any], opener: Opener) -> AsyncIterator[Any]:
    """The streams an MCP transport hands its client while a deja session is active;
    the transport as it is otherwise."""
    active = _active_seam()
    if active is None:
        async with opener() as streams:
            yield streams
        return
    channel = Channel(active[0], server)
    if not active[1]:  # a recording: the server starts now, as it would
        with channel.carrying():
            async with opener() as real:
                streams = channel.attach(real)
                with channel.registered():
                    yield streams
        return
    streams = channel.defer()
    with channel.carrying():
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(channel.pump, opener)
            try:
                with channel.registered():
                    yield streams
            finally:
                await channel.close()
