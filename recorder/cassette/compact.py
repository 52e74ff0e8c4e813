"""Model lines on disk carry only what cannot be derived; the reader restores the rest.

A model turn's line would otherwise repeat, every turn, what the line before already says.
On disk (the reader expands each line back after checking its signature):

- ``request_headers`` is the seq of an earlier model line when the headers are the same;
- ``response.headers_base`` names an earlier model line whose response headers this one
  shares: ``response.headers`` is then the edits that make this line's from that line's
  (:mod:`._headers`; the base is the one of the last few lines that needs the fewest), or,
  in a cassette whose header does not name the ``header_edits`` feature, a list as long
  as the base's whose ``null`` entries are taken from it, position by position;
- ``response.body_json`` holds a JSON body as JSON rather than as an escaped string, when
  compact re-serialisation gives back the received bytes exactly and it nests less deep
  than a line may; otherwise ``body`` keeps the text (or base64);
- ``url`` is the seq of an earlier model line when it is the same;
- ``like`` stands for all three references above when they name the same line;
- ``response.reason`` is left out when it is the standard phrase of the status;
- ``fp``, ``model`` and ``stream`` are not stored: they follow from the request; nor
  ``provider`` (from the URL), ``message_id``, ``usage``, ``stop_reason`` and
  ``api_error`` (from the response body). ``cost_usd`` is stored: it depends on the price
  table of the day it was recorded.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from recorder import (
    _fastjson,
    providers,  # a module reference: providers imports this package
)
from recorder.canonical import content_decoded, decode_body
from recorder.cassette import _headers
from recorder.cassette.schema import Kind

NO_DOC = object()  # a response body stored as text, not as JSON
_DERIVED = ("usage", "stop_reason", "api_error", "message_id", "model", "stream", "fp")


def _exact_json(text: str) -> Any:
    """The parsed body when compact re-serialisation reproduces ``text`` exactly."""
    if not text or text[0] not in "{[":
        return None
    doc = _fastjson.compact_doc(text, _fastjson.BODY_DEPTH)  # deeper: kept as text
    if doc is not _fastjson.UNDECIDED:
        return doc
    try:  # NaN, Infinity or deep nesting have no canonical form: the text is kept instead
        doc = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    if json_text(doc) != text or (_fastjson.openers(text) > _fastjson.BODY_DEPTH
                                  and _fastjson.nests_deeper(doc, _fastjson.BODY_DEPTH)):
        return None
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} has no canonical JSON form")


json_text = _fastjson.dumps_compact


HEADER_BASES = 4  # recent model lines whose response headers a line may be stored against
# A base other than the last line is taken when it saves more than this many bytes (the
# last line's is shared with its URL and request headers, as ``like``).
_OLDER_BASE_SAVING = 16


class Compactor:
    """Writer side: remembers the last model lines' headers to refer back to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._req: tuple[int, list[list[str]]] | None = None
        self._resp: deque[tuple[int, list[list[str]]]] = deque(maxlen=HEADER_BASES)
        self._url: tuple[int, str] | None = None

    def compact(self, obs: dict[str, Any], *, edits: bool = True) -> dict[str, Any]:
        """``obs`` as its line is stored; with ``edits`` (the cassette's header names the
        ``header_edits`` feature) its response headers as edits of an earlier line's."""
        with self._lock:
            req, url = self._req, self._url
            resp = list(self._resp)
        for key in _DERIVED:
            obs.pop(key, None)
        named = obs.get("provider")
        if named in providers.BUILT_IN and providers.model_provider("POST", obs["url"]) == named:
            del obs["provider"]  # a reader finds it again by the URL
        if url is not None and obs["url"] == url[1]:
            obs["url"] = url[0]
        headers = obs.get("request_headers")
        if req is not None and headers == req[1]:
            obs["request_headers"] = req[0]
        response = obs.get("response")
        if response is not None:
            if response.get("reason") == phrase(response["status"]):
                response = {k: v for k, v in response.items() if k != "reason"}
            if response.get("encoding") is None:
                doc = _exact_json(response["body"])
                if doc is not None:
                    response = {**response, "body_json": doc}
                    del response["body"]
            response = (_edited(response, resp) if edits
                        else _positional(response, resp[-1] if resp else None))
            obs["response"] = response
        ref = obs.get("url")
        if (isinstance(ref, int) and obs.get("request_headers") == ref and response is not None
                and response.get("headers_base") == ref):
            del obs["url"], obs["request_headers"]
            obs["response"] = {k: v for k, v in response.items() if k != "headers_base"}
            obs["like"] = ref
        return obs

    def written(self, seq: int, url: str, request_headers: Any, response_headers: Any) -> None:
        with self._lock:
            self._url = (seq, url)
            if isinstance(request_headers, list):
                self._req = (seq, request_headers)
            if isinstance(response_headers, list):
                self._resp.append((seq, response_headers))


def _positional(response: dict[str, Any], last: tuple[int, list[list[str]]] | None
                ) -> dict[str, Any]:
    """The older form: ``null`` for each header the same as the last line's, position by
    position, when the two lists are as long and share two or more."""
    if last is None or len(last[1]) != len(response["headers"]):
        return response
    same = [a == b for a, b in zip(last[1], response["headers"], strict=True)]
    if sum(same) < 2:
        return response
    return {**response, "headers_base": last[0],
            "headers": [None if s else h for s, h in zip(same, response["headers"], strict=True)]}


