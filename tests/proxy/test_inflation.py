"""The proxy's inflation counter (``deja.proxy._bounds.Inflation``) on br and zstd bodies, as
on gzip ones: a valid body fed in pieces of any size reads as the whole body decoded, a
body that inflates past the limit is refused before its output is held, and bytes that
are not such data are read as they are."""

from __future__ import annotations

import gzip
import tracemalloc
from collections.abc import Callable

import brotli
import pytest
import zstandard

from deja.proxy._bounds import Inflation, decoded_within
from recorder.canonical import content_decoded
from recorder.errors import ResponseTooLarge

MIB = 1024 * 1024
CODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress, "br": brotli.compress,
    "zstd": lambda data: zstandard.ZstdCompressor().compress(data[:5000])
    + zstandard.ZstdCompressor().compress(data[5000:])}  # two frames: both are read
PLAIN = b'{"usage": {"input_tokens": 3}, "text": "' + b"words and more words " * 2000 + b'"}'


@pytest.mark.parametrize("coding", sorted(CODERS))
@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 30])
def test_a_body_fed_in_pieces_reads_as_the_whole_body(coding: str, piece: int) -> None:
    body = CODERS[coding](PLAIN)
    headers = [("content-encoding", coding)]
    counter = Inflation.of(headers, 10 * MIB, keep=True)
    assert counter is not None
    for at in range(0, len(body), piece):
        assert counter.feed(body[at:at + piece]) is False
    assert counter.body(body) == PLAIN == content_decoded(body, headers)
    assert decoded_within(body, headers, 10 * MIB) == PLAIN


@pytest.mark.parametrize("coding", ["br", "zstd"])
def test_a_bomb_is_refused_while_its_output_stays_small(coding: str) -> None:
    zeros = bytes(512 * MIB)
    bomb = brotli.compress(zeros, quality=1) if coding == "br" else \
        zstandard.ZstdCompressor(level=1).compress(zeros)
    del zeros
    assert len(bomb) < 256 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(ResponseTooLarge, match=rf"once inflated \({coding}\)"):
            decoded_within(bomb, [("content-encoding", coding)], 16 * MIB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * MIB, peak  # well under the 512 MiB it inflates to


@pytest.mark.parametrize("coding", ["br", "zstd"])
def test_bytes_that_are_not_such_data_are_read_as_they_are(coding: str) -> None:
    junk = b"this is not compressed at all, whatever its header says " * 10
    assert decoded_within(junk, [("content-encoding", coding)], MIB) == junk
    assert content_decoded(junk, [("content-encoding", coding)]) == junk
