"""``deja serve``: the HTTP API of runs out of the request cycle, as a raw ASGI app.

Every route speaks JSON::

    POST /runs                 a submission (command, cwd, labels, guards, run_id)
                               -> 201 {"run_id": "r_…", "status": "queued"}
    GET  /runs/{id}            the run's progress record and lifecycle status
    GET  /runs                 ?status=working&status=queued&label=team=billing
                               &schedule=NAME&limit=N -> {"runs": [...]}, newest first
    POST /runs/{id}/cancel     a queued run never starts; a working one stops at its
                               next boundary
    POST /runs/{id}/input      {"answer": "TEXT"}: resumes a run waiting on recorder.ask
    GET  /runs/{id}/events     server-sent events: ``event: status`` with the record as
                               data each time it changes, until the run has ended
    GET  /schedules            {"schedules": [...]}
    GET  /healthz              {"ok": true, ...}; 503 when the database cannot be reached
    POST /mcp                  MCP clients: runs as MCP tasks (:mod:`deja.runs.mcp_tasks`),
                               behind the same checks (:mod:`deja.runs.mcp_http`)

The API runs commands, so it answers deja's own commands and the scripts of the user who
owns the install, and no web page and no other user (:mod:`deja.runs.guard` has the rules):
``Host`` must name this server (421 ``MisdirectedRequest``), a browser's ``Origin`` must
be this server's own (403 ``ForeignOrigin``), every request but ``/healthz`` carries the
token as ``Authorization: Bearer TOKEN``, on loopback too (401 ``Unauthorized``; the
per-install token of :mod:`deja.runs.auth` unless ``--token`` names one), and a ``POST`` is
``Content-Type: application/json`` (415 ``UnsupportedMediaType``). No answer carries a
CORS header, and the preflight a browser would need is answered 405.

An error is a named JSON error, never a traceback:
``{"error": {"type": "NoSuchRun", "message": "..."}}`` with 404 (``NoSuchRun``,
``NoSuchSchedule``, ``NotFound``), 400 (``BadRunRequest``, ``BadSchedule``, ``BadJson``:
a body that is not strict JSON, nests over 32 deep, or holds a NUL or a lone surrogate),
401, 403, 405 (``MethodNotAllowed``), 413 (``BodyTooLarge``: a body is at most 1 MiB),
415, 421 and 503 (``DatabaseUnavailable``).

Each ``status`` event has an ``id:``, the version of the record it carries. A client
whose stream dropped reconnects with ``Last-Event-ID: ID`` (or ``?after=ID``): the stream
goes on from the first record that differs from that one instead of repeating it, and a
run that has ended since is answered 204 (nothing more will come; an ``EventSource``
stops there).

The database work of a request (a submission is one insert and one enqueue) runs in a
thread, off the event loop, so a slow request never holds the others. Bound to anything
but loopback, the server refuses to start without a token of its own (``--token``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from deja.runs.errors import BadRunRequest, BadSchedule, DatabaseUnavailable, NoSuchSchedule
from deja.runs.guard import ApiError, Guard, bad_text, parse_json, require_json, safe_headers
from deja.runs.store import ENDED
from recorder.errors import ConfigError, DejaError, NoSuchRun, UsageError
from recorder.serving import (
    BodyTooLarge,
    ClientLeft,
    bind,
    guarded_httptools,
    is_loopback,
    read_body,
    run_until_stopped,
    write_ready,
)

__all__ = ["MAX_BODY", "Api", "ApiError", "serve"]

log = logging.getLogger("deja.serve")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

MAX_BODY = 1024 * 1024
EVENTS_POLL = 0.5  # seconds between looks at a run whose events are streamed
KEEPALIVE = 15.0  # seconds between comments on an idle event stream
STATUS_OF: tuple[tuple[type[BaseException], int], ...] = (
    (NoSuchRun, 404), (NoSuchSchedule, 404), (BadRunRequest, 400), (BadSchedule, 400),
    (DatabaseUnavailable, 503), (UsageError, 400))


def error_of(exc: DejaError) -> ApiError:
    """The answer to a named error of deja's."""
    status = next((code for kind, code in STATUS_OF if isinstance(exc, kind)), 500)
    return ApiError(status, type(exc).__name__, str(exc))


