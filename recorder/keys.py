"""Signing keys: where they come from and how a cassette names the one it was signed with.

The key is taken from ``DEJA_KEY`` when set; otherwise from the key file
(``$DEJA_HOME/key``, default ``~/.deja/key``), created with mode 0600 on first use.
Older keys stay usable for verification after a rotation: list them in
``DEJA_OLD_KEYS`` (comma separated) or keep them as ``$DEJA_HOME/key.*`` files.
A cassette header records the ``key_id`` (a hash of the key, never the key).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError, KeyMissing


def key_id(key: bytes) -> str:
    return "k_" + hashlib.sha256(b"deja-key-id:" + key).hexdigest()[:12]


def deja_home() -> Path:
    return Path(os.environ.get("DEJA_HOME") or Path.home() / ".deja")


@dataclass(frozen=True)
class Keyring:
    """The signing key plus any older keys accepted for verification."""

    signing: bytes | None
    accepted: dict[str, bytes] = field(default_factory=dict)

    @property
    def signing_id(self) -> str | None:
        return key_id(self.signing) if self.signing is not None else None

    def get(self, kid: str) -> bytes | None:
        return self.accepted.get(kid)

    @classmethod
    def of(cls, *keys: bytes | str) -> Keyring:
        raw = [k.encode() if isinstance(k, str) else k for k in keys]
        return cls(raw[0] if raw else None, {key_id(k): k for k in raw})


def _file_key(path: Path) -> bytes:
    data = path.read_bytes().strip()
    if not data:
        raise ConfigError(f"key file {path} is empty; delete it to have a new key made")
    return data


def load_keyring(*, create: bool = True) -> Keyring:
    """The keyring of this environment; makes a key file on first use when ``create``."""
    keys: list[bytes] = []
    env = os.environ.get("DEJA_KEY")
    if env:
        keys.append(env.encode())
    home = deja_home()
    path = home / "key"
    if path.exists():
        keys.append(_file_key(path))
    elif not env and create:
        home.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
        keys.append(_file_key(path))
    for old in os.environ.get("DEJA_OLD_KEYS", "").split(","):
        if old.strip():
            keys.append(old.strip().encode())
    if home.is_dir():
        keys.extend(_file_key(p) for p in sorted(home.glob("key.*")) if p.is_file())
    if not keys:
        return Keyring(None, {})
    return Keyring(keys[0], {key_id(k): k for k in reversed(keys)})


def require_signing_key(ring: Keyring) -> bytes:
    if ring.signing is None:
        raise KeyMissing("no signing key: set DEJA_KEY or let deja create "
                         f"{deja_home() / 'key'}")
    return ring.signing
