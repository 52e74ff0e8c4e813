"""An MCP exchange as deja sees it, and the lines it is kept as: no MCP SDK needed here.

An agent's MCP client (``mcp.ClientSession``, and what frameworks build on it) sends
JSON-RPC requests to a server; deja sees each one as an :class:`McpCall` (the server, the
method, the params) and its answer as an :class:`McpReply` (the result or the JSON-RPC
error, and the server's notifications that came with it, in order).

A ``tools/call`` is a tool step: a ``tool`` line named for the MCP tool, its ``args`` the
call's arguments, its ``result`` the ``CallToolResult`` as the server sent it, and an
``mcp`` field naming the server. Every other request (``initialize``, ``tools/list``,
``resources/read``, ``prompts/get`` ...) is an ``mcp`` line with its ``params``. The
``mcp`` field of both holds the server (its transport, its command or URL, the name and
version it gave), the method, the messages the server sent before its answer (its
notifications, and its requests to the client with the client's answers) and, for a tool
the MCP specification's defaults make destructive (:func:`destructive`),
``"destructive": true``.

What differs on every run is left out by declaration: JSON-RPC ids and the
``mcp-session-id`` are never stored, and a request's ``_meta`` (its progress token, trace
context, and the client's identity a 2026 client stamps on every request) is the
protocol's envelope, not the request. A call is matched by meaning: a tool call by its
tool and arguments, as any tool; another request by its server (the command's file names,
or the URL's path: never the host, so a server may move), its method and params, and a
handshake (``initialize``, ``server/discover``) by its method alone.
"""

from __future__ import annotations

import abc
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from recorder import values as _values
from recorder.canonical import digest
from recorder.capture.session import Timing, ToolSpec
from recorder.cassette.schema import Kind
from recorder.errors import SessionError

if TYPE_CHECKING:
    from recorder.capture.redact import Redaction

TOOLS_CALL = "tools/call"
HANDSHAKES = frozenset({"initialize", "server/discover"})  # matched by their method alone
INTERNAL_ERROR = -32603  # JSON-RPC's code for a failure without one of its own


@dataclass(frozen=True)
class McpCall:
    """One request an MCP client sends: to ``server`` (``transport`` ``stdio`` with its
    ``command``, or ``http`` or ``sse`` with its ``url``; ``name`` and ``version`` once the
    server gave them), ``method`` and ``params`` without ``_meta``; ``destructive``: a tool
    call of a tool that may change the world (:func:`destructive`)."""

    server: Mapping[str, Any]
    method: str
    params: Mapping[str, Any]
    destructive: bool = False

    @property
    def tool(self) -> str | None:
        """The tool a ``tools/call`` calls (None: another request)."""
        name = self.params.get("name") if self.method == TOOLS_CALL else None
        return name if isinstance(name, str) else None

    @property
    def arguments(self) -> dict[str, Any]:
        return dict(self.params.get("arguments") or {})

    def spec(self) -> ToolSpec:
        """The tool as the guards and the tool policy know one."""
        return ToolSpec(self.tool or self.method, side_effect=self.destructive)

    def match(self, redaction: Redaction) -> tuple[str, str, dict[str, Any]]:
        """What a replay looks the call up by: the index family and key, and the request
        as a divergence shows it (the server, and the tool and arguments or the method and
        params), redacted as the recording redacted it."""
        server = server_record(self.server, redaction)
        if self.tool is not None:
            args = redaction.value(_values.args_key(self.arguments))
            return ("tool", digest(["tool", self.tool, args]),
                    {"server": label(server), "name": self.tool, "args": args})
        params = redaction.value(dict(self.params))
        return ("mcp", line_key(server, self.method, params),
                {"server": label(server), "method": self.method, "params": params})

    def described(self, redaction: Redaction) -> str:
        """What the agent did, in words, for a divergence."""
        where = label(server_record(self.server, redaction))
        if self.tool is not None:
            return f"the agent called MCP tool {self.tool!r} of server {where}"
        return f"the agent sent MCP request {self.method} to server {where}"


