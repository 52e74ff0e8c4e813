"""Progress and cancel: what a run is doing, and a flag anyone can set to stop it.

Each run keeps a status record, ``$DEJA_HOME/runs/<run>.json``, in the shape operators
expect::

    {"run_id": "r_01a2…", "status": "running", "turn": 19, "turn_limit": 60,
     "step": "tool pay(invoice='INV-7')", "elapsed_s": 128.4, "budget_s": 3600,
     "tokens": 91420, "token_limit": 400000, "spend_usd": 1.12, "dollar_limit": 20.0,
     "artefacts": ["cassettes/r_01a2….jsonl"], "cancel": "deja cancel r_01a2…", ...}

It is updated at every step in memory and written at most every ``interval`` seconds,
the latest state always reaching the file within ``interval``, and at once when the status
changes or the run ends, so that a status line costs the agent's calls nothing measurable:
the periodic writes are made by the process's background thread, off the agent's calls
(only a change of status or the end is written on the call, before it returns).
``deja status RUN`` prints it.

A record is written over in place, in one write of at most a page, never as a new file
renamed onto it: making a file costs a file system far more than writing one (on the
machines of ``docs/benchmarks.md``, 80-400 µs of CPU against 10), and the recording proxy
writes the records of a run per conversation. A shorter record is padded with spaces to
the length of the one it replaces, so that a process killed while writing leaves the old
record or the new one whole, never the new one's head on the old one's tail; the rare
record longer than a page is a new file renamed over the old. Writers hold the file's
``flock``, readers wait briefly for it, and a record's last field, ``check``, is the
CRC-32 of what precedes it: a reader who still catches one cut (written by a process that
did not wait for the lock) reads it again (:func:`read_status`).

Cancelling is a flag file, ``$DEJA_HOME/runs/<run>.cancel``: ``deja cancel RUN`` (or the
viewer's button) creates it; the recorder reads it before each call and after writes
(there at most every 20 ms: a run of fast calls pays one system call per call), and the
run stops at the next boundary with status ``cancelled``, never mid-action.

Both are private to their owner: ``runs/`` is created 0700 and every file in it 0600. A
record is redacted like a cassette line before it is written (its ``step`` names the tool
call in flight, with its arguments). Writing it is best effort: when ``$DEJA_HOME`` is
full, read-only or gone, the run goes on (with one warning); the cassette is what counts.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import stat
import threading
import time
import zlib
from pathlib import Path
from typing import Any, cast

from recorder.background import CHORES
from recorder.capture.redact import DEFAULT, Redaction
from recorder.cassette.keys import deja_home
from recorder.cassette.reader import peek_end, peek_header
from recorder.cassette.schema import utc_stamp
from recorder.errors import ConfigError

log = logging.getLogger("deja.recorder")


def runs_dir() -> Path:
    return deja_home() / "runs"


# A run id names files under runs/: nothing that could leave the folder or break a path.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def valid_run_id(run: Any) -> bool:
    return isinstance(run, str) and _RUN_ID.fullmatch(run) is not None


def _run_file(run: str, suffix: str) -> Path:
    if not valid_run_id(run):
        raise ConfigError(f"{run!r} is not a run id (letters, digits, '_', '.' and '-', "
                          "e.g. r_01a2...)")
    return runs_dir() / f"{run}{suffix}"


def status_path(run: str) -> Path:
    return _run_file(run, ".json")


def cancel_path(run: str) -> Path:
    return _run_file(run, ".cancel")


def answer_path(run: str) -> Path:
    """Where ``deja answer`` leaves the answer of a run waiting in ``recorder.ask``."""
    return _run_file(run, ".answer")


def _now_iso() -> str:
    return utc_stamp("seconds")


_TIGHTENED: set[Path] = set()


def _private_dir(path: Path) -> None:
    """Create ``path`` (and its parents) with mode 0700; one that an older deja made more
    open is closed to others (once per process)."""
    if path in _TIGHTENED:
        return
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)
    _TIGHTENED.add(path)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, as a file only its owner can read (0600)."""
    _private_dir(path.parent)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:  # the folder was removed since: make it again
            _TIGHTENED.discard(path.parent)
            _private_dir(path.parent)
            fd = os.open(tmp, flags, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_SEAL = re.compile(r'(, |\{)"check": "([0-9a-f]{8})"\}\s*\Z')
_TORN = object()  # a record read while it was being written over
_READS = 4  # reads of a record found torn before it counts as none (2 + 4 + 6 ms apart)
_PAGE = 4096  # a record this long or shorter is written over in place
_LOCK_WAIT = 1.0  # seconds a write waits for another's lock on a record
_READ_WAIT = 0.05  # seconds a read waits for a write under way
_STUCK: set[Path] = set()  # records whose lock was held past _LOCK_WAIT: not waited for
_pause = time.sleep
_WRITING = threading.Lock()  # held from a record's open to its close, and around a fork
os.register_at_fork(before=_WRITING.acquire, after_in_parent=_WRITING.release,
                    after_in_child=_WRITING.release)


def _sealed(text: str) -> bytes:
    """A record's JSON text (an object) with its ``check`` field last: the CRC-32 of the
    text before it, closed."""
    head = text.rstrip()[:-1].rstrip()
    check = _crc(head + "}")
    return f'{head}{"" if head == "{" else ", "}"check": "{check:08x}"}}'.encode()


def _crc(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def _unsealed(text: str) -> Any:
    """The record a status file holds (None: not a JSON object); :data:`_TORN` when its
    ``check`` does not match, or it is no JSON at all (being written, or left cut)."""
    m = _SEAL.search(text)
    if m is not None:
        text = text[:m.start()] + ("{}" if m[1] == "{" else "}")
        if _crc(text) != int(m[2], 16):
            return _TORN
    try:
        record = json.loads(text)
    except ValueError:
        return _TORN
    return record if isinstance(record, dict) else None


def _write_over(path: Path, data: bytes) -> None:
    """Write ``data`` over the record file at ``path`` (made 0600 if there is none) under
    its ``flock`` (:func:`_open_locked`), so that two writers never interleave.

    A record of at most a page (:data:`_PAGE`, the common case by far) is written in place,
    padded with spaces to the file's length, in one ``pwrite`` at offset 0: the kernel
    copies one page whole or not at all, so that a writer killed, or stopped by a full
    disk, leaves the old record or the new one, never the new one's head on the old one's
    tail. A longer one (or one replacing a longer one) is written as a new file renamed
    over the old, which no cut can leave half-written either.
    """
    _private_dir(path.parent)
    with _WRITING:  # no fork in this process meanwhile: a child never holds the lock
        fd, size = _open_locked(path)
        try:
            if len(data) > _PAGE or size > _PAGE:
                _write_private(path, data.decode())
                return
            if len(data) < size:
                data += b" " * (size - len(data))
            if os.pwrite(fd, data, 0) != len(data):  # a regular file's page: whole or error
                raise OSError(errno.EIO, "short write")
        finally:
            os.close(fd)


def _open_locked(path: Path) -> tuple[int, int]:
    """A descriptor of the record file at ``path``, holding its exclusive ``flock``, and
    the file's size once locked.

    A writer that holds the lock for long (stopped, or a forked child that kept an
    inherited descriptor) never stops the run: after :data:`_LOCK_WAIT` seconds the write
    goes on without it (warned once; a reader that catches the record cut reads it again,
    see :func:`read_status`) and later writes of that record do not wait for it again.
    A file renamed over the one locked meanwhile (a long record) is opened again.
    """
    for attempt in range(3):
        fd = _open_record(path, os.O_WRONLY | os.O_CREAT)
        try:
            held = _locked(fd, fcntl.LOCK_EX, 0.0 if path in _STUCK else _LOCK_WAIT)
            if not held and path not in _STUCK:
                _STUCK.add(path)
                log.warning("deja: status record %s is locked by another process for "
                            "over %.0f s; it is written without the lock", path, _LOCK_WAIT)
            elif held:
                _STUCK.discard(path)
            found = os.fstat(fd)
            if not held or attempt == 2 or \
                    os.stat(path, follow_symlinks=False).st_ino == found.st_ino:
                return fd, found.st_size  # (replaced three times while we waited: it will do)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # replaced while we waited: lock the new one
    raise AssertionError("unreachable")


def _open_record(path: Path, flags: int) -> int:
    """``os.open`` of a record file that is a regular file of its owner's: never a link
    followed nor a FIFO waited on; one made more open by someone else is closed again."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
        _TIGHTENED.discard(path.parent)  # the folder was removed since: make it again
        _private_dir(path.parent)
        fd = os.open(path, flags, 0o600)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        if flags & os.O_CREAT and mode & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _locked(fd: int, how: int, wait: float) -> bool:
    """Whether ``fd``'s ``flock`` ``how`` is taken within ``wait`` seconds (polled: a
    write holds it for microseconds)."""
    deadline, pause = 0.0, 0.0005
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        now = time.monotonic()
        deadline = deadline or now + wait
        if now >= deadline:
            return False
        _pause(min(pause, deadline - now))
        pause = min(pause * 2, 0.02)


def _read_record(path: Path) -> str:
    """The text of the record file at ``path``, read under its shared ``flock`` when a
    writer lets go of it within :data:`_READ_WAIT` seconds (else read as it is)."""
    fd = _open_record(path, os.O_RDONLY)
    try:
        _locked(fd, fcntl.LOCK_SH, _READ_WAIT)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def request_cancel(run: str, reason: str = "") -> Path:
    """Ask run ``run`` to stop at its next boundary (any process may call this).

    A flag that cannot be written (``$DEJA_HOME`` read-only, full, gone) is a
    :class:`ConfigError` saying so.
    """
    path = cancel_path(run)
    text = json.dumps({"requested": _now_iso(), "reason": DEFAULT.text(reason),
                       "by": f"{socket.gethostname()}:{os.getpid()}"})
    try:
        _write_private(path, text)
    except OSError as exc:
        raise ConfigError(f"cannot ask run {run} to stop: its cancel flag {path} cannot be "
                          f"written ({exc.strerror or exc}). Check that $DEJA_HOME ("
                          f"{deja_home()}) is writable and has space") from None
    return path


def close_record(run: str, status: str, error: str) -> None:
    """Say in ``run``'s status record that it ended ``status`` although its cassette has
    no end line (a worker gave up on an agent that kept dying: the cassette stays open, to
    be resumed by hand). Best effort, like every write of a record."""
    record = read_status(run) or {"run_id": run}
    record.update(status=status, ended=True, error=DEFAULT.text(error),
                  step=f"ended: {status}", updated=_now_iso())
    try:
        _write_over(status_path(run), _sealed(json.dumps(record, default=str)))
    except OSError as exc:
        log.warning("run %s: cannot write its status record (%s)", run, exc.strerror or exc)


def leave_answer(run: str, text: str) -> Path:
    """Leave ``text`` for a run waiting in ``recorder.ask`` outside a worker."""
    path = answer_path(run)
    try:
        _write_private(path, text)
    except OSError as exc:
        raise ConfigError(f"cannot answer run {run}: {path} cannot be written "
                          f"({exc.strerror or exc})") from None
    return path


def cancel_requested(run: str, path: Path | None = None) -> dict[str, Any] | None:
    """The cancel request of ``run`` (its flag file, ``path`` when already known), or None."""
    path = path or cancel_path(run)
    if not os.path.exists(path):  # the common case, checked before every call: keep it cheap
        return None
    try:
        return json.loads(path.read_text() or "{}")
    except FileNotFoundError:
        return None
    except ValueError:
        return {"reason": "cancel flag set"}


def cassette_end(path: str | Path) -> tuple[str, dict[str, Any] | None]:
    """How a cassette stands, from its header and its last line alone (the whole file is
    never read: a status costs the same for a run of ten lines or of a million):
    ``("none", None)`` with no header on disk, ``("open", None)`` for a recorded prefix
    without an end line, ``("ended", end_line)`` once it has one.

    Not a verification: what it returns is shown (a status), never acted upon as trusted.
    """
    if peek_header(path) is None:
        return "none", None  # no header line written whole yet
    end = peek_end(path)
    return ("ended", dict(end)) if end is not None else ("open", None)


def read_status(run: str) -> dict[str, Any] | None:
    """The status record of ``run``; None when there is none (or it cannot be read: a
    run id no record can have, a record that is not JSON)."""
    if not valid_run_id(run):
        return None
    path = status_path(run)
    for attempt in range(_READS):
        try:
            record = _unsealed(_read_record(path))
        except OSError:  # no record, no runs folder, not a regular file
            return None
        if record is not _TORN:
            return cast(dict[str, Any] | None, record)
        if attempt + 1 < _READS:  # caught while being written: read it again
            _pause(0.002 * (attempt + 1))
    return None  # not JSON, or left cut by a write that failed (a full disk)


class Progress:
    """The status record of one run, redacted with the run's rules.

    :meth:`update` changes the record in memory. A change of status, or ``force``, writes
    it before returning; anything else is left to the process's background thread
    (:mod:`recorder.background`), which writes the latest record once ``interval`` has
    passed since the last write (at once when it already has). Writes are made one at a
    time, each of the record as it is when the write starts, so the file never goes back
    to an older state.
    """

    def __init__(self, run: str, record: dict[str, Any], *, interval: float = 0.2,
                 redaction: Redaction | None = None) -> None:
        self.run = run
        self.path = status_path(run)
        self.interval = interval
        self.redaction = redaction or DEFAULT
        self._lock = threading.Lock()  # the record
        self._io = threading.Lock()  # one write at a time, in the order of their snapshots
        self._written = 0.0
        self._ended = False
        self._failed: str | None = None  # why the last write failed (warned once)
        self.record: dict[str, Any] = {"run_id": run, "status": "running", "turn": 0,
                                       "step": "starting", "pid": os.getpid(),
                                       "host": socket.gethostname(), "started": _now_iso(),
                                       "cancel": f"deja cancel {run}", **record}
        self._write()

    def update(self, *, force: bool = False, **fields: Any) -> None:
        with self._lock:
            changed_status = "status" in fields and fields["status"] != self.record["status"]
            self.record.update(fields)
            ending = bool(fields.get("ended"))
            self._ended = self._ended or ending
            if not (force or changed_status or ending):
                if not self._ended:  # nothing is written after the end but the end itself
                    CHORES.soon(self, self._write, self._written + self.interval)
                return
        if ending:
            CHORES.forget(self)
        self._write()

    @property
    def pending(self) -> bool:
        """Whether a write is left to the background thread."""
        return CHORES.waiting(self)

    def _write(self) -> None:
        """Write the record as it is now (the caller holds no lock)."""
        with self._io:
            with self._lock:
                self.record["updated"] = _now_iso()
                self._written = time.monotonic()
                text = json.dumps(self.record, default=str)
            self._write_text(self.redaction.json_text(text))

    def _write_text(self, text: str) -> None:
        try:
            _write_over(self.path, _sealed(text))
        except OSError as exc:
            if self._failed is None:
                log.warning("run %s: cannot write its status record %s (%s); the run goes "
                            "on and its cassette is written as usual, but `deja status` "
                            "will not show it", self.run, self.path, exc.strerror or exc)
            self._failed = str(exc)
            return
        if self._failed is not None:
            log.info("run %s: status record %s written again", self.run, self.path)
            self._failed = None
