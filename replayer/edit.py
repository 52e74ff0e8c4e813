"""Editing one observation: the document a user edits, and the observation it becomes.

Each editable kind is shown as a small JSON document:

- ``tool`` / ``outcome``: ``{"result": ...}`` or ``{"error": {"type", "module", "message"}}``;
  an MCP server's tool: its ``CallToolResult`` as ``result`` (a result edited into anything
  else is served as that text, JSON unless a string, with structured content when the
  recorded result had some)
- ``mcp`` (another request to an MCP server): ``{"result": ...}`` or ``{"error": ...}``
- ``effect``: ``{"value": ...}`` (or ``{"error": {...}}`` for a refused value)
- ``model``: the assembled message (``id``, ``content`` blocks, ``stop_reason``,
  ``usage`` ...), whether it was received as JSON or as an SSE stream; an edit may leave
  an HTTP response instead, ``{"status", "headers", "body"}`` (the provider's error, a 429
  say), which is served as it is, as JSON, to a streaming request too
- ``http``: ``{"status", "headers", "body"}`` (the body parsed when it is JSON)

An edit is an RFC 6902 JSON patch, a whole replacement document, or ``--set`` pairs
(``/result=...`` JSON pointers or ``result.0.title`` dotted paths; values parsed as JSON
when they are JSON, else taken as strings). Rebuilding a model observation from an edited
message re-serialises the body, and for a streamed call synthesises a valid SSE stream,
so streaming agents receive the edit too.
"""

from __future__ import annotations

import copy
import http.client
import json
from collections.abc import Mapping
from typing import Any

import jsonpatch

from recorder import providers
from recorder.canonical import decode_body, encode_body
from recorder.capture import mcp
from recorder.cassette.schema import Kind
from recorder.errors import EditError
from recorder.providers.pricing import PriceTable
from recorder.values import decode, encode

EDITABLE = (Kind.MODEL, Kind.HTTP, Kind.TOOL, Kind.OUTCOME, Kind.EFFECT, Kind.MCP)


def _body_text(obs: Mapping[str, Any]) -> str:
    response = obs["response"]
    return decode_body(response["body"], response.get("encoding")).decode("utf-8", "replace")


def view(obs: Mapping[str, Any]) -> dict[str, Any]:
    """The editable document of ``obs``."""
    kind = obs.get("kind")
    if kind in (Kind.TOOL, Kind.OUTCOME, Kind.MCP):
        return {"error": obs["error"]} if "error" in obs else {"result": decode(obs.get("result"))}
    if kind == Kind.EFFECT:
        return {"error": obs["error"]} if "error" in obs else {"value": decode(obs.get("value"))}
    if kind in (Kind.MODEL, Kind.HTTP) and "response" not in obs:
        raise EditError(f"step {obs.get('seq')} has no response to edit (the exchange failed:"
                        f" {(obs.get('error') or {}).get('message')})")
    if kind == Kind.MODEL:
        try:
            response = obs["response"]
            return providers.for_line(obs).message(
                response["headers"], decode_body(response["body"], response.get("encoding")))
        except ValueError as exc:
            raise EditError(f"step {obs['seq']}: the model response cannot be read as a "
                            f"message ({exc})") from None
    if kind == Kind.HTTP:
        text = _body_text(obs)
        try:
            body: Any = json.loads(text)
        except ValueError:
            body = text
        return {"status": obs["response"]["status"], "headers": obs["response"]["headers"],
                "body": body}
    raise EditError(f"step {obs.get('seq')} is a {kind!r} line; editable kinds are "
                    f"{', '.join(EDITABLE)}")


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def set_patch(pairs: list[str] | tuple[str, ...], doc: Any = None) -> list[dict[str, Any]]:
    """``PATH=VALUE`` pairs as JSON patch ``replace`` operations. A field of ``doc`` that
    holds a string stays a string: VALUE is taken as text there unless it is a JSON string."""
    ops = []
    for pair in pairs:
        path, sep, value = pair.partition("=")
        if not sep or not path:
            raise EditError(f"--set {pair!r}: expected PATH=VALUE, e.g. /result='[]' or "
                            "content.0.text=Hello")
        if not path.startswith("/"):
            path = "/" + "/".join(p.replace("~", "~0").replace("/", "~1")
                                  for p in path.removeprefix("$.").split("."))
        parsed = _parse_value(value)
        current = jsonpatch.JsonPointer(path).resolve(doc, None) if doc is not None else None
        if isinstance(current, str) and not isinstance(parsed, str):
            parsed = value
        ops.append({"op": "replace", "path": path, "value": parsed})
    return ops


