"""A compressed body is read no further than deja's limit (64 MiB), whatever reads it.

deja decodes a response body to read its usage and to redact it, and a replay, ``deja
show``, ``deja stub --from`` and ``deja export`` decode the bodies a cassette holds (an
untrusted input). A small gzip, br or zstd body can inflate to gigabytes: each is read to
the limit and no further, and past it the body is kept as it came and not read. A real
``deja record`` of a program that takes a 1 GiB br or zstd bomb without decoding it, and
a replay and ``deja show`` of that cassette, stay far below the size it inflates to.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import brotli
import pytest
import zstandard
from conftest import http_server

from recorder.canonical import CodingError, Inflated, compress, content_decoded, decompress
from recorder.capture.redact import DEFAULT

MIB = 1024 * 1024
HEAD = b'{"id": "msg_1", "type": "message", "content": [{"type": "text", "text": "'


def bomb(coding: str, mib: int) -> bytes:
    """A JSON body whose text is ``mib`` MiB of "A", compressed as ``coding`` a MiB at a
    time (never held whole)."""
    block = b"A" * MIB
    if coding == "br":
        encoder = brotli.Compressor(quality=1)
        parts = [encoder.process(HEAD)] + [encoder.process(block) for _ in range(mib)]
        return b"".join(parts) + encoder.process(b'"}]}') + encoder.finish()
    if coding == "zstd":
        writer = zstandard.ZstdCompressor(level=1).compressobj()
        parts = [writer.compress(HEAD)] + [writer.compress(block) for _ in range(mib)]
        return b"".join(parts) + writer.compress(b'"}]}') + writer.flush()
    deflater = zlib_gzip()
    parts = [deflater.compress(HEAD)] + [deflater.compress(block) for _ in range(mib)]
    return b"".join(parts) + deflater.compress(b'"}]}') + deflater.flush()


def zlib_gzip() -> Any:
    import zlib

    return zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
def test_a_body_is_decoded_to_the_limit_and_no_further(coding: str) -> None:
    plain = b"hello " * 1000
    assert decompress(compress(plain, coding), coding) == plain
    big = compress(bytes(3 * MIB), coding)
    tracemalloc.start()
    try:
        with pytest.raises(Inflated, match=f"the {coding} body inflates past {MIB} bytes"):
            decompress(big, coding, limit=MIB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * MIB, peak  # never the whole 3 MiB (the limit, and a copy of it)
    assert decompress(big, coding, limit=3 * MIB) == bytes(3 * MIB)
    with pytest.raises(CodingError):
        decompress(b"not compressed, whatever the header says", coding)


@pytest.mark.parametrize("coding", ["gzip", "br", "zstd"])
def test_a_bomb_is_kept_as_it_came_and_not_read(coding: str) -> None:
    body = bomb(coding, 200)  # 200 MiB of text, past the 64 MiB limit
    headers = [("content-encoding", coding), ("content-type", "application/json")]
    tracemalloc.start()
    try:
        assert content_decoded(body, headers) == body
        assert DEFAULT.response_body(body, headers) == (body, headers)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 * MIB, peak


def test_a_zstd_frame_that_asks_for_a_window_past_http_s_is_not_read() -> None:
    params = zstandard.ZstdCompressionParameters.from_level(  # a 64 MiB window, said
        19, window_log=26, write_content_size=False)
    writer = zstandard.ZstdCompressor(compression_params=params).compressobj()
    body = writer.compress(os.urandom(1024)) + writer.flush()
    assert zstandard.get_frame_parameters(body).window_size == 64 * MIB
    with pytest.raises(CodingError, match="too much memory"):
        decompress(body, "zstd")


class _Bomb(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    bodies: dict[str, bytes] = {}

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        coding = self.path.strip("/")
        body = self.bodies[coding]
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-encoding", coding)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


AGENT = """\
import asyncio, os, sys

import aiohttp


async def main():
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.post(os.environ["BOMB_URL"], json={"q": 1}) as response:
            print(len(await response.read()), flush=True)


asyncio.run(main())
"""


@pytest.fixture
def server() -> Iterator[str]:
    _Bomb.bodies = {coding: bomb(coding, 1024) for coding in ("br", "zstd")}  # 1 GiB each
    with http_server(_Bomb) as base:
        yield base


def _peak_mib(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    """The peak resident memory of a child running ``args`` (MiB), and what it said."""
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], "
            "capture_output=True, text=True); print(p.returncode, file=sys.stderr); "
            "sys.stderr.write(p.stdout + p.stderr); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.stderr.startswith("0\n"), done.stderr
    return int(done.stdout.strip()) / 1024, done.stderr


@pytest.mark.parametrize("coding", ["br", "zstd"])
def test_recording_and_replaying_a_bomb_stays_small(server: str, tmp_path: Path,
                                                    coding: str) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    env = {**os.environ, "BOMB_URL": f"{server}/{coding}"}
    deja = [sys.executable, "-m", "deja"]
    recorded, said = _peak_mib([*deja, "record", "-o", "run.jsonl", "--", sys.executable,
                                "agent.py"], tmp_path, env)
    assert str(len(_Bomb.bodies[coding])) in said  # the program got the bytes as they came
    replayed, said = _peak_mib([*deja, "replay", "run.jsonl", "--", sys.executable,
                                "agent.py"], tmp_path, env)
    assert "identical" in said, said
    shown, _ = _peak_mib([*deja, "show", "run.jsonl"], tmp_path, env)
    for peak in (recorded, replayed, shown):  # it inflates to 1024 MiB
        assert peak < 400, (recorded, replayed, shown)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 < 1024
