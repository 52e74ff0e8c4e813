"""A compressed response (gzip, deflate, br, zstd) recorded through a client that decodes
it itself.

requests, urllib3 and aiohttp hand deja the decoded body under the ``content-encoding``
header it came with (br too, brotli being installed with deja). It is stored as the wire
had it, compressed again, so that a replay through any client gives the program what it
got (before, httpx and the proxy failed to decompress such a body, and requests and
aiohttp were handed the compressed bytes of a body httpx or urllib recorded); its secrets
are taken out all the same.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import aiohttp
import brotli
import httpx2
import pytest
import requests
import zstandard
from conftest import http_server

import recorder
import replayer
from recorder.canonical import content_encoded
from recorder.capture.redact import DEFAULT

SECRET = "sk-ant-api03-" + "Q7x" * 14


CODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress,
    "zstd": zstandard.ZstdCompressor().compress}
DECODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.decompress, "deflate": zlib.decompress, "br": brotli.decompress,
    "zstd": lambda data: zstandard.ZstdDecompressor().decompressobj().decompress(data)}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # /data (gzip), /deflate, /br or /zstd
        coding = self.path.rpartition("/")[2]
        coding = coding if coding in CODERS else "gzip"
        body = CODERS[coding](json.dumps({"token": SECRET, "note": "hello"}).encode())
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-encoding", coding)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def url() -> Iterator[str]:
    with http_server(_Handler) as base:
        yield base + "/data"


def _read(data: bytes, coding: str) -> dict[str, Any]:
    """A body the client decoded, or one it hands on as it came (zstd, which urllib3,
    aiohttp and httpx decode only with a zstd module deja does not install), decoded
    here."""
    try:
        return json.loads(data)
    except ValueError:
        return json.loads(DECODERS[coding](data))


def _requests(url: str) -> dict[str, Any]:
    response = requests.get(url, timeout=30)
    return _read(response.content, response.headers["content-encoding"])


def _aiohttp(url: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, \
                session.get(url, auto_decompress=not url.endswith("/zstd")) as response:
            return _read(await response.read(), response.headers["content-encoding"])
    return asyncio.run(go())


def _httpx2(url: str) -> dict[str, Any]:
    with httpx2.Client() as client:
        response = client.get(url)
        return _read(response.content, response.headers["content-encoding"])


def _urllib(url: str) -> dict[str, Any]:  # http.client: the program decodes the body
    with urllib.request.urlopen(url, timeout=30) as response:
        coding = response.headers["content-encoding"]
        data = response.read()
    return json.loads(DECODERS[coding](data))


CLIENTS = {"requests": _requests, "aiohttp": _aiohttp, "httpx2": _httpx2, "urllib": _urllib}


@pytest.mark.parametrize("coding", ["gzip", "br", "zstd"])
@pytest.mark.parametrize("client", [_requests, _aiohttp, _httpx2],
                         ids=["requests", "aiohttp", "httpx2"])
def test_a_secret_in_a_compressed_response_never_reaches_disk(
        url: str, tmp_path, client: Callable[[str], dict[str, Any]], coding: str) -> None:
    where = url.replace("/data", f"/{coding}")
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        live = client(where)
    assert live["token"] == SECRET  # the program got its answer
    data = path.read_bytes()
    assert SECRET.encode() not in data
    response = next(json.loads(line)["response"] for line in data.splitlines()
                    if b'"kind":"http"' in line)
    assert SECRET.encode() not in DECODERS[coding](base64.b64decode(response["body"]))
    with replayer.replay(path):
        again = client(where)
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
    binary = bytes(range(256)) * 4  # not br, nor zstd data: kept as received
    for coding in ("br", "zstd"):
        assert DEFAULT.response_body(binary, [("content-encoding", coding)])[0] == binary
    # a coding deja does not read: kept as received, unless it is text (then redacted)
    assert DEFAULT.response_body(binary, [("content-encoding", "compress")])[0] == binary
    text = json.dumps({"token": SECRET}).encode()
    assert SECRET.encode() not in DEFAULT.response_body(
        text, [("content-encoding", "compress")])[0]


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
@pytest.mark.parametrize("recorded_by", sorted(CLIENTS))
def test_a_compressed_response_is_stored_as_the_wire_had_it_and_replays_in_any_client(
        url: str, tmp_path, recorded_by: str, coding: str) -> None:
    where = url.replace("/data", f"/{coding}")
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        assert CLIENTS[recorded_by](where)["note"] == "hello"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    response = next(line["response"] for line in lines if line.get("kind") == "http")
    assert response["encoding"] == "base64"  # compressed bytes, not the decoded text
    stored = base64.b64decode(response["body"])
    plain = DECODERS[coding](stored)
    assert json.loads(plain)["note"] == "hello"
    assert SECRET.encode() not in plain  # redacted inside the compressed bytes
    for name, client in CLIENTS.items():
        with replayer.replay(path):
            again = client(where)
        assert again["note"] == "hello", name
        assert again["token"] != SECRET, name


def test_content_encoded_compresses_only_a_body_its_header_says_is_compressed() -> None:
    plain = b'{"a": 1}'
    for coding, decode in (("gzip", gzip.decompress), ("x-gzip", gzip.decompress),
                           ("deflate", zlib.decompress), ("br", brotli.decompress),
                           ("zstd", DECODERS["zstd"])):
        wire = content_encoded(plain, [("Content-Encoding", coding)])
        assert wire != plain and decode(wire) == plain, coding
        assert content_encoded(wire, [("content-encoding", coding)]) == wire, coding
    assert content_encoded(plain, []) == plain
    assert content_encoded(plain, [("content-encoding", "identity")]) == plain
    assert content_encoded(plain, [("content-encoding", "compress")]) == plain  # not read
    assert content_encoded(b"", [("content-encoding", "gzip")]) == b""
