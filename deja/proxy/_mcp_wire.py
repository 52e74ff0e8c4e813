"""What the proxy's MCP endpoint says and reads on the wire: MCP's Streamable HTTP
transport, JSON-RPC 2.0 over HTTP.

A client POSTs one JSON-RPC message at a time; the server answers a request with a JSON
body (``application/json``) or with a stream of server-sent events (``text/event-stream``)
that carries the server's notifications and requests for it and ends with its answer, and
answers a notification or a client's response with 202. The ``mcp-session-id`` header the
server gives in its answer to ``initialize`` names the session in every later request;
a GET opens the server's own stream of messages (or is answered 405), a DELETE ends the
session.

Here: the SSE events of a body as it arrives (:func:`sse_events`) and an event as the
proxy writes one (:func:`sse_event`), JSON-RPC messages as the proxy answers with them
(:func:`rpc_answer`, :func:`rpc_error`, :func:`rpc_body`), what kind of message a body is
(:func:`rpc_kind`), and the headers of a request sent on to the server and of an answer
passed back (:func:`upstream_headers`, :func:`client_headers`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp

from deja.proxy._wire import forwardable, served_headers
from recorder.capture.mcp.calls import notification

if TYPE_CHECKING:
    from deja.proxy._respond import Receive
    from recorder.errors import Divergence

__all__ = ["EVENT_STREAM", "SESSION_HEADER", "VERSION_HEADER", "accepts_stream",
           "answer_in", "client_headers", "diverged", "divergence_data", "media_type",
           "parsed", "rpc_answer", "rpc_body", "rpc_error", "rpc_kind", "sse_event",
           "sse_events", "until_gone", "upstream_headers"]

SESSION_HEADER = "mcp-session-id"
VERSION_HEADER = "mcp-protocol-version"
EVENT_STREAM = "text/event-stream"
JSON_TYPE = "application/json"

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")  # the blank line that ends an SSE event


def rpc_kind(message: Any) -> str | None:
    """What a JSON-RPC message is: ``request`` (a method and an id), ``notification`` (a
    method, no id), ``response`` (an id and a result or an error); None: not one."""
    if not isinstance(message, dict):
        return None
    if isinstance(message.get("method"), str):
        return "request" if "id" in message else "notification"
    if "id" in message and ("result" in message or "error" in message):
        return "response"
    return None


def rpc_answer(rid: Any, result: Any = None, error: Mapping[str, Any] | None = None
               ) -> dict[str, Any]:
    """The answer to request ``rid``: its result, or its error."""
    if error is not None:
        return {"jsonrpc": "2.0", "id": rid, "error": dict(error)}
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def rpc_error(rid: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    """A JSON-RPC error answer to request ``rid`` (None: a message with no id)."""
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return rpc_answer(rid, error=error)


def rpc_body(message: Any) -> bytes:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def sse_event(message: Any) -> bytes:
    """One JSON-RPC message as an SSE event, as MCP servers write them."""
    return b"event: message\ndata: " + rpc_body(message) + b"\n\n"


def _data(block: bytes) -> str | None:
    """The data of one SSE event (its ``data:`` lines joined); None: it has none."""
    found = []
    for line in block.decode("utf-8", "replace").splitlines():
        if line.startswith("data:"):
            value = line[5:]
            found.append(value[1:] if value.startswith(" ") else value)
    return "\n".join(found) if found else None


def parsed(data: str | None) -> Any:
    """An event's data as JSON (None: none, or not JSON)."""
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


async def sse_events(chunks: AsyncIterator[bytes], limit: int
                     ) -> AsyncIterator[tuple[bytes, Any]]:
    """The events of an SSE body as it arrives: each as its bytes (to pass on as they
    came) and its data read as JSON (None: no data, or not JSON). An event longer than
    ``limit`` bytes is an error (:class:`ValueError`)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while (end := _BOUNDARY.search(buffer)) is not None:
            raw, buffer = buffer[:end.end()], buffer[end.end():]
            yield raw, parsed(_data(raw[:end.start()]))
        if len(buffer) > limit:
            raise ValueError(f"an event of the MCP server's stream is over {limit} bytes")
    if buffer.strip():
        yield buffer, parsed(_data(buffer))


def media_type(headers: Mapping[str, str] | Sequence[tuple[str, str]]) -> str:
    """The media type a ``content-type`` header names, lower-cased, without parameters."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    value = next((v for k, v in pairs if k.lower() == "content-type"), "")
    return value.split(";", 1)[0].strip().lower()