def _route(method: str, path: str) -> tuple[str, str | None]:
    """The handler's name and the run id in the path; ApiError 404/405 otherwise."""
    parts = [p for p in path.split("/") if p]
    allowed: tuple[str, ...] = ()
    name = ""
    run: str | None = None
    if parts == ["runs"]:
        allowed, name = ("GET", "POST"), "list" if method == "GET" else "submit"
    elif len(parts) == 2 and parts[0] == "runs":
        allowed, name, run = ("GET",), "get", parts[1]
    elif len(parts) == 3 and parts[0] == "runs" and parts[2] in ("cancel", "input"):
        allowed, name, run = ("POST",), parts[2], parts[1]
    elif len(parts) == 3 and parts[0] == "runs" and parts[2] == "events":
        allowed, name, run = ("GET",), "events", parts[1]
    elif parts == ["schedules"]:
        allowed, name = ("GET",), "schedules"
    elif parts == ["healthz"]:
        allowed, name = ("GET",), "healthz"
    if not allowed:
        raise ApiError(404, "NotFound", f"no route {path}; deja serve offers /runs, "
                       "/runs/{id}, /runs/{id}/cancel, /runs/{id}/input, /runs/{id}/events, "
                       "/schedules, /healthz and /mcp")
    if method not in allowed:
        raise ApiError(405, "MethodNotAllowed", f"{method} {path} is not served; use "
                       f"{' or '.join(allowed)}", [(b"allow", ", ".join(allowed).encode())])
    return name, run


