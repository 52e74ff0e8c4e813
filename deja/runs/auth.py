"""The token of ``deja serve``: one per install, made on first use, read by deja's own
clients so that nobody types it.

The token lives in ``$DEJA_HOME/serve.token`` (``~/.deja/serve.token``): 43 random
URL-safe characters, a file of mode 0600 in a directory made 0700, so that only its
owner (and root) can read it. ``deja serve`` requires it on every request, on loopback
too, as ``Authorization: Bearer TOKEN``; ``deja submit``, ``runs``, ``answer``,
``status`` and ``cancel`` read it from the same file. ``DEJA_TOKEN`` (or ``deja serve
--token``) names another token instead, for a server on another machine.

Two processes that start at once on a fresh ``$DEJA_HOME`` agree on one token: each
writes a candidate to a private temporary file and links it into place, which succeeds
for one of them only; the other reads the winner's. A reader never sees a half-written
token. A token file that others can read, or that another user owns, is refused with
the fix: it may have leaked.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from pathlib import Path

from recorder.cassette.keys import deja_home
from recorder.errors import ConfigError

__all__ = ["TOKEN_FILE", "client_token", "ensure_token", "read_token", "server_token",
           "token_path", "valid_token"]

TOKEN_FILE = "serve.token"
_SETTLE = 2.0  # seconds a reader waits for a token being written without a link


def token_path() -> Path:
    return deja_home() / TOKEN_FILE


def valid_token(token: str) -> bool:
    """A token is 16 to 512 visible ASCII characters (it travels in an HTTP header)."""
    return 16 <= len(token) <= 512 and all(33 <= ord(c) <= 126 for c in token)


def read_token(path: Path | None = None) -> str | None:
    """The token in ``path`` (default ``$DEJA_HOME/serve.token``), or None when there is
    no such file. ``ConfigError`` when others could read it or it holds no token."""
    path = path or token_path()
    deadline = time.monotonic() + _SETTLE
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ConfigError(f"the token of deja serve, {path}, cannot be read "
                              f"({exc.strerror or exc}); it belongs to the user who runs "
                              "deja serve, or set DEJA_TOKEN") from None
        try:
            info = os.fstat(fd)
            text = os.read(fd, 4096).decode("ascii", errors="replace").strip()
        finally:
            os.close(fd)
        _check_private(path, info)
        if text or time.monotonic() >= deadline:
            break
        time.sleep(0.02)  # made by a process that could not link: being written
    if not valid_token(text):
        raise ConfigError(f"{path} does not hold a token (16 to 512 visible ASCII "
                          "characters); delete it and deja serve makes a new one")
    return text


def _check_private(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path} is not a regular file; delete it and deja serve makes a "
                          "new token")
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise ConfigError(f"{path} belongs to another user (uid {info.st_uid}); a token "
                          "must be its owner's alone: delete it and deja serve makes a new "
                          "one, or set DEJA_TOKEN")
    if info.st_mode & 0o077:
        raise ConfigError(f"{path} can be read by others (mode {stat.S_IMODE(info.st_mode):o}"
                          "), so the token may have leaked: delete it and deja serve makes "
                          "a new one (or chmod 600 it if nobody else could have read it)")


def ensure_token(path: Path | None = None) -> str:
    """The token in ``path``, made there first when there is none."""
    path = path or token_path()
    found = read_token(path)
    if found is not None:
        return found
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _create(path, secrets.token_urlsafe(32))
    except OSError as exc:
        raise ConfigError(f"deja serve has no token and cannot make one at {path} "
                          f"({exc.strerror or exc}); point DEJA_HOME at a writable "
                          "directory, or give one with --token/DEJA_TOKEN") from None
    made = read_token(path)
    if made is None:  # removed between the link and the read: start again
        return ensure_token(path)
    return made


def _create(path: Path, token: str) -> None:
    """Put ``token`` at ``path`` unless a token is already there (whoever wins, one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    _write_new(tmp, token)
    try:
        os.link(tmp, path)  # atomic, and refused when the name exists
    except FileExistsError:
        pass  # another process made it first: its token is the one
    except OSError:  # no hard links here (some network or FUSE file systems)
        with contextlib.suppress(FileExistsError):
            _write_new(path, token)
    finally:
        tmp.unlink(missing_ok=True)


def _write_new(path: Path, token: str) -> None:
    """Write ``token`` to a file that must not exist yet (0600, no symlink followed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.write(fd, f"{token}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def server_token(given: str | None) -> str:
    """The token ``deja serve`` requires: ``given`` (``--token``, ``DEJA_TOKEN``), else
    this install's, made on first use."""
    if given is None or not given.strip():
        return ensure_token()
    if not valid_token(given.strip()):
        raise ConfigError("the token given with --token or DEJA_TOKEN must be 16 to 512 "
                          "visible ASCII characters; make one with: python -c 'import "
                          "secrets; print(secrets.token_urlsafe(32))'")
    return given.strip()


def client_token(*, local: bool) -> str | None:
    """What a deja command sends to ``deja serve``: ``DEJA_TOKEN``, else, to a server on
    this machine (``local``), this install's token when there is one. It is never made
    here (a server makes it when it starts) nor sent to another machine."""
    given = os.environ.get("DEJA_TOKEN", "").strip()
    if given:
        return given
    return read_token() if local else None
