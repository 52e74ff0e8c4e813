"""The line each kind of step is written as, built for a recording
(:class:`recorder.record.RecordSession` writes, counts and guards them).

A model or HTTP exchange: its request half redacted (URLs and request headers repeat call
after call, so their redacted forms are kept), the response as recorded and, for a model
response, its usage, stop reason and cost; a tool call, or the outcome of its intent; a
tool call seen from outside (the recording proxy); a request to an MCP server; an effect.
A value the cassette cannot hold is refused with ``UnserializableValue``, and the refusal
is put in the line as its ``error`` first, so that a replay raises it at the same step.
An error is stored as its :func:`error_record`, the message redacted and writable.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from recorder import effects, providers
from recorder import values as _values
from recorder._fastjson import BODY_DEPTH, LINE_DEPTH, nests_deeper
from recorder.canonical import content_decoded, digest, fingerprint
from recorder.capture import mcp, session
from recorder.capture.exchange import (
    HttpRequest,
    HttpResponse,
    Redaction,
    RequestReader,
    SentDigests,
    classify_texts,
    response_record,
    semantic_headers,
)
from recorder.cassette.schema import Kind
from recorder.errors import UnserializableValue
from recorder.providers import volatile_header


def error_record(exc: BaseException) -> dict[str, str]:
    cls = type(exc)
    return {"type": cls.__qualname__, "module": cls.__module__, "message": str(exc)}


class StepLines:
    """The lines of one run's steps, built with its redaction and its price table."""

    # URLs and request headers repeat call after call: their redacted forms are kept, up
    # to this many of each (the same rules give the same result every time).
    _KEPT = 256

    def __init__(self, redaction: Redaction, prices: Any) -> None:
        self.redaction = redaction
        self.prices = prices
        self._requests = RequestReader()  # a conversation's resent history is parsed once
        self._sent = SentDigests()  # and hashed once
        self._urls: dict[str, str] = {}
        self._volatile: dict[str | None, dict[str, bool]] = {}  # by provider, header name
        self._headers: dict[tuple[str | None, tuple[tuple[str, str], ...]], list[list[str]]] = {}

    def error(self, exc: BaseException) -> dict[str, str]:
        """The error record of ``exc`` as stored: its message redacted and writable."""
        record = error_record(exc)
        message = self.redaction.text(record["message"])
        record["message"] = message.encode("utf-8", "backslashreplace").decode("utf-8")
        return record

    def args_key(self, args: dict[str, Any]) -> Any:
        """Tool arguments as stored and matched: JSON, secrets redacted (so recording,
        the loop guard and replay all compare the same form)."""
        return self.redaction.value(_values.args_key(args))

    # -- model and HTTP exchanges

    def classify(self, request: HttpRequest) -> tuple[str, str | None, Any]:
        if request.classified is None:
            data = request.original_body if request.original_body is not None else request.body
            kind, provider, body, _, untouched = classify_texts(
                request.method, request.url, data, self.redaction, self._requests)
            request.classified = kind, provider, body
            if kind == Kind.MODEL and untouched:
                request.sent = self._sent(data)
        return request.classified

    def exchange(self, request: HttpRequest, response: HttpResponse | None,
                 timing: session.Timing, error: BaseException | None = None
                 ) -> tuple[dict[str, Any], dict[str, Any], float | None]:
        """The line of a finished exchange (or a failed one, with ``error``) as a reader
        sees it, before a model line is compacted; with what a model response used and
        cost."""
        kind, provider, body = self.classify(request)
        obs = self._exchange_line(request, kind, provider, body)
        seam = providers.for_line(obs)
        obs["t"] = round(timing.start, 3)
        obs["ms"] = round(timing.ms, 2)
        if (timing.ttfb_ms is not None and response is not None
                and seam.is_stream(response.headers)):
            obs["ttft_ms"] = round(timing.ttfb_ms, 2)
        usage: dict[str, Any] = {}
        cost = None
        if response is not None:
            obs["response"] = response_record(response, self.redaction)
            if kind == Kind.MODEL:
                usage, cost = self._model_outcome(obs, seam, response, body)
        if error is not None:
            obs["error"] = {**self.error(error), "has_response": response is not None}
        if request.original_body is not None:
            obs["clamped_max_tokens"] = seam.request_max_tokens(json.loads(request.body))
        return obs, usage, cost

    def _redacted_url(self, url: str) -> str:
        redacted = self._urls.get(url)
        if redacted is None:
            if len(self._urls) >= self._KEPT:
                self._urls.clear()
            redacted = self._urls[url] = self.redaction.url(url)
        return redacted

    def _request_headers(self, headers: Sequence[tuple[str, str]],
                         provider: str | None) -> list[list[str]]:
        """:func:`semantic_headers` of a request, worked out once for each set of headers
        it keeps (a header's value that changes every call, such as ``content-length``, is
        a volatile one and not part of the set)."""
        volatile = self._volatile.get(provider)
        if volatile is None or len(volatile) >= self._KEPT:
            volatile = self._volatile[provider] = {}
        kept = []
        for name, value in headers:
            drop = volatile.get(name)
            if drop is None:
                drop = volatile[name] = volatile_header(name, provider)
            if not drop:
                kept.append((name, value))
        key = (provider, tuple(kept))
        stored = self._headers.get(key)
        if stored is None:
            if len(self._headers) >= self._KEPT:
                self._headers.clear()
            stored = self._headers[key] = semantic_headers(kept, self.redaction, provider)
        return [list(pair) for pair in stored]

    def _exchange_line(self, request: HttpRequest, kind: str, provider: str | None,
                       body: Any) -> dict[str, Any]:
        """The request half of a model or HTTP line, redacted (the model request's body is
        stored apart, as a delta of its conversation)."""
        url = self._redacted_url(request.url)
        headers = self._request_headers(request.headers, provider if kind == Kind.MODEL else None)
        if kind == Kind.MODEL:
            line = {"kind": Kind.MODEL.value, "provider": provider, "url": url,
                    "request_headers": headers}
            if request.sent is not None:
                line["sent"] = request.sent
            return line
        return {"kind": Kind.HTTP.value, "method": request.method.upper(), "url": url,
                "fp": fingerprint(Kind.HTTP, request.method, url, body),
                "request": {"headers": headers, "body": body}}

    def _model_outcome(self, obs: dict[str, Any], seam: providers.Provider,
                       response: HttpResponse, body: Any) -> tuple[dict[str, Any], float | None]:
        """What a model response says (usage, stop reason, API error) and what it cost,
        added to its line (read by ``seam``, its provider); returns the usage and the cost."""
        # read as the SDK reads it: a compressed body decompressed (it is stored as received)
        summary = seam.summarize(response.status, response.headers,
                                 content_decoded(response.body, response.headers))
        usage = summary.get("usage") or {}
        cost = seam.cost(summary.get("model") or seam.request_model(body, obs["url"]), usage,
                         self.prices)
        obs.update({"usage": {k: v for k, v in usage.items() if v} or None,
                    "stop_reason": summary.get("stop_reason"), "cost_usd": cost})
        if summary.get("error"):
            obs["api_error"] = summary["error"]
        return usage, cost

    # -- tools and effects

    def tool(self, tool: session.ToolSpec, args: dict[str, Any], t: float, ms: float, *,
             result: Any, error: BaseException | None, intent: tuple[int, str] | None,
             step: int) -> tuple[dict[str, Any], UnserializableValue | None]:
        """A tool's line, ``step``: ``tool``, or ``outcome`` of ``intent`` (seq, key); and
        the refusal of a result the cassette cannot hold, in the line as its ``error``."""
        obs: dict[str, Any]
        if intent is not None:  # an outcome names its intent, which holds the arguments
            obs = {"kind": Kind.OUTCOME.value, "name": tool.name, "intent": intent[0],
                   "key": intent[1], "t": t, "ms": ms}
        else:  # the arguments as they are once the body has run
            key = self.args_key(args)
            obs = {"kind": Kind.TOOL.value, "name": tool.name, "args": key,
                   "fp": digest(["tool", tool.name, key]), "t": t, "ms": ms}
        refused: UnserializableValue | None = None
        if error is not None:
            obs["error"] = self.error(error)
        else:
            value = tool.encode(result) if tool.encode else result
            try:
                obs["result"] = _values.encode(
                    value, where=f"result of tool {tool.name!r} (step {step})")
            except UnserializableValue as exc:
                refused = exc
                obs["error"] = self.error(exc)
        return obs, refused

    def mcp(self, call: mcp.McpCall, reply: mcp.McpReply, timing: session.Timing, *,
            step: int) -> tuple[dict[str, Any], UnserializableValue | None]:
        """The line, ``step``, of an MCP request its server answered: a ``tool`` line for a
        tool call, else an ``mcp`` line (:mod:`recorder.capture.mcp.calls`); and the
        refusal of a result the cassette cannot hold, in the line as its ``error``."""
        part: dict[str, Any] = {"server": mcp.server_record(call.server, self.redaction),
                                "method": call.method}
        if reply.notifications:
            part["notifications"] = reply.notifications
        if call.destructive:
            part["destructive"] = True
        obs: dict[str, Any]
        if call.tool is not None:
            key = self.args_key(call.arguments)
            obs = {"kind": Kind.TOOL.value, "name": call.tool, "args": key,
                   "fp": digest(["tool", call.tool, key])}
        else:
            params = self.redaction.value(dict(call.params))
            obs = {"kind": Kind.MCP.value, "params": params,
                   "fp": mcp.line_key(part["server"], call.method, params)}
        obs.update(t=round(timing.start, 3), ms=round(timing.ms, 2), mcp=part)
        if reply.error is not None:
            obs["error"] = mcp.error_record(reply.error, self.redaction.text(
                str(reply.error.get("message", ""))))
            return self._within_depth(obs, call.method, step, None)
        try:
            obs["result"] = _values.encode(reply.result, where=f"result of MCP {call.method} "
                                                               f"(step {step})")
        except UnserializableValue as exc:
            obs["error"] = self.error(exc)
            return self._within_depth(obs, call.method, step, exc)
        if call.tool is not None and isinstance(reply.result, dict) \
                and reply.result.get("isError") is True:
            obs["is_error"] = True
        return self._within_depth(obs, call.method, step, None)

    def _within_depth(self, obs: dict[str, Any], method: str, step: int,
                      refused: UnserializableValue | None
                      ) -> tuple[dict[str, Any], UnserializableValue | None]:
        """An MCP line whose params or notifications (as the server's JSON-RPC gave them)
        nest deeper than a line may: refused as the result is, the too-deep parts left out
        (its ``fp``, of the params as sent, still finds it on replay)."""
        if not nests_deeper(obs, LINE_DEPTH):
            return obs, refused
        exc = UnserializableValue(f"MCP {method} (step {step}): its params, "
                                  f"notifications or result nest more than {BODY_DEPTH} "
                                  "levels deep; a cassette cannot hold them")
        for key in ("result", "is_error"):
            obs.pop(key, None)
        obs["mcp"].pop("notifications", None)
        if nests_deeper(obs.get("params"), BODY_DEPTH):
            obs["params"] = {}
        obs["error"] = self.error(exc)
        return obs, exc

    def observed_tool(self, name: str, args: Any, result: Any, *, call_id: str,
                      is_error: bool, start: float | None, ms: float | None, observed: str,
                      step: int) -> dict[str, Any]:
        """The line, ``step``, of a tool call the agent ran itself, seen from outside
        (:meth:`recorder.record.RecordSession.observe_tool`); its ``args`` are the key the
        guards see."""
        key = self.redaction.value(_values.args_key(args if isinstance(args, dict)
                                                    else {"input": args}))
        obs: dict[str, Any] = {"kind": Kind.TOOL.value, "name": name, "args": key,
                               "fp": digest(["tool", name, key]), "observed": observed,
                               "call_id": call_id,
                               "t": round(start if start is not None else time.time(), 3),
                               "ms": None if ms is None else round(ms, 2)}
        obs["result"] = _values.encode(result, where=f"result of tool {name!r} "
                                                     f"(step {step})")
        if is_error:
            obs["is_error"] = True
        return obs

    def effect(self, name: str, value: Any, site: effects.Site | None
               ) -> tuple[dict[str, Any], UnserializableValue | None]:
        """An effect's line for ``value`` asked for at ``site``; and the refusal of a value
        the cassette cannot hold, in the line as its ``error``."""
        obs: dict[str, Any] = {"kind": Kind.EFFECT.value, "name": name}
        refused: UnserializableValue | None = None
        try:
            obs["value"] = _values.encode(value, where=f"effect {name!r}")
        except UnserializableValue as exc:
            refused, error = exc, error_record(exc)
            # The message may quote the refused text (a lone surrogate); the line must still
            # be writable as UTF-8.
            error["message"] = error["message"].encode("utf-8", "backslashreplace").decode()
            obs["error"] = error
        if site is not None:
            obs["site"] = site.record()
        return obs, refused
