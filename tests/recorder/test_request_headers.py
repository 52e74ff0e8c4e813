"""A request's headers as the httpx stub hands them to deja: decoded when first read (a
replay that knows a request by its bytes never reads them), and then exactly httpx's
pairs, repeated names and their order kept, as a recording stores them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import httpx2
import pytest

import recorder
import replayer
from recorder.capture._httpx import _request
from recorder.cassette import load

PAIRS = [("x-tag", "first"), ("accept", "application/json"), ("X-Tag", "second"),
         ("x-note", "café".encode())]  # not ASCII: httpx decodes it as UTF-8


@pytest.mark.parametrize("httpx_module", [httpx, httpx2], ids=["httpx", "httpx2"])
def test_headers_are_decoded_when_first_read_and_are_httpx_pairs(httpx_module: Any) -> None:
    real = httpx_module.Request("POST", "http://127.0.0.1:9/v1/messages", headers=PAIRS,
                                content=b"{}")
    req = _request(real, b"{}")
    assert req.headers._pairs is None  # nothing decoded yet
    assert list(req.headers) == real.headers.multi_items()
    assert req.headers._pairs is not None
    assert len(req.headers) == len(real.headers.multi_items())
    assert req.headers[0] == real.headers.multi_items()[0]
    assert req.headers[-2:] == real.headers.multi_items()[-2:]
    names = [name for name, _ in req.headers]
    assert names.count("x-tag") == 2 and names.index("x-tag") < names.index("accept")


def test_repeated_request_headers_are_recorded_in_order_and_replayed(stub, tmp_path) -> None:
    server = stub({"default": {"text": "ok"}})
    body = json.dumps({"model": "claude-sonnet-4-6", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = [("x-api-key", "sk-test"), ("anthropic-version", "2023-06-01"),
               ("content-type", "application/json"), *PAIRS]
    path = tmp_path / "headers.jsonl"
    with recorder.record(path), httpx2.Client() as client:
        live = client.post(f"{server.url}/v1/messages", headers=headers, content=body)
    assert live.status_code == 200
    stored = load(path).observations[0]["request_headers"]
    tagged = [pair for pair in stored if pair[0].lower() in ("x-tag", "x-note")]
    assert tagged == [["x-tag", "first"], ["x-tag", "second"], ["x-note", "café"]]
    with replayer.replay(path), httpx2.Client() as client:
        again = client.post(f"{server.url}/v1/messages", headers=headers, content=body)
    assert again.content == live.content