def _edited(response: dict[str, Any], bases: list[tuple[int, list[list[str]]]]
            ) -> dict[str, Any]:
    """The response with its headers as the edits of the recent line's that need the
    fewest bytes (the last line's unless another saves more than a reference costs),
    when they take fewer bytes than the headers themselves."""
    headers = response["headers"]
    best: tuple[int, int, list[Any]] | None = None
    for seq, base in reversed(bases):  # newest first
        script = _headers.edits(base, headers)
        cost = _headers.size(script) + (_OLDER_BASE_SAVING if best is not None else 0)
        if (best is None or cost < best[0]) and _headers.gives(base, script, headers):
            best = (cost, seq, script)
    if best is None or best[0] >= _headers.size(headers):
        return response
    return {**response, "headers_base": best[1], "headers": best[2]}


def phrase(status: int) -> str:
    return http.client.responses.get(status, "")


def reply_items(line: Mapping[str, Any], headers: Any = None) -> list[Any] | None:
    """The items the response of model ``line`` (as written, or restored) gives its
    conversation (:func:`recorder.providers.replied`): read from a body stored as JSON, or
    from a stream its provider assembles (``headers``: the response's, as received; the
    line's own when not given); None for anything else."""
    response = line.get("response") or {}
    if "body_json" in response:
        return providers.replied(response["body_json"])
    if line.get("kind") != Kind.MODEL or response.get("encoding") is not None \
            or not isinstance(response.get("body"), str):
        return None
    provider = providers.for_line(line)
    headers = response.get("headers") if headers is None else headers
    try:
        if provider.is_stream(headers or []):
            return providers.replied(provider.assemble(response["body"]))
        return providers.replied(json.loads(response["body"]))
    except (ValueError, RecursionError):  # not JSON, or a stream it cannot assemble
        return None


def reply_message(line: dict[str, Any], provider: str | None = None,
                  headers: Any = None) -> Callable[[], list[Any] | None]:
    """Writer side: how to find :func:`reply_items` of the compacted model ``line``, asked
    only when a later request may resend them (``provider`` and ``headers``: the line's
    before it was compacted). A reader finds the same items from the same line."""
    found = line if provider is None else {**line, "provider": provider}
    return lambda: reply_items(found, headers)


def expand(line: dict[str, Any], earlier: Sequence[Mapping[str, Any]] | Any, request: Any,
           fp: str | None = None, fast: bool = False) -> None:
    """Reader side: restore a model line in place; ``earlier[seq]`` gives the restored URL,
    request headers and response headers of a line before it (:mod:`.lines` restores only
    those), ``request`` is its full request and ``fp`` its fingerprint (worked out from
    the request when not given; without either, the line has none); ``fast``: its JSON
    body may be written back by orjson (:func:`restore_body`)."""
    like = line.pop("like", None)
    if like is not None:  # the URL, request headers and response headers of that line
        line["url"] = line["request_headers"] = like
        if isinstance(line.get("response"), dict):
            line["response"]["headers_base"] = like
    if isinstance(line.get("url"), int):
        line["url"] = earlier[line["url"]]["url"]
    url = line.get("url") or ""
    provider = provider_of(line, url)
    headers = line.get("request_headers")
    if isinstance(headers, int):
        line["request_headers"] = earlier[headers]["request_headers"]
    response = line.get("response")
    if response is not None:
        doc = restore_body(response, fast=fast)
        base = response.pop("headers_base", None)
        if base is not None:
            response["headers"] = based(response["headers"],
                                        earlier[base]["response"]["headers"])
        if "usage" not in line:
            status, headers = response.get("status", 0), response.get("headers") or []
            if response.get("encoding") is None:
                body = response["body"].encode("utf-8")
            else:  # binary: a compressed body is read as the SDK reads it
                try:
                    body = content_decoded(decode_body(response["body"], response["encoding"]),
                                           headers)
                except ValueError:
                    body = b""
            summary = (provider.summarize(status, headers, body) if doc is NO_DOC
                       else provider.summarize_parsed(status, headers, body, doc))
            line["usage"] = summary.get("usage") or None
            line["stop_reason"] = summary.get("stop_reason")
            line["message_id"] = summary.get("message_id")
            if summary.get("error"):
                line["api_error"] = summary["error"]
    if isinstance(request, dict):
        line.setdefault("model", provider.request_model(request, url))
        line.setdefault("stream", provider.request_streams(request, url))
    if "fp" not in line and (fp is not None or request is not None):
        line["fp"] = fp if fp is not None else provider.fingerprint("POST", url, request)
    line.setdefault("message_id", None)


def restore_body(response: dict[str, Any], fast: bool = False) -> Any:
    """A stored response's body back as the text received (a JSON document stored parsed
    is written out again; ``fast``: by orjson, which the line's bytes allow,
    :func:`._fastjson.exact_for`) and its reason phrase, in place; the document, else
    :data:`NO_DOC`."""
    doc = NO_DOC
    if "body_json" in response:
        doc = response.pop("body_json")
        response["body"] = (_fastjson.dumps_compact_fast if fast else json_text)(doc)
    response.setdefault("reason", phrase(response.get("status", 0)))
    return doc


def provider_of(line: dict[str, Any], url: str) -> providers.Provider:
    """The provider of a stored model line, which names it only when its URL does not
    (``line`` gets its name)."""
    if "provider" not in line:
        line["provider"] = providers.model_provider("POST", url) or providers.default().name
    return providers.for_line(line)


def based(headers: list[Any], base: list[list[str]]) -> list[list[str]]:
    """Headers stored against ``base``: edits (:mod:`._headers`), or the older form."""
    if _headers.is_edits(headers):
        return _headers.applied(base, headers)
    return [b if h is None else h for h, b in zip(headers, base, strict=True)]
