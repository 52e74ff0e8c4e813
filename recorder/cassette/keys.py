"""Signing keys: where they come from and how a cassette names the one it was signed with.

The key is taken from ``DEJA_KEY`` when set; otherwise from the key file
(``$DEJA_HOME/key``, default ``~/.deja/key``), created with mode 0600 on first use.
Older keys stay usable for verification after a rotation: list them in
``DEJA_OLD_KEYS`` (comma separated) or keep them as ``$DEJA_HOME/key.*`` files.
A cassette header records the ``key_id`` (a hash of the key, never the key).

No object that holds a key shows it: a key is a :class:`SecretKey`, whose ``repr`` and
``str`` are ``<key k_...>``, so a key in a traceback's locals, a log line or a test
failure shows its id only; a :class:`Keyring` shows the ids of its keys.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from recorder.errors import ConfigError, KeyMissing


def key_id(key: bytes) -> str:
    return "k_" + hashlib.sha256(b"deja-key-id:" + key).hexdigest()[:12]


def deja_home() -> Path:
    return Path(os.environ.get("DEJA_HOME") or Path.home() / ".deja")


class SecretKey(bytes):
    """The bytes of a signing key, which never show themselves: ``repr``, ``str`` and
    formatting give ``<key k_...>`` (its id). It is ``bytes`` everywhere else (hmac,
    comparisons, hashing)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<key {key_id(self)}>"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)


def _secret(key: bytes | str) -> SecretKey:
    return key if isinstance(key, SecretKey) else SecretKey(
        key.encode() if isinstance(key, str) else key)


@dataclass(frozen=True, repr=False)
class Keyring:
    """The signing key plus any older keys accepted for verification (as SecretKeys)."""

    signing: bytes | None
    accepted: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.signing is not None:
            object.__setattr__(self, "signing", _secret(self.signing))
        object.__setattr__(self, "accepted",
                           {kid: _secret(k) for kid, k in self.accepted.items()})

    def __repr__(self) -> str:
        return f"Keyring(signing={self.signing_id}, accepted={sorted(self.accepted)})"

    @property
    def signing_id(self) -> str | None:
        return key_id(self.signing) if self.signing is not None else None

    def get(self, kid: str) -> bytes | None:
        return self.accepted.get(kid)

    @classmethod
    def of(cls, *keys: bytes | str) -> Keyring:
        raw = [_secret(k) for k in keys]
        return cls(raw[0] if raw else None, {key_id(k): k for k in raw})


def _file_key(path: Path) -> SecretKey:
    key = SecretKey(path.read_bytes().strip())
    if not key:
        raise ConfigError(f"key file {path} is empty; delete it to have a new key made")
    return key


def load_keyring(*, create: bool = True) -> Keyring:
    """The keyring of this environment; makes a key file on first use when ``create``."""
    # Keys are SecretKeys from the moment they are read, and no local holds one as plain
    # text: a traceback through here shows key ids only.
    keys: list[SecretKey] = []
    env = bool(os.environ.get("DEJA_KEY"))
    if env:
        keys.append(_secret(os.environ["DEJA_KEY"]))
    home = deja_home()
    path = home / "key"
    if path.exists():
        keys.append(_file_key(path))
    elif not env and create:
        try:
            home.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_hex(32).encode())
        except OSError as exc:
            raise KeyMissing(f"no signing key, and none can be made at {path} "
                             f"({exc.strerror or exc}): set DEJA_KEY, or point DEJA_HOME at "
                             "a writable directory") from None
        keys.append(_file_key(path))
    keys.extend(_secret(old.strip()) for old in os.environ.get("DEJA_OLD_KEYS", "").split(",")
                if old.strip())
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