def apply(doc: dict[str, Any], *, patch: list[dict[str, Any]] | None = None,
          replace: Any = None, step: int | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """The edited document and the patch that turns ``doc`` into it."""
    if replace is not None:
        return replace, jsonpatch.make_patch(doc, replace).patch
    if not isinstance(patch, list) or not all(isinstance(op, dict) for op in patch):
        raise EditError("an edit is a JSON patch: a list of operations like "
                        '{"op": "replace", "path": "/result", "value": ...}')
    try:
        edited = jsonpatch.apply_patch(copy.deepcopy(doc), patch)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
        where = f"step {step}" if step is not None else "the observation"
        paths = ", ".join(sorted(_paths(doc))[:12])
        raise EditError(f"the patch does not apply to {where}: {exc}. Its document has "
                        f"the paths: {paths} …") from None
    return edited, patch


def _paths(doc: Any, prefix: str = "") -> list[str]:
    out = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            out.append(f"{prefix}/{key}")
            if isinstance(value, (dict, list)) and len(out) < 30:
                out.extend(_paths(value, f"{prefix}/{key}"))
    elif isinstance(doc, list):
        for i, value in enumerate(doc[:3]):
            out.append(f"{prefix}/{i}")
            out.extend(_paths(value, f"{prefix}/{i}"))
    return out


def rebuild(obs: Mapping[str, Any], doc: Any, prices: PriceTable | None = None) -> dict[str, Any]:
    """The observation ``obs`` with its response side replaced by the edited ``doc``."""
    kind = obs["kind"]
    new = {k: v for k, v in obs.items() if k != "sig"}
    new["edited"] = True
    if kind in (Kind.TOOL, Kind.OUTCOME, Kind.MCP):
        return _rebuild_answer(obs, new, doc)
    if kind == Kind.EFFECT:
        if isinstance(doc, dict) and "error" in doc and "value" not in doc:
            err, _ = doc["error"], new.pop("value", None)
            new["error"] = {"type": str(err.get("type", "UnserializableValue")),
                            "module": str(err.get("module", "recorder.errors")),
                            "message": str(err.get("message", ""))}
            return new
        new.pop("error", None)  # a value given for a refused effect replaces the refusal
        new["value"] = encode((doc or {}).get("value"), where=f"edited step {obs['seq']}")
        return new
    response = dict(obs["response"])
    provider = providers.for_line(obs)
    if kind == Kind.MODEL and is_response(doc):  # an API error in place of the message
        response.update(_response_of(doc))
        data = json.dumps(doc["body"], ensure_ascii=False).encode("utf-8")
    elif kind == Kind.MODEL:
        if not isinstance(doc, dict):
            raise EditError("a model edit must leave a message object")
        streamed = provider.is_stream(response["headers"])
        data = (provider.synthesize(doc) if streamed
                else json.dumps(doc, ensure_ascii=False).encode("utf-8"))
    else:
        body = doc.get("body")
        text = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
        response["status"] = int(doc.get("status", response["status"]))
        response["headers"] = doc.get("headers", response["headers"])
        data = text.encode("utf-8")
    response["body"], encoding = encode_body(data)
    response.pop("encoding", None)
    if encoding:
        response["encoding"] = encoding
    response["headers"] = [[k, str(len(data)) if k.lower() == "content-length" else v]
                           for k, v in response["headers"]]
    new["response"] = response
    if kind == Kind.MODEL:
        _summarized(new, provider, data, prices)
    return new


def _summarized(new: dict[str, Any], provider: providers.Provider, data: bytes,
                prices: PriceTable | None) -> None:
    """What an edited model line's response says (usage, stop reason, API error) and
    what it cost, set on the line as a recording sets them."""
    response = new["response"]
    summary = provider.summarize(response["status"], response["headers"], data)
    usage = summary.get("usage") or None
    new.update(usage=usage, stop_reason=summary.get("stop_reason"),
               message_id=summary.get("message_id"),
               cost_usd=provider.cost(summary.get("model") or new.get("model"), usage,
                                      prices or PriceTable()))
    new.pop("api_error", None)
    if summary.get("error"):
        new["api_error"] = summary["error"]


def _rebuild_answer(obs: Mapping[str, Any], new: dict[str, Any], doc: Any) -> dict[str, Any]:
    """A tool's (or an MCP request's) line with its edited result or error; an MCP tool's
    result stays a ``CallToolResult`` (:func:`recorder.capture.mcp.tool_result`)."""
    if not isinstance(doc, dict) or not ({"result", "error"} & set(doc)):
        raise EditError('a tool edit must leave {"result": ...} or {"error": {...}}')
    new.pop("result", None)
    new.pop("error", None)
    if "mcp" in obs:
        new.pop("is_error", None)
    if "error" in doc:
        err = doc["error"]
        new["error"] = {"type": str(err.get("type", "Exception")),
                        "module": str(err.get("module", "builtins")),
                        "message": str(err.get("message", ""))}
        if isinstance(err.get("code"), int) and "mcp" in obs:  # a JSON-RPC error stays one
            new["error"]["code"] = err["code"]
        return new
    result = doc["result"]
    if obs["kind"] == Kind.TOOL and "mcp" in obs:
        result = mcp.tool_result(result, like=decode(obs.get("result")))
        if result.get("isError") is True:
            new["is_error"] = True
    new["result"] = encode(result, where=f"edited result of step {obs['seq']}")
    return new


def is_response(doc: Any) -> bool:
    """A model step's edited document is an HTTP response (``{"status", "body"}``, and
    ``headers``), not a message: no provider's message has both keys."""
    return (isinstance(doc, dict) and {"status", "body"} <= set(doc)
            and isinstance(doc["status"], int) and not isinstance(doc["status"], bool))


def _response_of(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The status line and headers of an HTTP response a model step is edited into;
    without headers, a JSON body's."""
    status = doc["status"]
    if not 100 <= status <= 599:
        raise EditError(f"an edited response's status must be 100-599, not {status}")
    headers = doc.get("headers") or {"content-type": "application/json"}
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise EditError('an edited response\'s headers are {"name": "value"} or '
                        '[["name", "value"], ...]')
    return {"status": status, "reason": http.client.responses.get(status, ""),
            "headers": [[str(k), str(v)] for k, v in pairs]}
