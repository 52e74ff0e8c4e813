"""Writing a cassette: append-only, one signed line at a time (the chain is in
:mod:`recorder.cassette.signing`, the lines in :mod:`recorder.cassette.schema`).

The writer makes one ``write`` per line, before the observation reaches the agent: a
process killed at any point loses nothing it wrote, and one killed in the middle of a
write leaves a torn last line, which the reader reports and never accepts silently.
The fsync policy decides when lines are also forced to the disk itself (what a machine
crash or power loss would otherwise take):

- ``sync``: every line, before the call returns;
- ``turn`` (the default): side effects (intent, outcome), control and end lines before
  the call returns; the header, model and HTTP lines within about 10 ms, by the process's background
  thread (:mod:`recorder.background`), which forces whatever has been written since its
  last pass (a group commit, as databases do), so that the disk's latency stays off the
  agent's calls;
- ``exit``: once, when the run ends.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recorder._fastjson import LINE_DEPTH, nests_deeper, openers, text_nests_deeper
from recorder.background import CHORES
from recorder.canonical import canonical
from recorder.cassette import _delta, _validate
from recorder.cassette import lock as writer_lock
from recorder.cassette.format import (
    FEATURES,
    FORMAT,
    KINDS,
    RESUMABLE_ENDS,
    TURN_SYNC_KINDS,
    V1,
    Fsync,
)
from recorder.cassette.keys import key_id
from recorder.cassette.schema import Kind
from recorder.cassette.signing import encode_sig, line_bytes, mac, with_sig
from recorder.cassette.whole import WHOLE
from recorder.errors import (
    CassetteLocked,
    CassetteWriteError,
    ConfigError,
    CorruptCassette,
    KeyMissing,
    NotResumable,
    PathTaken,
    SessionError,
    UnserializableValue,
)

if TYPE_CHECKING:
    from recorder.cassette.reader import Cassette


def _unlike(line: dict[str, Any]) -> None:
    """A compacted model line's ``like`` (deja/2) as the three references it stands for."""
    ref = line.pop("like", None)
    if ref is not None:
        line["url"] = line["request_headers"] = ref
        if isinstance(line.get("response"), dict):
            line["response"] = {**line["response"], "headers_base": ref}


class _GroupSync:
    """Forces a file to disk off the caller's thread, whenever lines were written (a
    chore of :data:`recorder.background.CHORES`).

    Passes start at least ``INTERVAL`` seconds apart, so a burst of fast calls shares one
    fsync instead of queueing behind one each. A failed fsync (an I/O error, a disk that
    filled up under delayed allocation) is kept in ``error``: the writer refuses the next
    line with it.
    """

    INTERVAL = 0.01

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._next = 0.0  # when the next pass may start
        self.error: OSError | None = None

    def request(self) -> None:
        if self.error is None:
            CHORES.soon(self, self._sync, self._next)

    def _sync(self) -> None:
        self._next = time.monotonic() + self.INTERVAL
        try:
            os.fsync(self._fd)
        except OSError as exc:
            self.error = exc

    def stop(self) -> None:
        """No pass after this returns (the file may then be closed)."""
        CHORES.forget(self)