@dataclass
class McpReply:
    """The answer to an :class:`McpCall`: ``result``, or ``error`` (a JSON-RPC error:
    ``code``, ``message``, ``data``), and what the server sent before it, in the order it
    arrived, as ``notifications``: each notification (``{"method", "params"}``; progress
    without its token), and each request the server made of the client (sampling,
    elicitation, roots: :func:`server_request`) with the client's ``result`` or
    ``error``."""

    result: Any = None
    error: dict[str, Any] | None = None
    notifications: list[dict[str, Any]] = field(default_factory=list)


class McpSeam(abc.ABC):
    """What an MCP connection asks the active session: implemented by a recording, a
    replay and a run that continues another."""

    @abc.abstractmethod
    def mcp_answer(self, call: McpCall) -> McpReply | None:
        """Before a request goes to its server: the reply to serve instead, or None to send
        it (a tool call has been through the guards then). May raise ``Divergence``."""

    def mcp_log(self, call: McpCall, reply: McpReply, timing: Timing) -> None:
        """A request the server answered: log it."""
        raise SessionError("this session sends no MCP request")


class McpSource(abc.ABC):
    """A source (:mod:`recorder.capture.sources`) that answers MCP requests too."""

    @abc.abstractmethod
    def answer_mcp(self, call: McpCall) -> Mapping[str, Any] | None:
        """The line that answers ``call``; None passes it on (a source that does not pass
        raises ``Divergence``)."""


# ---------------------------------------------------------------- servers


def server_record(server: Mapping[str, Any], redaction: Redaction) -> dict[str, Any]:
    """The server as a line names it, with no secret in its command or URL."""
    record = dict(server)
    if "command" in record:
        record["command"] = redaction.argv(record["command"])
    if "url" in record:
        record["url"] = redaction.url(record["url"])
    return record


def label(server: Mapping[str, Any]) -> str:
    """The server in words: the name it gave, else its command or URL."""
    if server.get("name"):
        return str(server["name"])
    if server.get("command"):
        return " ".join(map(str, server["command"]))
    return str(server.get("url", "?"))


URL_TRANSPORTS = frozenset({"http", "sse"})  # Streamable HTTP, and the legacy SSE transport


def server_key(server: Mapping[str, Any]) -> list[str]:
    """What a server is matched by: the file names of its command (a checkout elsewhere is
    the same server), or its transport and its URL's path (the host and port may
    change)."""
    if server.get("transport") in URL_TRANSPORTS:
        return [str(server["transport"]), urlsplit(str(server.get("url", ""))).path.rstrip("/")]
    return ["stdio", *(os.path.basename(str(part)) for part in server.get("command") or ())]


def line_key(server: Mapping[str, Any], method: str, params: Mapping[str, Any]) -> str:
    """The key of an ``mcp`` line (stored as its ``fp``)."""
    return digest(["mcp", server_key(server), method,
                   None if method in HANDSHAKES else dict(params)])


