"""The signature chain: each line signed over the previous line's signature and itself.

``sig`` = base64url(HMAC-SHA256(key, previous sig + the line's signed bytes)), unpadded;
the header's previous sig is empty. What a line's signed bytes are depends on the format:

- ``deja/2``: the exact bytes written, without the ``sig`` field. The writer serialises a
  line as compact JSON, signs those bytes, and appends the signature as the last field
  (``…,"sig":"<43 characters>"}``), so a reader takes the signed bytes back off the line
  as it is on disk (:func:`split_signed`) and checks them without re-encoding anything;
- ``deja/1``: the canonical JSON (sorted keys) of the line without ``sig``, which the
  reader recomputes from the parsed line.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

from recorder.canonical import canonical

SIG_CHARS = 43  # base64url of 32 bytes, unpadded
_SIG_FIELD = b',"sig":"'
_TAIL = len(_SIG_FIELD) + SIG_CHARS + 2  # the field, the signature, '"}'


def mac(key: bytes, prev_sig: str, body: bytes) -> bytes:
    """HMAC-SHA256 of ``body`` (a line's signed bytes) chained to ``prev_sig``."""
    return hmac.digest(key, prev_sig.encode("ascii") + body, hashlib.sha256)


def encode_sig(mac: bytes) -> str:
    """base64url without padding: 43 characters."""
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")


def line_bytes(line: Mapping[str, Any]) -> bytes:
    """A line as deja writes it (compact JSON, field order kept, UTF-8): in ``deja/2`` the
    bytes its signature covers. Raises ``ValueError``/``TypeError``/``UnicodeEncodeError``
    for a value JSON cannot hold exactly."""
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def with_sig(body: bytes, sig: str) -> bytes:
    """The line as written: ``body`` (a JSON object) with ``sig`` as its last field."""
    return body[:-1] + _SIG_FIELD + sig.encode("ascii") + b'"}'


def split_signed(raw: bytes) -> tuple[bytes, str] | None:
    """A ``deja/2`` line's signed bytes and its signature, taken off the line as written;
    None when the line does not end in a signature field the writer wrote."""
    if (len(raw) <= _TAIL or raw[-_TAIL:-SIG_CHARS - 2] != _SIG_FIELD
            or raw[-2:] != b'"}' or raw[-_TAIL - 1:-_TAIL] == b"{"):
        return None
    try:
        sig = raw[-SIG_CHARS - 2:-2].decode("ascii")
    except UnicodeDecodeError:
        return None
    return raw[:-_TAIL] + b"}", sig


def check_bytes(key: bytes, prev_sig: str, body: bytes, sig: object) -> bool:
    """Does ``sig`` sign ``body``, a ``deja/2`` line's signed bytes?"""
    return isinstance(sig, str) and hmac.compare_digest(sig, encode_sig(mac(key, prev_sig, body)))


def sign(key: bytes, prev_sig: str, line: Mapping[str, Any]) -> str:
    """The ``deja/1`` signature of ``line`` (over its canonical form)."""
    return encode_sig(mac(key, prev_sig, canonical(line)))


def check_sig(key: bytes, prev_sig: str, line: Mapping[str, Any], sig: object) -> bool:
    """Does ``sig`` sign ``line`` (``deja/1``)?"""
    return isinstance(sig, str) and hmac.compare_digest(sig, sign(key, prev_sig, line))
