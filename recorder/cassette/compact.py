"""Model lines on disk carry only what cannot be derived; the reader restores the rest.

A model turn's line would otherwise repeat, every turn, what the line before already says.
On disk (the reader expands each line back after checking its signature):

- ``request_headers`` is the seq of an earlier model line when the headers are the same;
- ``response.headers_base`` names an earlier model line whose response headers this one
  shares; ``null`` entries of ``response.headers`` are taken from it, position by position
  (so header order is kept exactly);
- ``response.body_json`` holds a JSON body as JSON rather than as an escaped string, when
  compact re-serialisation gives back the received bytes exactly; otherwise ``body`` keeps
  the text (or base64);
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
from collections.abc import Mapping, Sequence
from typing import Any

from recorder import providers  # a module reference: providers imports this package
from recorder.canonical import Parts, content_decoded, decode_body
from recorder.cassette.schema import Kind

_NO_DOC = object()  # a response body stored as text, not as JSON
_DERIVED = ("usage", "stop_reason", "api_error", "message_id", "model", "stream", "fp")


def _exact_json(text: str) -> Any:
    """The parsed body when compact re-serialisation reproduces ``text`` exactly."""
    if not text or text[0] not in "{[":
        return None
    try:  # NaN, Infinity or deep nesting have no canonical form: the text is kept instead
        doc = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    if json.dumps(doc, separators=(",", ":"), ensure_ascii=False) != text:
        return None
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} has no canonical JSON form")


def json_text(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


class Compactor:
    """Writer side: remembers the last model line's headers to refer back to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._req: tuple[int, list[list[str]]] | None = None
        self._resp: tuple[int, list[list[str]]] | None = None
        self._url: tuple[int, str] | None = None

    def compact(self, obs: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            req, resp, url = self._req, self._resp, self._url
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
            if response.get("reason") == _phrase(response["status"]):
                response = {k: v for k, v in response.items() if k != "reason"}
            if response.get("encoding") is None:
                doc = _exact_json(response["body"])
                if doc is not None:
                    response = {**response, "body_json": doc}
                    del response["body"]
            if resp is not None and len(resp[1]) == len(response["headers"]):
                same = [a == b for a, b in zip(resp[1], response["headers"], strict=True)]
                if sum(same) >= 2:
                    response = {**response, "headers_base": resp[0],
                                "headers": [None if s else h for s, h in
                                            zip(same, response["headers"], strict=True)]}
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
                self._resp = (seq, response_headers)


def _phrase(status: int) -> str:
    return http.client.responses.get(status, "")


def reply_of(doc: Any) -> Any:
    """The message a response body (parsed JSON) gives its conversation, by the format's
    own rule rather than any provider's: the ``role`` and ``content`` of a body whose
    ``type`` is ``"message"`` (the Messages API's shape); None for anything else. A
    request that resends it exactly stores a reference instead (:mod:`._delta`)."""
    if (isinstance(doc, dict) and doc.get("type") == "message"
            and isinstance(doc.get("role"), str) and isinstance(doc.get("content"), list)):
        return {"role": doc["role"], "content": doc["content"]}
    return None


def reply_message(line: dict[str, Any]) -> Any:
    """Writer side: :func:`reply_of` the compacted model ``line``'s response, when its body
    is stored as JSON; None otherwise. A reader finds the same one from the same line."""
    doc = (line.get("response") or {}).get("body_json", _NO_DOC)
    return None if doc is _NO_DOC else reply_of(doc)


class Replies(dict[int, Any]):
    """Reader side: seq -> the message the response of that model line gives its
    conversation, filled as lines are restored (from a body stored as JSON) and otherwise
    worked out when a request refers to it (a line copied into a fork holds its body as
    text). A line with no such message is a ``KeyError``, as for any missing reference."""

    def __init__(self, earlier: Sequence[Mapping[str, Any]]) -> None:
        super().__init__()
        self._earlier = earlier

    def __missing__(self, seq: int) -> Any:
        line = self._earlier[seq]
        response = line.get("response") or {}
        if line.get("kind") != Kind.MODEL or response.get("encoding") is not None:
            raise KeyError(seq)
        try:
            reply = reply_of(json.loads(response["body"]))
        except ValueError:  # a stream, or not JSON: it has no such message
            raise KeyError(seq) from None
        if reply is None:
            raise KeyError(seq)
        self[seq] = reply
        return reply


def expand(line: dict[str, Any], earlier: Sequence[Mapping[str, Any]], request: Any,
           parts: Parts | None = None, replies: dict[int, Any] | None = None) -> None:
    """Reader side: restore a model line in place; ``earlier`` holds the lines before it,
    ``parts`` the digests of the request parts seen so far (the fingerprint of a request
    hashes only what it adds to its conversation); ``replies`` gets the message its
    response gives the conversation, for the requests after it that refer to it."""
    like = line.pop("like", None)
    if like is not None:  # the URL, request headers and response headers of that line
        line["url"] = line["request_headers"] = like
        if isinstance(line.get("response"), dict):
            line["response"]["headers_base"] = like
    if isinstance(line.get("url"), int):
        line["url"] = earlier[line["url"]]["url"]
    url = line.get("url") or ""
    if "provider" not in line:
        line["provider"] = providers.model_provider("POST", url) or providers.default().name
    provider = providers.for_line(line)
    headers = line.get("request_headers")
    if isinstance(headers, int):
        line["request_headers"] = earlier[headers]["request_headers"]
    response = line.get("response")
    if response is not None:
        doc = _NO_DOC
        if "body_json" in response:
            doc = response.pop("body_json")
            response["body"] = json_text(doc)
            if replies is not None:
                reply = reply_of(doc)
                if reply is not None:
                    replies[line["seq"]] = reply
        response.setdefault("reason", _phrase(response.get("status", 0)))
        base = response.pop("headers_base", None)
        if base is not None:
            base_headers = earlier[base]["response"]["headers"]
            response["headers"] = [b if h is None else h
                                   for h, b in zip(response["headers"], base_headers, strict=True)]
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
            summary = (provider.summarize(status, headers, body) if doc is _NO_DOC
                       else provider.summarize_parsed(status, headers, body, doc))
            line["usage"] = summary.get("usage") or None
            line["stop_reason"] = summary.get("stop_reason")
            line["message_id"] = summary.get("message_id")
            if summary.get("error"):
                line["api_error"] = summary["error"]
    if isinstance(request, dict):
        line.setdefault("model", provider.request_model(request, url))
        line.setdefault("stream", provider.request_streams(request, url))
    if "fp" not in line:
        line["fp"] = provider.fingerprint("POST", url, request, parts)
    line.setdefault("message_id", None)