def accepts_stream(named: Mapping[str, str]) -> bool:
    """Whether the client takes an SSE answer (its ``Accept`` names ``text/event-stream``)."""
    return EVENT_STREAM in named.get("accept", "").lower()


# What the proxy sets itself on a request it sends on: the session (the server's own id
# for it), and the coding (the proxy reads the body, so it asks for none).
_REPLACED = frozenset({SESSION_HEADER, "accept-encoding"})


def upstream_headers(headers: Sequence[tuple[str, str]], session: str | None,
                     *, handshake: bool = False) -> list[tuple[str, str]]:
    """A client's request headers as they go to the server: its own (the server's
    authorization among them) without hop-by-hop ones, deja's ``x-deja-*`` and its session
    id, with the server's session id in its place. ``handshake``: for the ``initialize``
    the proxy says for it, without a protocol version (which follows the handshake)."""
    dropped = _REPLACED | ({VERSION_HEADER} if handshake else frozenset())
    out = [(k, v) for k, v in forwardable(headers) if k.lower() not in dropped]
    if session is not None:
        out.append((SESSION_HEADER, session))
    return out


def client_headers(headers: Sequence[tuple[str, str]], session: str | None,
                   body_length: int | None) -> list[tuple[bytes, bytes]]:
    """A server's answer headers as the client gets them: without hop-by-hop ones, the
    coding (the body was read decoded) or the server's session id, with the proxy's
    session id (``session``) in its place."""
    kept = [(k, v) for k, v in headers if k.lower() not in (SESSION_HEADER, "content-encoding")]
    out = served_headers(kept, body_length)
    if session is not None:
        out.append((SESSION_HEADER.encode(), session.encode("latin-1")))
    return out


def answer_in(message: Any, rid: Any, notes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``message`` if it is the answer to request ``rid``; a notification is added to
    ``notes`` (a cancellation is not kept)."""
    kind = rpc_kind(message)
    if kind == "response" and message.get("id") == rid:
        return dict(message)
    if kind == "notification" and message["method"] != "notifications/cancelled":
        notes.append(notification(message["method"], message.get("params")))
    return None


async def until_gone(response: aiohttp.ClientResponse, receive: Receive
                      ) -> AsyncIterator[bytes]:
    """A long-lived response's chunks until it ends or the client goes away."""
    gone = asyncio.ensure_future(receive())
    try:
        while True:
            chunk = asyncio.ensure_future(response.content.readany())
            await asyncio.wait((chunk, gone), return_when=asyncio.FIRST_COMPLETED)
            if not chunk.done():
                chunk.cancel()
                return
            data = chunk.result()
            if not data:
                return
            yield data
    finally:
        gone.cancel()


def diverged(exc: Divergence) -> str:
    info = exc.info
    where = f"step {info.step}" if info.step is not None else "the end of the recording"
    kind = info.kind + (f", {info.category.replace('_', ' ')}" if info.category else "")
    return (f"deja replay: the request diverged from the recording at {where} ({kind}): "
            f"{info.reason}: {_shown(info.actual)}. The proxy's log shows the diff")


def _shown(actual: Any) -> str:
    """The request a divergence names, in words: the server, and the tool and arguments
    (or the method and params)."""
    if not isinstance(actual, Mapping):
        return str(actual)
    if "name" in actual:
        return f"server {actual.get('server')}, tool {actual['name']}, arguments " \
               f"{rpc_body(actual.get('args')).decode()}"
    return f"server {actual.get('server')}, method {actual.get('method')}, params " \
           f"{rpc_body(actual.get('params')).decode()}"


def divergence_data(exc: Divergence) -> dict[str, Any]:
    info = exc.info
    return {"step": info.step, "kind": info.kind, "category": info.category,
            "request": info.actual}
