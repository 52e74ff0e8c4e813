"""The signature chain: each line signed over the previous line's signature and itself.

``sig`` = base64url(HMAC-SHA256(key, previous sig + canonical JSON of the line without
``sig``)), unpadded; the header's previous sig is empty.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any

from recorder.canonical import canonical


def mac(key: bytes, prev_sig: str, body: bytes) -> bytes:
    """HMAC-SHA256 of ``body`` (a line's canonical bytes) chained to ``prev_sig``."""
    return hmac.digest(key, prev_sig.encode("ascii") + body, hashlib.sha256)


def encode_sig(mac: bytes) -> str:
    """base64url without padding: 43 characters."""
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")


def sign(key: bytes, prev_sig: str, line: dict[str, Any]) -> str:
    return encode_sig(mac(key, prev_sig, canonical(line)))


def check_sig(key: bytes, prev_sig: str, line: dict[str, Any], sig: object) -> bool:
    """Does ``sig`` sign ``line``?"""
    return isinstance(sig, str) and hmac.compare_digest(sig, sign(key, prev_sig, line))
