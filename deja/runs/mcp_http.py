"""``deja serve``'s MCP endpoint, ``/mcp``: MCP's Streamable HTTP transport, served by the
official ``mcp`` SDK, behind the checks of every other route (:mod:`deja.runs.guard`).

A request reaches the SDK only after ``deja serve`` has checked, in its order: the ``Host``
(421), a browser's ``Origin`` (403), the method (only ``POST``; 405: the tasks need no
stream, so there is no ``GET`` event stream and no session to ``DELETE``), the token (401)
and ``Content-Type: application/json`` (415). So a DNS-rebinding page, a cross-origin form
or a ``text/plain`` post never reaches it, and neither does a caller without a token.

The token is the server's own, or one of the **MCP clients' tokens** given with ``deja
serve --mcp-tokens FILE``: a file of further tokens, one a line (``#`` comments), private
to its owner like the install's token. Such a token opens ``/mcp`` and no other route, and
its holder sees only the tasks it created (:mod:`deja.runs.mcp_tasks`): the identity a
task is bound to is the token itself. The SDK serves statelessly and answers JSON (no
session is kept between requests), so the identity is checked on every request.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from deja.runs.guard import ApiError, Guard, require_json
from deja.runs.mcp_tasks import CALLER, build_server, caller_of
from recorder.errors import ConfigError

__all__ = ["MCP_PATH", "McpEndpoint", "read_mcp_tokens"]

MCP_PATH = "/mcp"


def read_mcp_tokens(path: Path) -> list[str]:
    """The tokens in ``path``, one a line; ``ConfigError`` for a file others could read or
    a line that is not a token."""
    from deja.runs.auth import _check_private, valid_token

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ConfigError(f"the MCP clients' tokens, {path}, cannot be read "
                          f"({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        text = os.read(fd, 1 << 20).decode("ascii", errors="replace")
    finally:
        os.close(fd)
    _check_private(path, info)
    tokens = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not valid_token(line):
            raise ConfigError(f"{path}, line {number}, is not a token (16 to 512 visible ASCII "
                              "characters, one a line); make one with: python -c 'import "
                              "secrets; print(secrets.token_urlsafe(32))'")
        tokens.append(line)
    return tokens


class McpEndpoint:
    """The ``/mcp`` route: deja's checks, then the SDK's Streamable HTTP transport."""

    def __init__(self, runs: Any, guard: Guard, *, tokens: Iterable[str] = (),
                 max_body: int = 1024 * 1024) -> None:
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

        self.guard = guard
        self.tokens = [t for t in tokens if t != guard.token]
        self.manager = StreamableHTTPSessionManager(
            app=build_server(runs), json_response=True, stateless=True,
            max_request_body_size=max_body)

    def running(self) -> AbstractAsyncContextManager[None]:
        """The SDK's transport, running while the server does (entered at its startup)."""
        return self.manager.run()

    def caller(self, headers: Mapping[str, str]) -> str:
        """The identity of the request's token: the server's or an MCP client's; 401 else."""
        try:
            self.guard.authorize(headers)
            return caller_of(self.guard.token)
        except ApiError:
            scheme, _, given = headers.get("authorization", "").partition(" ")
            sent = given.strip().encode("latin-1", "replace")
            if scheme.lower() == "bearer":
                for token in self.tokens:
                    if hmac.compare_digest(sent, token.encode()):
                        return caller_of(token)
            raise

    async def __call__(self, scope: Any, receive: Any, send: Any,
                       headers: Mapping[str, str]) -> None:
        """Serve one request whose ``Host`` and ``Origin`` the API has checked."""
        if scope["method"] != "POST":
            raise ApiError(405, "MethodNotAllowed", f"{scope['method']} {MCP_PATH} is not "
                           "served; MCP clients POST their requests (no event stream, no "
                           "session)", [(b"allow", b"POST")])
        caller = self.caller(headers)
        require_json(headers)
        await self.manager.handle_request({**scope, CALLER: caller}, receive, send)
