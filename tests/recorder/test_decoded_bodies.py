"""A compressed response recorded through a client that decodes it itself.

requests, urllib3 and aiohttp hand deja the decoded body under the ``content-encoding``
header it came with. Its secrets are taken out all the same (before, the body did not
decompress as its header said and was stored as it was, secrets and all), and a replay
through the same client gives the program what it got, redacted.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import aiohttp
import httpx2
import pytest
import requests
from conftest import http_server

import recorder
import replayer
from recorder.capture.redact import DEFAULT

SECRET = "sk-ant-api03-" + "Q7x" * 14


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = gzip.compress(json.dumps({"token": SECRET, "note": "hello"}).encode())
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-encoding", "gzip")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def url() -> Iterator[str]:
    with http_server(_Handler) as base:
        yield base + "/data"


def _requests(url: str) -> dict[str, Any]:
    return requests.get(url, timeout=30).json()


def _aiohttp(url: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return json.loads(await response.read())
    return asyncio.run(go())


def _httpx2(url: str) -> dict[str, Any]:
    with httpx2.Client() as client:
        return client.get(url).json()


@pytest.mark.parametrize("client", [_requests, _aiohttp, _httpx2],
                         ids=["requests", "aiohttp", "httpx2"])
def test_a_secret_in_a_compressed_response_never_reaches_disk(
        url: str, tmp_path, client: Callable[[str], dict[str, Any]]) -> None:
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        live = client(url)
    assert live["token"] == SECRET  # the program got its answer
    data = path.read_bytes()
    assert SECRET.encode() not in data
    with replayer.replay(path):
        again = client(url)
    assert again["note"] == "hello"
    assert again["token"] != SECRET and "redacted" in again["token"].lower()


def test_a_body_said_compressed_that_is_text_is_redacted_as_it_is() -> None:
    plain = json.dumps({"token": SECRET}).encode()
    for coding in ("gzip", "deflate", "br", "zstd"):
        stored, headers = DEFAULT.response_body(
            plain, [("content-encoding", coding), ("content-length", str(len(plain)))])
        assert SECRET.encode() not in stored, coding
        assert headers[1] == ("content-length", str(len(stored)))
    compressed = gzip.compress(plain)
    stored, _ = DEFAULT.response_body(compressed, [("content-encoding", "gzip")])
    assert SECRET.encode() not in gzip.decompress(stored)
    binary = bytes(range(256)) * 4  # br or zstd bytes, which are not read: as received
    assert DEFAULT.response_body(binary, [("content-encoding", "br")])[0] == binary