def without_meta(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's or notification's params without ``_meta``, the protocol's envelope."""
    return {k: v for k, v in (params or {}).items() if k != "_meta"}


def notification(method: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A server notification as a line keeps it: progress without its token (the request's
    id, which a replay's request does not share)."""
    kept = {k: v for k, v in without_meta(params).items() if k != "progressToken"}
    return {"method": method, **({"params": kept} if kept else {})}


def server_request(method: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request the server makes of the client while a call is pending
    (``sampling/createMessage``, ``elicitation/create``, ``roots/list``), kept among the
    call's notifications where it arrived; the client's answer joins it as ``result`` or
    ``error`` (:func:`answered`). Its JSON-RPC id is never kept."""
    return notification(method, params)


def answered(asked: dict[str, Any], result: Any = None,
             error: Mapping[str, Any] | None = None) -> None:
    """The client's answer to a :func:`server_request`: its result (without ``_meta``), or
    its JSON-RPC error."""
    if error is not None:
        asked["error"] = dict(error)
    else:
        asked["result"] = without_meta(result) if isinstance(result, Mapping) else result


def is_server_request(note: Mapping[str, Any]) -> bool:
    """Whether an entry of a line's notifications is a request the server made of the
    client (it has the client's answer), not a notification."""
    return "result" in note or "error" in note


def destructive(annotations: Mapping[str, Any] | None) -> bool:
    """Whether a tool may change the world, by the MCP specification's defaults for its
    annotations: a tool is destructive unless it says ``readOnlyHint: true`` or
    ``destructiveHint: false`` (a tool without annotations is destructive)."""
    hints = annotations if isinstance(annotations, Mapping) else {}
    return hints.get("readOnlyHint") is not True and hints.get("destructiveHint") is not False


# ---------------------------------------------------------------- lines and replies


def error_record(error: Mapping[str, Any], message: str) -> dict[str, Any]:
    """A JSON-RPC error as a line's ``error``: an ``MCPError`` with its ``code`` and
    ``data`` (``message``: the error's message as the line may hold it, redacted)."""
    record = {"type": "MCPError", "module": "mcp.shared.exceptions", "message": message,
              "code": int(error.get("code", INTERNAL_ERROR))}
    if error.get("data") is not None:
        record["data"] = error["data"]
    return record


def tool_result(value: Any, *, failed: bool = False, like: Any = None) -> dict[str, Any]:
    """``value`` as a ``CallToolResult``: one as it is, anything else as its text (JSON
    unless a string). ``like``, the result it stands in for, lends it its other fields (a
    2026 session's ``resultType``, ``_meta``) and, when it had structured content, the value
    as that, so that a client that checks a tool's output schema accepts it; without one it
    says ``resultType: complete``, which an older session leaves out."""
    if isinstance(value, dict) and isinstance(value.get("content"), list):
        return value
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    base = {k: v for k, v in like.items() if k not in ("content", "structuredContent",
                                                       "isError")} \
        if isinstance(like, dict) else {"resultType": "complete"}
    result: dict[str, Any] = {**base, "content": [{"type": "text", "text": text}],
                              "isError": failed}
    if not failed and isinstance(like, dict) and "structuredContent" in like:
        result["structuredContent"] = value if isinstance(value, dict) else {"result": value}
    return result


def reply_of(obs: Mapping[str, Any]) -> McpReply:
    """The reply a recorded line serves: its result (a tool line's as a ``CallToolResult``,
    whatever tool recorded it), its JSON-RPC error, or, for an error deja put there (a
    refusal, an edit), the tool's failure as the model would see it."""
    part = obs.get("mcp") or {}
    notes = [dict(n) for n in part.get("notifications") or ()]
    error = obs.get("error")
    tool = obs.get("kind") == Kind.TOOL
    if error is not None and "code" in error:
        rpc = {"code": error["code"], "message": error.get("message", "")}
        if "data" in error:
            rpc["data"] = error["data"]
        return McpReply(error=rpc, notifications=notes)
    if error is not None:
        message = str(error.get("message", ""))
        if tool:
            return McpReply(result=tool_result(message, failed=True), notifications=notes)
        return McpReply(error={"code": INTERNAL_ERROR, "message": message}, notifications=notes)
    value = _values.decode(obs.get("result"))
    return McpReply(result=tool_result(value) if tool else value, notifications=notes)


# ---------------------------------------------------------------- HTTP servers carried


_carried: dict[str, int] = {}
_carried_lock = threading.Lock()


def _url_key(url: str, *, origin: bool = False) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" + ("" if origin else parts.path.rstrip("/"))


def carry(url: str, add: bool, *, origin: bool = False) -> None:
    """An MCP connection over HTTP to ``url`` opens (``add``) or closes: while it is open,
    its HTTP traffic is the MCP lines' and no step of its own. ``origin``: all of the
    URL's origin is the connection's (the legacy SSE transport posts its messages to an
    endpoint the server names)."""
    key = _url_key(url, origin=origin)
    with _carried_lock:
        count = _carried.get(key, 0) + (1 if add else -1)
        if count > 0:
            _carried[key] = count
        else:
            _carried.pop(key, None)


def carries(url: str) -> bool:
    """Whether ``url`` is an open MCP connection's endpoint (its exchanges are MCP lines)."""
    return bool(_carried) and (_url_key(url) in _carried
                               or _url_key(url, origin=True) in _carried)
