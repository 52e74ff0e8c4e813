"""Canonical JSON: the one byte form that signatures and fingerprints are computed over."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

# One encoder for every call: ``json.dumps`` with these options would build a new one each
# time, which is a large share of the cost for the small objects hashed per message.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                            allow_nan=False)


def canonical(obj: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8 (non-ASCII kept as is)."""
    return _ENCODER.encode(obj).encode("utf-8")


def digest(obj: Any) -> str:
    """A short stable hash of ``obj``'s canonical form."""
    return hashlib.sha256(canonical(obj)).hexdigest()[:32]


def encode_body(data: bytes) -> tuple[str, str | None]:
    """Store bytes exactly: as text when they are UTF-8, else as base64."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"


def decode_body(text: str, encoding: str | None) -> bytes:
    if encoding == "base64":
        return base64.b64decode(text)
    return text.encode("utf-8")