class Api:
    """The ASGI app over ``runs`` (a :class:`deja.runs.service.Runs`)."""

    def __init__(self, runs: Any, *, guard: Guard, max_body: int = MAX_BODY,
                 poll: float = EVENTS_POLL, stopping: Callable[[], bool] | None = None,
                 mcp: Any = None) -> None:
        self.runs = runs
        self.mcp = mcp  # the /mcp route (deja.runs.mcp_http.McpEndpoint), if served
        self.guard = guard
        self.max_body = max_body
        self.poll = poll
        self.stopping = stopping or (lambda: False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        t0 = time.perf_counter()
        method, path = scope["method"], scope["path"]
        state = {"status": 0, "started": False}

        async def sending(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                state["status"], state["started"] = message["status"], True
            await send(message)

        try:
            await self._http(scope, receive, sending)
        except ApiError as err:
            await self._error(sending, err, bool(state["started"]))
        except DejaError as exc:
            await self._error(sending, error_of(exc), bool(state["started"]))
        except Exception as exc:  # never a traceback to the client
            if _unreachable(exc):  # the engine's client lets its driver's errors through
                from deja.runs.store import unavailable

                failure = error_of(unavailable(self.runs.store.url, exc))
            else:
                log.exception("%s %s: unexpected error", method, path)
                failure = ApiError(500, "InternalError", f"deja serve: internal error "
                                   f"({type(exc).__name__}); see the server's log")
            await self._error(sending, failure, bool(state["started"]))
        finally:
            log.info("%s %s %s %.1fms", method, path, state["status"] or "-",
                     (time.perf_counter() - t0) * 1000)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        async with contextlib.AsyncExitStack() as running:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    if self.mcp is not None:  # the MCP transport runs while the server does
                        await running.enter_async_context(self.mcp.running())
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await running.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _error(self, send: Send, err: ApiError, started: bool) -> None:
        if started:  # an event stream under way: all that can be done is to end it
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await _json(send, err.status, err.body(), err.headers)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        headers: dict[str, str] = {}
        for key, value in scope["headers"]:  # a header sent twice: both values, joined
            key_text = key.decode("latin-1").lower()
            text = value.decode("latin-1")
            headers[key_text] = f"{headers[key_text]}, {text}" if key_text in headers else text
        host = self.guard.host(headers)
        self.guard.origin(headers, host)
        if self.mcp is not None and path == "/mcp":
            await self.mcp(scope, receive, send, headers)
            return
        name, run = _route(method, path)
        if name != "healthz":
            self.guard.authorize(headers)
        if method == "POST":
            require_json(headers)
        query = _query(scope.get("query_string") or b"")
        if name == "submit":
            payload = await self._json_body(receive, headers)
            result = await asyncio.to_thread(self.runs.submit, payload)
            await _json(send, 201, _dump(result),
                        [(b"location", f"/runs/{result['run_id']}".encode())])
        elif name == "list":
            filters = _filters(query)
            found = await asyncio.to_thread(lambda: self.runs.list_runs(**filters))
            await _json(send, 200, _dump({"runs": found}))
        elif name == "get":
            await _json(send, 200, _dump(await asyncio.to_thread(self.runs.get, run)))
        elif name == "cancel":
            await self._json_body(receive, headers, optional=True)
            await _json(send, 200, _dump(await asyncio.to_thread(self.runs.cancel, run)))
        elif name == "input":
            body = await self._json_body(receive, headers)
            if not isinstance(body, dict) or not isinstance(body.get("answer"), str):
                raise BadRunRequest('the body of POST /runs/{id}/input is {"answer": "TEXT"}')
            answered = await asyncio.to_thread(self.runs.answer, run, body["answer"])
            await _json(send, 200, _dump(answered))
        elif name == "events":
            cursor = headers.get("last-event-id") or dict(query).get("after") or None
            await self._events(run or "", receive, send, cursor)
        elif name == "schedules":
            found = await asyncio.to_thread(self.runs.schedules)
            await _json(send, 200, _dump({"schedules": found}))
        else:
            await self._health(send)

    async def _json_body(self, receive: Receive, headers: dict[str, str],
                         optional: bool = False) -> Any:
        """The request's body as strict JSON (:func:`recorder.serving.read_body`: at most
        ``max_body`` bytes, else 413)."""
        try:
            data = await read_body(receive, headers, limit=self.max_body)
        except BodyTooLarge:
            raise ApiError(413, "BodyTooLarge", f"the request body is over the limit of "
                           f"{self.max_body} bytes") from None
        except ClientLeft:
            raise ApiError(400, "BadJson", "the client went away while sending its body"
                           ) from None
        if optional and not data.strip():
            return None
        return parse_json(data)

    async def _health(self, send: Send) -> None:
        from deja.runs.config import is_sqlite

        store = self.runs.store
        await asyncio.to_thread(store.get_meta, "cassette_dir")
        await _json(send, 200, _dump({"ok": True, "database": "sqlite" if is_sqlite(
            store.url) else "postgres"}))

    async def _events(self, run: str, receive: Receive, send: Send,
                      cursor: str | None = None) -> None:
        record = await asyncio.to_thread(self.runs.get, run)  # a NoSuchRun is a 404 here
        seen = cursor is not None and version(json.dumps(record, sort_keys=True)) == cursor
        if seen and record["status"] in ENDED:  # the client has the last word already
            await send({"type": "http.response.start", "status": 204,
                         "headers": safe_headers()})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"x-accel-buffering", b"no"),
            *safe_headers()]})
        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass  # the request's (empty) body

        gone = asyncio.ensure_future(disconnected())
        last = json.dumps(record, sort_keys=True) if seen else ""
        quiet_since = time.monotonic()
        try:
            while not gone.done():
                text = json.dumps(record, sort_keys=True)
                if text != last:
                    last = text
                    quiet_since = time.monotonic()
                    await _event(send, "status", text, version(text))
                    if record["status"] in ENDED:
                        break
                elif time.monotonic() - quiet_since >= KEEPALIVE:
                    quiet_since = time.monotonic()
                    await send({"type": "http.response.body", "body": b": keepalive\n\n",
                                "more_body": True})
                if self.stopping():
                    await _event(send, "end", json.dumps(
                        {"run_id": run, "reason": "the server is stopping; reconnect to "
                                                  "follow the run"}))
                    break
                await asyncio.wait([gone], timeout=self.poll)
                if gone.done():
                    return
                try:
                    record = await asyncio.to_thread(self.runs.get, run)
                except DejaError as exc:
                    err = error_of(exc)
                    await _event(send, "error", json.dumps(json.loads(err.body())["error"]))
                    break
            if not gone.done():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()


def _unreachable(exc: BaseException) -> bool:
    """A driver's error that says the database cannot be reached (or is locked)."""
    import sqlite3

    import sqlalchemy as sa

    if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError | sqlite3.OperationalError):
        return True
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(exc, psycopg.OperationalError)


def version(text: str) -> str:
    """The event id of a record: the same record, the same id."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _query(raw: bytes) -> list[tuple[str, str]]:
    """The query's parameters, strict UTF-8, with no NUL and no lone surrogate."""
    try:
        pairs = parse_qsl(raw.decode("ascii"), keep_blank_values=True, encoding="utf-8",
                          errors="strict")
    except UnicodeError:
        raise BadRunRequest("the query string is not UTF-8") from None
    for key, value in pairs:
        why = bad_text(key + value)
        if why is not None:
            raise BadRunRequest(f"the query parameter {key!r} holds {why}")
    return pairs