_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class CassetteWriter:
    """Appends signed lines to a cassette file. Thread-safe; one writer per file.

    The writer holds the cassette's writer lock (:mod:`recorder.cassette.lock`) from the moment it
    is created until it closes or abandons the file. A write that fails (disk full,
    read-only file system, I/O error) cuts the file back to its last whole line and raises
    :class:`CassetteWriteError`; the writer then refuses every further line, so nothing
    after the failure is written out of order and the committed prefix still verifies.
    """

    _cut, _kept = b"", -1  # a reopened writer's: what it cut, and the size it kept

    def __init__(self, path: str | Path, header: Mapping[str, Any], key: bytes,
                 fsync: Fsync | str = Fsync.TURN, *, overwrite: bool = False) -> None:
        self.path = Path(path)
        self.fsync = Fsync.parse(fsync)
        self._key = key
        self._lock = threading.Lock()
        self.features: frozenset[str] = frozenset(FEATURES)
        self._delta = _delta.DeltaEncoder()
        if self.path.is_dir():
            raise ConfigError(f"{self.path} is a directory; give a cassette file (.jsonl) "
                              "or a directory to create <run id>.jsonl in")
        try:  # keys that are not strings (json.dumps would turn {1: .., "1": ..} into a key
            text = canonical(dict(header))  # twice): refused before anything is created
            if text_nests_deeper(text, LINE_DEPTH):
                raise UnserializableValue(f"it nests deeper than the {LINE_DEPTH} levels a "
                                          "cassette's reader takes")
        except UnserializableValue as exc:
            raise UnserializableValue(f"{self.path}: the header holds a value a cassette "
                                      f"cannot store faithfully ({exc}); nothing was "
                                      "written") from None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CassetteWriteError(f"cannot create the folder of {self.path}: "
                                     f"{exc.strerror or exc}", path=self.path) from None
        self._writer_lock = writer_lock.acquire(self.path, run=header.get("run"),
                                                what="recording")
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | _O_CLOEXEC
        flags |= os.O_TRUNC if overwrite else os.O_EXCL
        try:
            self._fd = os.open(self.path, flags, 0o644)
        except FileExistsError:
            self._writer_lock.release()
            raise PathTaken(f"cassette {self.path} already exists; choose another path "
                            "or pass overwrite=True (--force)") from None
        except OSError as exc:
            self._writer_lock.release()
            raise CassetteWriteError(f"cannot create cassette {self.path}: "
                                     f"{exc.strerror or exc}", path=self.path) from None
        self._prev = ""
        self._v1 = False  # a new cassette is always written in the current format
        self._seq = 0
        self._size = 0
        self._group: _GroupSync | None = None
        self._failed: CassetteWriteError | None = None
        self.closed = False
        line = {"format": FORMAT, "features": list(FEATURES),
                **{k: v for k, v in header.items() if k not in ("format", "features")}}
        line["key_id"] = key_id(key)
        self.header: Mapping[str, Any] = line
        with self._lock, WHOLE:  # forced to disk as a model line is: with the group commit
            self._write(line, sync=self.fsync is Fsync.SYNC)
            self._group_commit()

    @classmethod
    def reopen(cls, cassette: Cassette, key: bytes, fsync: Fsync | str = Fsync.TURN
               ) -> CassetteWriter:
        """Continue an unfinished cassette (a crashed run being resumed).

        A torn last line is cut first (the caller has reported it), and so is an end line
        of status ``interrupted`` (the run is resumed). ``key`` must be the key the
        cassette is signed with, so that the chain goes on unbroken. The file must be as
        ``cassette`` found it: a writer that appended since is refused.
        """
        if cassette.end is not None and cassette.end.get("status") not in RESUMABLE_ENDS:
            raise NotResumable(f"{cassette.path}: the run already ended with status "
                               f"{cassette.end.get('status')!r}; there is nothing to resume")
        if key_id(key) != cassette.header.get("key_id"):
            raise KeyMissing(f"{cassette.path} is signed with key {cassette.header.get('key_id')}"
                             "; continuing it needs that key")
        self = cls.__new__(cls)
        self.path = Path(cassette.path)
        self._writer_lock = writer_lock.acquire(self.path, run=cassette.header.get("run"),
                                                what="resuming")
        try:
            if self.path.stat().st_size != cassette.size:
                raise CassetteLocked(f"{self.path} changed since it was read (another "
                                     "process wrote to it); read it again", path=self.path)
            keep = cassette.torn_offset if cassette.torn_offset is not None else cassette.size
            if cassette.end_offset is not None:  # set with the end line, when there is one
                keep = cassette.end_offset
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | _O_CLOEXEC)
            self._cut = b""  # what is cut (last): put back if the resume cannot start
            if keep != cassette.size:
                try:
                    with open(self.path, "rb") as found:
                        found.seek(keep)
                        self._cut = found.read()
                    os.ftruncate(self._fd, keep)
                except BaseException:
                    os.close(self._fd)
                    raise
        except BaseException:
            self._writer_lock.release()
            raise
        self.fsync = Fsync.parse(fsync)
        self._key = key
        self._lock = threading.Lock()
        # a run goes on with the features its header names (none: it began without them)
        self.features = frozenset(cassette.header.get("features") or ())
        self._delta = _delta.DeltaEncoder(shapes="reply_shapes" in self.features)
        for seq in sorted(cassette.requests)[-_delta.WINDOW:]:
            self._delta.prime(seq, cassette.requests[seq])
            if cassette.header.get("format") != V1:
                self._delta.replied(seq, cassette.replies.get(seq))
        self._prev = cassette.sigs[len(cassette.observations)]
        self._v1 = cassette.header.get("format") == V1  # its chain goes on as it began
        self._seq = len(cassette.observations)
        self._size = self._kept = keep
        self._group = None
        self._failed = None
        self.closed = False
        self.header = cassette.header
        return self

    def append_copy(self, line: Mapping[str, Any], request_body: Any = None) -> dict[str, Any]:
        """Write a line copied from another cassette at the same ``seq`` (a fork's prefix).

        Its stored request, a delta against earlier lines, stays valid because the lines
        before it were copied at the same positions; ``request_body`` is its full request.
        """
        with self._lock, WHOLE:
            self._check_open()
            copy = {k: v for k, v in line.items() if k != "sig"}
            if copy.get("seq") != self._seq:
                raise SessionError(f"copied line has seq {copy.get('seq')}, expected {self._seq}")
            if request_body is not None:
                self._delta.prime(self._seq, request_body)
            self._write(copy, sync=self.fsync is Fsync.SYNC, copied=True)
            self._seq += 1
            return copy

    @property
    def failed(self) -> CassetteWriteError | None:
        """What stopped this cassette: a write that failed, or a group commit whose fsync
        did (then the file is cut back as for a failed write, and nothing more goes out)."""
        group = self._group
        if self._failed is None and group is not None and group.error is not None:
            with self._lock, WHOLE:
                if self._failed is None and not self.closed:
                    with contextlib.suppress(CassetteWriteError):
                        self._check_open()
        return self._failed

    @property
    def next_seq(self) -> int:
        return self._seq

    @property
    def lock(self) -> writer_lock.WriterLock:
        return self._writer_lock

    def append(self, obs: dict[str, Any], *, request_body: Any = None, has_request: bool = False,
               sync: bool = False, reply: Any = None) -> dict[str, Any]:
        """Assign ``seq``, sign and write ``obs``; returns the line as written.

        With ``has_request`` the model request ``request_body`` is stored as a delta
        against an earlier request of the same conversation; ``reply`` is the message the
        line's response gives the conversation (:func:`recorder.cassette.compact.reply_message`),
        which a later request may refer to.
        """
        with self._lock, WHOLE:
            self._check_open()
            line = {"seq": self._seq, **obs}
            if self._v1:  # a deja/1 cassette goes on with the fields deja/1 has
                _unlike(line)
                reply = None
            if has_request:
                line["request"] = self._delta.encode(self._seq, request_body)
            kind = line.get("kind")
            force = (sync or self.fsync is Fsync.SYNC
                     or (self.fsync is Fsync.TURN and kind in TURN_SYNC_KINDS))
            self._write(line, sync=force)
            if has_request:
                self._delta.written(self._seq, request_body, reply)
            if not force:
                self._group_commit()
            self._seq += 1
            return line

    def _group_commit(self) -> None:
        """Under ``turn``, have what was written forced to disk shortly, off this thread."""
        if self.fsync is Fsync.TURN:
            if self._group is None:
                self._group = _GroupSync(self._fd)
            self._group.request()

    def close(self, end: dict[str, Any]) -> dict[str, Any]:
        """Write the ``end`` line, force everything to disk and close the file."""
        with self._lock, WHOLE:
            self._stop_group()  # then its last pass's error, if any, refuses the end
            self._check_open()
            line = {"seq": self._seq, "kind": Kind.END.value, **end}
            try:
                self._write(line, sync=True)
            except CassetteWriteError:
                self._shut()
                raise
            self._seq += 1
            self._shut()
            return line

    def abandon(self) -> None:
        """Close the file without an end line (the run is to be resumed later)."""
        with self._lock, WHOLE:
            if not self.closed:
                self._stop_group()
                with contextlib.suppress(OSError):  # a failed disk: what is there, stays
                    os.fsync(self._fd)
                self._shut()

    def undo_reopen(self) -> None:
        """Close a writer :meth:`reopen` made and nothing was written with, putting back
        what it cut (an interrupted run's end line, a torn last line): a resume that could
        not start leaves the cassette as it found it."""
        with self._lock, WHOLE:
            if self.closed:
                return
            self._stop_group()
            if self._cut and self._size == self._kept and self._failed is None:
                with contextlib.suppress(OSError):  # what could not be put back, resume cuts
                    left = memoryview(self._cut)
                    while left:
                        left = left[os.write(self._fd, left):]
                    os.fsync(self._fd)
            self._shut()

    def discard(self) -> None:
        """Remove the new cassette this writer began (no program ran into it) and close it;
        a reopened one is put back as it was found instead (:meth:`undo_reopen`)."""
        if self._kept >= 0:
            self.undo_reopen()
            return
        with self._lock, WHOLE:
            if not self.closed:
                self._stop_group()
                self.path.unlink(missing_ok=True)  # while its lock is held: none resumes it
                self._shut()

    def _shut(self) -> None:
        self.closed = True
        os.close(self._fd)
        self._writer_lock.release()

    def _check_open(self) -> None:
        if self._failed is not None:
            raise CassetteWriteError(f"{self.path}: an earlier write failed ({self._failed}); "
                                     "nothing more is written to this cassette",
                                     path=self.path)
        if self.closed:
            raise SessionError(f"cassette {self.path} is closed; nothing more can be appended")
        group = self._group
        if group is not None and group.error is not None:
            if self._seq == 0:  # only the header was written, and it may not be on disk
                self._size = 0
            self._fail(group.error, "forcing to disk")

    def _stop_group(self) -> None:
        """No group commit after this; one that failed is kept for :meth:`_check_open`."""
        if self._group is not None:
            self._group.stop()
            if self._group.error is None:
                self._group = None

    def _fail(self, exc: OSError, doing: str) -> None:
        """Cut the file back to its last whole line, refuse everything after, raise."""
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)
        seq = self._seq
        if self._size == 0:  # not even the header: nothing was recorded
            error = CassetteWriteError(
                f"{self.path}: {doing} its header failed: {exc.strerror or exc}. Nothing "
                "was recorded; free the disk (or fix its permissions) and run it again",
                path=self.path, seq=seq)
        else:
            error = CassetteWriteError(
                f"{self.path}: {doing} seq {seq} failed: {exc.strerror or exc}. The run "
                f"stops here; the cassette keeps its {seq} whole observation line(s) and "
                "still verifies. Free the disk (or fix its permissions), then `deja "
                "resume` it", path=self.path, seq=seq)
        self._failed = error
        raise error

    def _write(self, line: dict[str, Any], *, sync: bool, copied: bool = False) -> None:
        if line.get("kind") in KINDS:  # an observation: the types readers check
            try:
                _validate.check_line(line, self.path, self._seq)
            except CorruptCassette as exc:
                raise UnserializableValue(f"{exc}; a reader could not use such a line, so "
                                          "nothing was written") from None
        try:
            # Every line keeps its field order on disk ("format" first in the header; a
            # tool result's or effect's dict keys as returned, so a replay gives back the
            # same order). The signature covers these exact bytes; a deja/1 cassette being
            # continued covers the canonical (sorted) form, as it did when it began.
            text = line_bytes(line)
            body = canonical(line) if self._v1 else text
        except (ValueError, TypeError, RecursionError, UnicodeEncodeError) as exc:
            raise UnserializableValue(
                f"{self.path}: seq {self._seq} ({line.get('kind', 'header')}) holds a value "
                f"a cassette cannot store faithfully ({type(exc).__name__}: {exc}); nothing "
                "was written") from None
        # A model line recorded live has its request and response kept within depth as
        # they were read (recorder.capture.exchange, compact); any other line, and any
        # line copied, is checked here, a last bound. Values are JSON or encoded by
        # recorder.values (no tuple, which orjson would not count as a level) but in a
        # control line (a fork's edit, as given): that one is measured on its text.
        kind = line.get("kind")
        if kind == Kind.CONTROL.value:
            deep = text_nests_deeper(text, LINE_DEPTH)
        else:
            deep = (copied or kind != Kind.MODEL.value) and openers(text) > LINE_DEPTH \
                and nests_deeper(line, LINE_DEPTH)
        if deep:
            raise UnserializableValue(
                f"{self.path}: seq {self._seq} ({line.get('kind', 'header')}) nests deeper "
                f"than the {LINE_DEPTH} levels a cassette's reader takes; nothing was written")
        sig = encode_sig(mac(self._key, self._prev, body))
        data = memoryview(with_sig(text, sig) + b"\n")
        size = len(data)
        try:
            while data:
                data = data[os.write(self._fd, data):]
            if sync:
                os.fsync(self._fd)
        except OSError as exc:
            self._fail(exc, "writing")
        self._size += size
        self._prev = sig
