"""What deja changes in the MCP SDK while a session is active, and puts back after.

- the transports: ``stdio_client``, ``streamable_http_client`` and the legacy
  ``sse_client`` are context managers made
  by ``contextlib.asynccontextmanager``, imported by name everywhere (the SDK's own
  ``Client``, FastMCP's transports, the OpenAI Agents SDK). The function each one wraps is
  swapped in place (the cell of the context manager's closure), so that every importer's
  name reaches deja's version (:func:`._channel.connect`), however it was imported;
- ``JSONRPCDispatcher.send_raw_request`` and ``notify``, on the class: each request a client
  sends on a channel's streams is the channel's to serve or to send and log.

Nothing else of the SDK is touched, and a dispatcher whose streams no channel handed out
(a server's, an in-memory client's) is left alone.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from recorder.capture.mcp import _channel

log = logging.getLogger("deja.recorder")


def _stdio(real: Callable[..., Any]) -> Callable[..., Any]:
    async def stdio_client(server: Any, *args: Any, **kwargs: Any) -> Any:
        spec = {"transport": "stdio", "command": [str(server.command), *map(str, server.args)]}
        async with _channel.connect(spec, lambda: real(server, *args, **kwargs)) as streams:
            yield streams
    return stdio_client


def _over_url(transport: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A transport that takes the server's URL first: Streamable HTTP (``http``) or the
    legacy SSE transport (``sse``)."""
    def make(real: Callable[..., Any]) -> Callable[..., Any]:
        async def url_client(url: str, *args: Any, **kwargs: Any) -> Any:
            spec = {"transport": transport, "url": str(url)}
            async with _channel.connect(spec, lambda: real(url, *args, **kwargs)) as streams:
                yield streams
        return url_client
    return make


TRANSPORTS = (("mcp.client.stdio", "stdio_client", _stdio),
              ("mcp.client.streamable_http", "streamable_http_client", _over_url("http")),
              ("mcp.client.sse", "sse_client", _over_url("sse")))


@contextlib.contextmanager
def _swap_transport(module: str, name: str, make: Callable[..., Any]) -> Iterator[None]:
    """Swap the generator function behind the transport context manager ``module.name``."""
    helper = getattr(importlib.import_module(module), name, None)
    code = getattr(helper, "__code__", None)
    if helper is None or code is None or "func" not in code.co_freevars \
            or helper.__closure__ is None:
        log.warning("MCP capture: %s.%s is not the SDK's context manager; left alone",
                    module, name)
        yield
        return
    cell = helper.__closure__[code.co_freevars.index("func")]
    original = cell.cell_contents
    cell.cell_contents = functools.wraps(original)(make(contextlib.asynccontextmanager(original)))
    try:
        yield
    finally:
        cell.cell_contents = original


def _send_raw_request(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    async def send_raw_request(self: Any, method: str, params: Any, opts: Any = None, *,
                               _related_request_id: Any = None) -> Any:
        channel = _channel.channel_of(getattr(self, "_write_stream", None))
        if channel is None:
            return await real(self, method, params, opts, _related_request_id=_related_request_id)
        return await channel.request(functools.partial(real, self), method, params, opts or {},
                                     _related_request_id)
    return send_raw_request


def _notify(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    async def notify(self: Any, method: str, params: Any, opts: Any = None, *,
                     _related_request_id: Any = None) -> None:
        channel = _channel.channel_of(getattr(self, "_write_stream", None))
        if channel is not None and channel.hold(method, params):
            return
        await real(self, method, params, opts, _related_request_id=_related_request_id)
    return notify


@contextlib.contextmanager
def _replaced(owner: Any, name: str, make: Callable[..., Any]) -> Iterator[None]:
    original = owner.__dict__[name]
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """The MCP SDK (imported by now) routed through deja while the block runs."""
    from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher

    with contextlib.ExitStack() as stack:
        for module, name, make in TRANSPORTS:
            stack.enter_context(_swap_transport(module, name, make))
        stack.enter_context(_replaced(JSONRPCDispatcher, "send_raw_request", _send_raw_request))
        stack.enter_context(_replaced(JSONRPCDispatcher, "notify", _notify))
        yield