def _filters(query: list[tuple[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {"status": [], "label": {}}
    for key, value in query:
        if key == "status":
            out["status"].append(value)
        elif key == "label":
            name, sep, wanted = value.partition("=")
            if not sep or not name:
                raise BadRunRequest(f"label={value!r} is not KEY=VALUE, e.g. label=team=billing")
            out["label"][name] = wanted
        elif key == "schedule":
            out["schedule"] = value or None
        elif key == "limit":
            if not value.isdigit() or not 1 <= int(value) <= 1000:
                raise BadRunRequest(f"limit={value!r} is not a whole number from 1 to 1000")
            out["limit"] = int(value)
        else:
            raise BadRunRequest(f"unknown filter {key!r}; GET /runs takes status, label, "
                                "schedule and limit")
    return out


def _dump(data: Any) -> bytes:
    return json.dumps(data, default=str).encode()


async def _json(send: Send, status: int, body: bytes,
                headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *safe_headers(), *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _event(send: Send, name: str, data: str, event_id: str | None = None) -> None:
    head = f"id: {event_id}\n" if event_id else ""
    await send({"type": "http.response.body", "body": f"{head}event: {name}\ndata: {data}\n\n"
                .encode(), "more_body": True})


# -- the server


def check_binding(host: str, token: str | None) -> None:
    if not is_loopback(host) and not token:
        raise ConfigError(f"deja serve binds to {host}, which is not loopback: give it a token "
                          "(--token or DEJA_TOKEN); clients then send Authorization: Bearer "
                          "TOKEN (the deja commands send DEJA_TOKEN)")


def _sqlite_folder(url: str) -> None:
    """The embedded database's folder is made on first use (a fresh ``$DEJA_HOME``)."""
    from deja.runs.config import is_sqlite

    if is_sqlite(url) and url.startswith("sqlite:///"):
        with contextlib.suppress(OSError):  # the store then names the problem
            Path(url[len("sqlite:///"):]).parent.mkdir(mode=0o700, parents=True,
                                                       exist_ok=True)


def serve(host: str, port: int, token: str | None, url: str,
          ready_file: Path | None = None, allowed_hosts: Iterable[str] = (),
          mcp_tokens: Iterable[str] = ()) -> None:
    """Serve the API until SIGTERM or SIGINT, to requests that carry ``token`` (default:
    this install's, made on first use) and name ``host`` or ``allowed_hosts``; ``/mcp``
    also takes ``mcp_tokens``, each an MCP client's own."""
    import uvicorn

    from deja.runs import engine
    from deja.runs.auth import server_token
    from deja.runs.mcp_http import McpEndpoint
    from deja.runs.service import Runs
    from deja.runs.store import Store

    check_binding(host, token)
    guard = Guard.of(server_token(token), host, allowed_hosts)
    _sqlite_folder(url)
    try:
        sock = bind(host, port)
    except OSError as exc:
        raise ConfigError(f"deja serve cannot listen on {host}:{port} ({exc.strerror or exc}); "
                          "choose another --port or --host") from None
    try:
        store = Store(url)
        client = engine.Client(url)
    except BaseException:
        sock.close()
        raise
    server: uvicorn.Server | None = None
    runs = Runs(store, client)
    try:
        mcp = McpEndpoint(runs, guard, tokens=mcp_tokens)
    except BaseException:
        sock.close()
        raise
    app = Api(runs, guard=guard, stopping=lambda: server is not None and server.should_exit,
              mcp=mcp)
    config = uvicorn.Config(app, lifespan="on", http=guarded_httptools(), loop="uvloop",
                            log_level="warning", access_log=False, server_header=False,
                            date_header=False, backlog=2048, timeout_keep_alive=30,
                            timeout_graceful_shutdown=3)
    server = uvicorn.Server(config)

    def listening(port: int) -> None:
        address = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        sys.stderr.write(f"deja: serving runs on {address}\n")
        sys.stderr.flush()
        if ready_file is not None:
            write_ready(ready_file, {"url": address, "port": port, "pid": os.getpid()})

    try:
        run_until_stopped(server, sock, listening=listening)
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            client.close()
        store.close()
