"""MCP capture: the tool calls (and every other request) an agent makes to MCP servers.

While a deja session is active, an MCP client session over the SDK's stdio or Streamable
HTTP transport (``mcp.ClientSession`` and what frameworks build on it: Pydantic AI's
MCP toolsets through FastMCP's client, the OpenAI Agents SDK's MCP servers) is captured
unmodified: a recording logs each request and its answer, a replay serves them and never
starts the server, a fork serves its prefix and starts the server only if a call needs it.

- :mod:`.calls`: an exchange as deja sees it (:class:`McpCall`, :class:`McpReply`), what
  a session implements to take part (:class:`McpSeam`, :class:`McpSource`), and the lines
  an exchange is kept as; it needs no MCP SDK;
- :mod:`._channel`: one connection, its streams and its server (started when and if
  needed); :mod:`._patch`: where the SDK is patched, while a session is active.

Importing the MCP SDK takes half a second, which a run that uses no MCP server should not
pay: :func:`install` patches it at once when the program has imported it already, and
otherwise the moment the program does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from recorder.capture.mcp.calls import (
    HANDSHAKES,
    TOOLS_CALL,
    McpCall,
    McpReply,
    McpSeam,
    McpSource,
    carries,
    error_record,
    label,
    line_key,
    reply_of,
    server_record,
    tool_result,
)
from recorder.imports import when_imported

__all__ = ["HANDSHAKES", "TOOLS_CALL", "McpCall", "McpReply", "McpSeam", "McpSource",
           "carries", "error_record", "install", "label", "line_key", "reply_of",
           "server_record", "tool_result"]

_log = logging.getLogger("deja.recorder")
_SDK = "mcp"


@contextlib.contextmanager
def install(session: Any) -> Iterator[None]:
    """The MCP SDK routed through the active session while the block runs (``session`` is
    that session; the channels ask the active one)."""
    with contextlib.ExitStack() as stack:
        def patch() -> None:
            from recorder.capture.mcp import _patch

            try:
                stack.enter_context(_patch.patched())
            except Exception:  # noqa: BLE001 - an SDK deja does not know: run uncaptured
                _log.warning("MCP capture could not patch the MCP SDK", exc_info=True)

        with when_imported(_SDK, patch):
            yield
