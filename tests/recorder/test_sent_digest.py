"""The digest of a request's bytes as sent (``sent``), worked out from where a request stops
repeating a recent one: always :func:`sent_digest`'s, and a conversation's growing
requests cost only what each adds.

The requests are the bytes a conversation's SDK sends (its history resent, new items at
the end of the list, the settings after it), others built to differ anywhere, and
conversations that interleave; every digest is compared with SHA-256 of the whole body,
and the bytes the hash reads are counted.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from typing import Any

import pytest

from recorder.capture import exchange
from recorder.capture.exchange import SentDigests, sent_digest

BLOCK = SentDigests.BLOCK
SHA256 = hashlib.sha256


def conversation(turns: int, seed: int, size: int = 1500) -> list[bytes]:
    """The request bodies of a conversation of ``turns`` turns, as an SDK writes them."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {seed}"}]
    out = []
    for turn in range(turns):
        body = {"max_tokens": 1024, "messages": messages, "model": "claude-sonnet-4-6",
                "tools": [{"name": "search", "input_schema": {"type": "object"}}]}
        out.append(json.dumps(body, separators=(",", ":")).encode())
        text = "".join(rng.choice("abcdefgh ") for _ in range(size))
        messages = [*messages, {"role": "assistant", "content": f"turn {turn}"},
                    {"role": "user", "content": text}]
    return out


class Counting:
    """``hashlib.sha256`` as the module uses it, counting the bytes it reads."""

    def __init__(self) -> None:
        self.read = 0

    def __call__(self, data: bytes = b"") -> Any:
        counter = self

        class Hash:
            def __init__(self, inner: Any) -> None:
                self._inner = inner

            def update(self, more: bytes) -> None:
                counter.read += len(more)
                self._inner.update(more)

            def copy(self) -> Hash:
                return Hash(self._inner.copy())

            def digest(self) -> bytes:
                return bytes(self._inner.digest())

        self.read += len(data)
        return Hash(SHA256(data))


def test_each_digest_is_the_whole_bodys_and_a_growing_conversation_hashes_what_it_adds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counting = Counting()
    monkeypatch.setattr(exchange.hashlib, "sha256", counting)
    digests = SentDigests()
    bodies = conversation(60, seed=1)
    for n, body in enumerate(bodies):
        before = counting.read
        assert digests(body) == sent_digest(body)
        if n > 2:  # what it read: from the last block it shares with the one before
            added = len(body) - len(bodies[n - 1])
            assert counting.read - before - len(body) < added + 3 * BLOCK + 512
    assert len(bodies[-1]) > 20 * BLOCK  # long enough for hashing it whole to show
    whole = sum(len(b) for b in bodies)
    assert counting.read - whole < whole / 4  # sent_digest above read each body whole


@pytest.mark.parametrize("seed", range(6))
def test_bodies_that_differ_anywhere_interleaved_get_the_whole_bodys_digest(seed: int) -> None:
    rng = random.Random(seed)
    digests = SentDigests()
    base = conversation(30, seed=seed, size=700)
    others = conversation(30, seed=seed + 100, size=700)
    pool = [*base, *others]
    for _ in range(150):
        body = bytearray(rng.choice(pool))
        change = rng.randrange(4)
        if change == 1 and body:  # one byte changed somewhere
            at = rng.randrange(len(body))
            body[at] = (body[at] + 1) % 256
        elif change == 2:  # cut at a block boundary, or anywhere
            body = body[:rng.choice([BLOCK, 2 * BLOCK, rng.randrange(len(body) + 1)])]
        elif change == 3:  # grown by a block's worth exactly
            body += bytes(rng.randrange(256) for _ in range(BLOCK))
        data = bytes(body)
        assert digests(data) == sent_digest(data), (seed, change, len(data))
    for data in (b"", b"{}", bytes(BLOCK), bytes(2 * BLOCK), bytes(2 * BLOCK + 1)):
        assert digests(data) == sent_digest(data)


def test_threads_hashing_at_once_get_each_bodys_digest() -> None:
    digests = SentDigests()
    bodies = [*conversation(25, seed=7), *conversation(25, seed=8)]
    wrong: list[int] = []

    def work(offset: int) -> None:
        for k in range(len(bodies)):
            body = bodies[(k + offset) % len(bodies)]
            if digests(body) != sent_digest(body):
                wrong.append(k)

    threads = [threading.Thread(target=work, args=(n * 7,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
