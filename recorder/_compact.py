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
- ``fp``, ``model`` and ``stream`` are not stored: they follow from the request, and
  ``message_id`` from the response.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

from .exchange import fingerprint


def _exact_json(text: str) -> Any:
    """The parsed body when compact re-serialisation reproduces ``text`` exactly."""
    if not text or text[0] not in "{[":
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if json.dumps(doc, separators=(",", ":"), ensure_ascii=False) != text:
        return None
    return doc


def json_text(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


class Compactor:
    """Writer side: remembers the last model line's headers to refer back to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._req: tuple[int, list[list[str]]] | None = None
        self._resp: tuple[int, list[list[str]]] | None = None

    def compact(self, obs: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            req, resp = self._req, self._resp
        headers = obs.get("request_headers")
        if req is not None and headers == req[1]:
            obs["request_headers"] = req[0]
        response = obs.get("response")
        if response is not None:
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
        return obs

    def written(self, seq: int, request_headers: Any, response_headers: Any) -> None:
        with self._lock:
            if isinstance(request_headers, list):
                self._req = (seq, request_headers)
            if isinstance(response_headers, list):
                self._resp = (seq, response_headers)


def expand(line: dict[str, Any], earlier: dict[int, dict[str, Any]], request: Any) -> None:
    """Reader side: restore a model line in place; ``earlier`` maps seq to expanded lines."""
    headers = line.get("request_headers")
    if isinstance(headers, int):
        line["request_headers"] = earlier[headers]["request_headers"]
    response = line.get("response")
    if response is not None:
        if "body_json" in response:
            response["body"] = json_text(response.pop("body_json"))
        base = response.pop("headers_base", None)
        if base is not None:
            base_headers = earlier[base]["response"]["headers"]
            response["headers"] = [b if h is None else h
                                   for h, b in zip(response["headers"], base_headers, strict=True)]
    if isinstance(request, dict):
        line.setdefault("model", request.get("model"))
        line.setdefault("stream", bool(request.get("stream")))
    line.setdefault("fp", fingerprint("model", "POST", line.get("url", ""), request))
    if "message_id" not in line:
        found = _ID.search(response["body"], 0, 600) if response is not None else None
        line["message_id"] = found.group(1) if found else None


_ID = re.compile(r'"id"\s*:\s*"([^"]+)"')
