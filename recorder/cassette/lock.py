"""One writer per cassette: a lock that dies with its holder.

Two processes appending to one cassette interleave their lines and break its chain; two
resumes of one crashed run each replay it and go live, and the side effects after the
crash happen twice. So every writer of a cassette holds its lock: ``flock`` on a lock file
beside it (``.<name>.lock``), which the kernel releases when the last process holding it
exits, however it exits (a crash or ``kill -9`` leaves no stale lock behind). The lock
file holds who has it (pid, run, command, since when), so a second writer is refused with
:class:`CassetteLocked` naming the holder.

``deja record``, ``fork`` and ``resume`` take the lock in the launching process, before
anything is read or written, and hand it to the program they start (an inherited file
descriptor, named in the launch spec): the lock is held while either of them lives, so a resume
started beside an orphaned program is refused too. In one process the lock is re-entrant:
the recording session and the launcher's end-line writer share it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recorder.cassette.schema import utc_stamp
from recorder.errors import CassetteLocked, CassetteWriteError

_held: dict[str, WriterLock] = {}
_guard = threading.Lock()


def lock_path(cassette: str | Path) -> Path:
    cassette = Path(cassette)
    return cassette.with_name(f".{cassette.name}.lock")


def _key(cassette: str | Path) -> str:
    return str(Path(cassette).resolve())


@dataclass
class WriterLock:
    """This process's hold on one cassette's writer lock."""

    cassette: Path
    fd: int
    owned: bool  # taken here (released by unlinking and closing); else inherited
    users: int = 1
    holder: dict[str, Any] = field(default_factory=dict)

    def note(self, **fields: Any) -> None:
        """Add to what the lock file says about its holder (e.g. the program's pid)."""
        self.holder.update(fields)
        _write_holder(self.fd, self.holder)

    def release(self) -> None:
        with _guard:
            self.users -= 1
            if self.users > 0:
                return
            _held.pop(_key(self.cassette), None)
            if self.owned:  # unlink while still holding it, so nobody locks a dead file
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock_path(self.cassette))
            os.close(self.fd)


def _write_holder(fd: int, holder: dict[str, Any]) -> None:
    data = json.dumps(holder).encode()
    with contextlib.suppress(OSError):  # only a description: never worth failing a run
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process"
    parts = [f"pid {holder.get('pid')}"]
    if holder.get("child"):
        parts.append(f"program pid {holder['child']}")
    if holder.get("run"):
        parts.append(f"run {holder['run']}")
    if holder.get("what"):
        parts.append(str(holder["what"]))
    if holder.get("since"):
        parts.append(f"since {holder['since']}")
    return ", ".join(parts)


def acquire(cassette: str | Path, *, run: str | None, what: str) -> WriterLock:
    """Take the writer lock of ``cassette`` (or share this process's hold on it)."""
    cassette = Path(cassette)
    key = _key(cassette)
    with _guard:
        held = _held.get(key)
        if held is not None:
            held.users += 1
            return held
        path = lock_path(cassette)
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
            except OSError as exc:
                raise CassetteWriteError(
                    f"cannot take the writer lock of {cassette} ({path}): "
                    f"{exc.strerror or exc}", path=cassette) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise CassetteLocked(
                    f"{cassette} is being written by {describe(holder)}; a cassette has one "
                    "writer at a time. Wait for that run to end, or stop it (deja cancel "
                    f"{holder.get('run') or 'RUN'}), then try again", path=cassette,
                    holder=holder) from None
            try:  # the previous holder may have unlinked the file between open and flock
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "run": run, "what": what,
                  "since": utc_stamp("seconds")}
        _write_holder(fd, holder)
        lock = WriterLock(cassette, fd, owned=True, holder=holder)
        _held[key] = lock
        return lock


def adopt(cassette: str | Path, fd: int) -> WriterLock:
    """Take over a hold inherited from the launching process (its launch spec's
    ``lock_fd``)."""
    try:  # the same open file: flock succeeds at once when the inherited fd holds it
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raise CassetteLocked(f"the writer lock handed over for {cassette} is not held "
                             f"({exc.strerror or exc})", path=cassette) from None
    os.set_inheritable(fd, False)
    lock = WriterLock(Path(cassette), fd, owned=False, holder=_read_holder(fd))
    with _guard:
        _held[_key(cassette)] = lock
    return lock


def holder_of(cassette: str | Path) -> dict[str, Any] | None:
    """Who holds the writer lock of ``cassette``, or None when nobody does."""
    path = lock_path(cassette)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        return None
    finally:
        os.close(fd)
