"""The cassette: one run's observation log, JSON Lines, signed, append-only.

Line 1 is the header; its first field is the format version. Every further line is one
observation with a dense ``seq``; the last line of a finished run is ``kind: "end"``.
Each line ends with ``sig`` = base64url(HMAC-SHA256(key, previous sig + canonical JSON of
the line without ``sig``)), unpadded, the header's previous sig being empty. Editing,
inserting, deleting or reordering a line breaks the chain at that line, and the reader
names it.

The writer makes one ``write`` per line, before the observation reaches the agent: a
process killed at any point loses nothing it wrote, and one killed in the middle of a
write leaves a torn last line, which the reader reports and never accepts silently.
The fsync policy decides when lines are also forced to the disk itself (what a machine
crash or power loss would otherwise take):

- ``sync``: every line, before the call returns;
- ``turn`` (the default): side effects (intent, outcome), control and end lines before
  the call returns; model and HTTP lines within about 10 ms, by a background thread that
  forces whatever has been written since its last pass (a group commit, as databases
  do), so that the disk's latency stays off the agent's calls;
- ``exit``: once, when the run ends.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import hashlib
import hmac
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _compact, _delta, _validate, trust
from . import lock as writer_lock
from ._canonical import canonical
from .errors import (
    CassetteLocked,
    CassetteNotFound,
    CassetteWriteError,
    ConfigError,
    CorruptCassette,
    SignatureError,
    TornCassette,
    UnserializableValue,
    UnsupportedFormat,
)
from .keys import Keyring, key_id, load_keyring

FORMAT = "deja/1"
READABLE_FORMATS = (FORMAT,)
KINDS = ("model", "http", "tool", "intent", "outcome", "effect", "control", "end")


class Fsync(enum.StrEnum):
    """When the writer forces a line to disk."""

    SYNC = "sync"
    TURN = "turn"
    EXIT = "exit"

    @classmethod
    def parse(cls, value: str | Fsync) -> Fsync:
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown fsync policy {value!r}; valid: {valid}") from None


_TURN_SYNC_KINDS = frozenset({"intent", "outcome", "control", "end"})
# End statuses a resume may continue after (the end line is cut first): a run stopped by a
# signal ends ``interrupted`` with an end line, and is meant to be picked up again.
RESUMABLE_ENDS = frozenset({"interrupted"})


class _GroupSync:
    """Forces a file to disk from a background thread, whenever lines were written.

    Passes are at least ``INTERVAL`` seconds apart, so a burst of fast calls shares one
    fsync instead of queueing behind one each. A failed fsync (an I/O error, a disk that
    filled up under delayed allocation) is kept in ``error``: the writer refuses the next
    line with it.
    """

    INTERVAL = 0.01

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._wake = threading.Event()
        self._stop = False
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._loop, name="deja-fsync", daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            try:
                os.fsync(self._fd)
            except OSError as exc:
                self.error = exc
                return
            time.sleep(self.INTERVAL)

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()


def _mac(key: bytes, prev_sig: str, body: bytes) -> bytes:
    return hmac.digest(key, prev_sig.encode("ascii") + body, hashlib.sha256)


def encode_sig(mac: bytes) -> str:
    """base64url without padding: 43 characters."""
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")


def sign(key: bytes, prev_sig: str, line: dict[str, Any]) -> str:
    return encode_sig(_mac(key, prev_sig, canonical(line)))


def check_sig(key: bytes, prev_sig: str, line: dict[str, Any], sig: object) -> bool:
    """Does ``sig`` sign ``line``?"""
    return isinstance(sig, str) and hmac.compare_digest(sig, sign(key, prev_sig, line))


_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class CassetteWriter:
    """Appends signed lines to a cassette file. Thread-safe; one writer per file.

    The writer holds the cassette's writer lock (:mod:`recorder.lock`) from the moment it
    is created until it closes or abandons the file. A write that fails (disk full,
    read-only file system, I/O error) cuts the file back to its last whole line and raises
    :class:`CassetteWriteError`; the writer then refuses every further line, so nothing
    after the failure is written out of order and the committed prefix still verifies.
    """

    def __init__(self, path: str | Path, header: dict[str, Any], key: bytes,
                 fsync: Fsync | str = Fsync.TURN, *, overwrite: bool = False) -> None:
        self.path = Path(path)
        self.fsync = Fsync.parse(fsync)
        self._key = key
        self._lock = threading.Lock()
        self._delta = _delta.DeltaEncoder()
        if self.path.is_dir():
            raise ConfigError(f"{self.path} is a directory; give a cassette file (.jsonl) "
                              "or a directory to create <run id>.jsonl in")
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
            raise ConfigError(f"cassette {self.path} already exists; choose another path "
                              "or pass overwrite=True (--force)") from None
        except OSError as exc:
            self._writer_lock.release()
            raise CassetteWriteError(f"cannot create cassette {self.path}: "
                                     f"{exc.strerror or exc}", path=self.path) from None
        self._prev = ""
        self._seq = 0
        self._size = 0
        self._group: _GroupSync | None = None
        self.failed: CassetteWriteError | None = None
        self.closed = False
        header = {"format": FORMAT, **{k: v for k, v in header.items() if k != "format"}}
        header["key_id"] = key_id(key)
        self.header = header
        with self._lock:
            self._write(header, sync=True)

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
            raise ConfigError(f"{cassette.path}: the run already ended with status "
                              f"{cassette.end.get('status')!r}; there is nothing to resume")
        if key_id(key) != cassette.header.get("key_id"):
            raise ConfigError(f"{cassette.path} is signed with key {cassette.header.get('key_id')}"
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
            if cassette.end is not None:
                keep = cassette.end_offset
            if keep != cassette.size:
                os.truncate(self.path, keep)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | _O_CLOEXEC)
        except BaseException:
            self._writer_lock.release()
            raise
        self.fsync = Fsync.parse(fsync)
        self._key = key
        self._lock = threading.Lock()
        self._delta = _delta.DeltaEncoder()
        for seq in sorted(cassette.requests)[-_delta.WINDOW:]:
            self._delta.prime(seq, cassette.requests[seq])
        self._prev = cassette.sigs[len(cassette.observations)]
        self._seq = len(cassette.observations)
        self._size = keep
        self._group = None
        self.failed = None
        self.closed = False
        self.header = cassette.header
        return self

    def append_copy(self, line: dict[str, Any], request_body: Any = None) -> dict[str, Any]:
        """Write a line copied from another cassette at the same ``seq`` (a fork's prefix).

        Its stored request, a delta against earlier lines, stays valid because the lines
        before it were copied at the same positions; ``request_body`` is its full request.
        """
        with self._lock:
            self._check_open()
            line = {k: v for k, v in line.items() if k != "sig"}
            if line.get("seq") != self._seq:
                raise ConfigError(f"copied line has seq {line.get('seq')}, expected {self._seq}")
            if request_body is not None:
                self._delta.prime(self._seq, request_body)
            self._write(line, sync=self.fsync is Fsync.SYNC)
            self._seq += 1
            return line

    @property
    def next_seq(self) -> int:
        return self._seq

    @property
    def lock(self) -> writer_lock.WriterLock:
        return self._writer_lock

    def append(self, obs: dict[str, Any], *, request_body: Any = None, has_request: bool = False,
               sync: bool = False) -> dict[str, Any]:
        """Assign ``seq``, sign and write ``obs``; returns the line as written.

        With ``has_request`` the model request ``request_body`` is stored as a delta
        against an earlier request of the same conversation.
        """
        with self._lock:
            self._check_open()
            line = {"seq": self._seq, **obs}
            if has_request:
                line["request"] = self._delta.encode(self._seq, request_body)
            kind = line.get("kind")
            force = (sync or self.fsync is Fsync.SYNC
                     or (self.fsync is Fsync.TURN and kind in _TURN_SYNC_KINDS))
            self._write(line, sync=force)
            if not force and self.fsync is Fsync.TURN:
                if self._group is None:
                    self._group = _GroupSync(self._fd)
                self._group.request()
            self._seq += 1
            return line

    def close(self, end: dict[str, Any]) -> dict[str, Any]:
        """Write the ``end`` line, force everything to disk and close the file."""
        with self._lock:
            self._check_open()
            line = {"seq": self._seq, "kind": "end", **end}
            self._stop_group()
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
        with self._lock:
            if not self.closed:
                self._stop_group()
                with contextlib.suppress(OSError):  # a failed disk: what is there, stays
                    os.fsync(self._fd)
                self._shut()

    def _shut(self) -> None:
        self.closed = True
        os.close(self._fd)
        self._writer_lock.release()

    def _check_open(self) -> None:
        if self.failed is not None:
            raise CassetteWriteError(f"{self.path}: an earlier write failed ({self.failed}); "
                                     "nothing more is written to this cassette",
                                     path=self.path)
        if self.closed:
            raise ConfigError(f"cassette {self.path} is closed; nothing more can be appended")
        group = self._group
        if group is not None and group.error is not None:
            self._fail(group.error, "forcing lines to disk")

    def _stop_group(self) -> None:
        if self._group is not None:
            self._group.stop()
            self._group = None

    def _fail(self, exc: OSError, doing: str) -> None:
        """Cut the file back to its last whole line, refuse everything after, raise."""
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)
        seq = self._seq
        error = CassetteWriteError(
            f"{self.path}: {doing} seq {seq} failed: {exc.strerror or exc}. The run stops "
            f"here; the cassette keeps its {seq} whole observation line(s) and still "
            "verifies. Free the disk (or fix its permissions), then `deja resume` it",
            path=self.path, seq=seq)
        self.failed = error
        raise error

    def _write(self, line: dict[str, Any], *, sync: bool) -> None:
        try:
            body = canonical(line)
            # Every line keeps its field order on disk ("format" first in the header; a
            # tool result's or effect's dict keys as returned, so a replay gives back the
            # same order); the signature covers the canonical (sorted) form, which the
            # reader recomputes.
            text = json.dumps(line, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False).encode("utf-8")
        except (ValueError, TypeError, RecursionError, UnicodeEncodeError) as exc:
            raise UnserializableValue(
                f"{self.path}: seq {self._seq} ({line.get('kind', 'header')}) holds a value "
                f"a cassette cannot store faithfully ({type(exc).__name__}: {exc}); nothing "
                "was written") from None
        sig = encode_sig(_mac(self._key, self._prev, body))
        data = memoryview(text[:-1] + b',"sig":"' + sig.encode("ascii") + b'"}\n')
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


# ---------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Cassette:
    """A loaded cassette: header, observations (``end`` excluded) and what loading found."""

    path: Path
    header: dict[str, Any]
    observations: tuple[dict[str, Any], ...]
    end: dict[str, Any] | None
    verified: bool
    verify_note: str
    torn_offset: int | None = None
    requests: dict[int, Any] = field(default_factory=dict, repr=False)
    sigs: tuple[str, ...] = field(default=(), repr=False)  # header's first, then each line's
    size: int = 0  # bytes in the file when it was read
    end_offset: int | None = None  # where the end line starts

    @property
    def run(self) -> str:
        return str(self.header.get("run"))

    def request_of(self, seq: int) -> Any:
        """The full request body of the model observation ``seq``."""
        return self.requests[seq]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.observations)

    def __len__(self) -> int:
        return len(self.observations)


def _lines(path: Path) -> tuple[list[tuple[int, bytes]], int | None, int]:
    """Split the file into (offset, line) pairs; the offset of a torn last line, if any;
    the file's size."""
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise CorruptCassette(f"{path} is a directory, not a cassette file", path=path) from None
    except OSError as exc:
        raise CorruptCassette(f"cannot read {path}: {exc.strerror or exc}", path=path) from None
    out: list[tuple[int, bytes]] = []
    pos = 0
    torn: int | None = None
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            torn = pos
            break
        out.append((pos, data[pos:nl]))
        pos = nl + 1
    return out, torn, len(data)


def _signed(key: bytes, prev: str, line: dict[str, Any], sig: object, path: Path,
            seq: int | None) -> bool:
    try:
        return check_sig(key, prev, line, sig)
    except UnicodeEncodeError:
        where = "the header" if seq is None else f"seq {seq}"
        raise CorruptCassette(f"{path}: {where} holds text that is not valid Unicode (a lone "
                              "surrogate); deja never writes such a line", path=path,
                              seq=seq) from None
    except (ValueError, TypeError, RecursionError) as exc:
        where = "the header" if seq is None else f"seq {seq}"
        raise CorruptCassette(f"{path}: {where} holds a value deja never writes ({exc})",
                              path=path, seq=seq) from None


def _chain(lines: list[tuple[int, bytes]], path: Path, header_sig: object
           ) -> Iterator[tuple[str, dict[str, Any], object]]:
    """Each observation line (without its sig) with the stored sig of the line before it
    and its own, for the trust decision; stops at the first line that cannot be read."""
    prev = header_sig
    for index, (_, raw) in enumerate(lines[1:], start=1):
        try:
            line = _validate.parse_line(raw, path, f"line {index + 1}", index - 1)
        except CorruptCassette:
            return
        if not isinstance(line, dict):
            return
        sig = line.pop("sig", None)
        if isinstance(prev, str):
            yield prev, line, sig
        prev = sig


def _not_found(path: Path) -> CassetteNotFound:
    """The error for a path with no cassette, naming the closest files that exist."""
    import difflib

    folder = path.parent
    if path.is_dir():
        return CassetteNotFound(f"{path} is a directory, not a cassette; name one of its "
                                "<run>.jsonl files", path=path)
    if not folder.is_dir():
        return CassetteNotFound(f"no cassette at {path}: the directory {folder} does not "
                                "exist", path=path)
    try:
        names = sorted(p.name for p in folder.iterdir() if p.suffix == ".jsonl")
    except OSError:
        names = []
    stems = {Path(name).stem: name for name in names}
    close = difflib.get_close_matches(path.stem, list(stems), n=3, cutoff=0.6)
    if close:
        hint = "did you mean " + ", ".join(str(folder / stems[s]) for s in close) + "?"
    elif names:
        hint = f"{folder} holds {len(names)} other cassette(s), e.g. {folder / names[0]}"
    else:
        hint = f"{folder} holds no cassettes (*.jsonl)"
    return CassetteNotFound(f"no cassette at {path}; {hint}", path=path)


def load(path: str | Path, *, keyring: Keyring | None = None, require_signature: bool = False,
         allow_unverified: bool | None = None, allow_torn: bool = False,
         allow_incomplete: bool = True) -> Cassette:
    """Read and check a cassette.

    The signature chain is verified with the key the header names, from ``keyring`` (by
    default this environment's keys). A cassette whose key nobody here has is refused
    (:class:`UnverifiedCassette`) unless ``allow_unverified`` (default: the
    ``DEJA_ALLOW_UNVERIFIED`` environment variable); it then loads with ``verified``
    False and a ``verify_note`` that starts with ``NOT VERIFIED``. ``require_signature``
    refuses it even then. An edited or removed ``key_id`` is a :class:`SignatureError`;
    see :mod:`recorder.trust`. The structure (strict JSON, field types, dense seq, kinds,
    one end line at the end) is always checked. A torn last line is refused unless
    ``allow_torn``; a missing end line unless ``allow_incomplete``.
    """
    path = Path(path)
    if keyring is None:
        keyring = load_keyring(create=False)
    if allow_unverified is None:
        allow_unverified = trust.allow_unverified_from_env()
    if not path.is_file():
        raise _not_found(path)
    lines, torn, size = _lines(path)
    if not lines:
        if torn is not None:
            raise TornCassette(f"{path}: the header line is torn (the recording crashed while "
                               "starting); nothing can be replayed", path=path, offset=0)
        raise CorruptCassette(f"{path} is empty; it is not a deja cassette", path=path)
    try:
        header = _validate.parse_line(lines[0][1], path, "line 1 (the header)", None)
    except CorruptCassette as exc:
        raise CorruptCassette(f"{exc}; not a deja cassette", path=path) from None
    if not isinstance(header, dict) or "format" not in header:
        raise CorruptCassette(f"{path}: line 1 has no 'format' field; not a deja cassette",
                              path=path)
    if not isinstance(header["format"], str) or header["format"] not in READABLE_FORMATS:
        raise UnsupportedFormat(
            f"{path}: cassette format {header['format']!r} is not supported by this deja "
            f"(it reads {', '.join(READABLE_FORMATS)}); upgrade deja to read it", path=path)
    header_sig = header.pop("sig", None)
    _validate.check_header(header, path)
    verdict = trust.decide(path, header, header_sig, lambda: _chain(lines, path, header_sig),
                           keyring, check_sig, allow_unverified=allow_unverified,
                           require_signature=require_signature)
    key = verdict.key
    if key is not None and not _signed(key, "", header, header_sig, path, None):
        raise SignatureError(
            f"{path}: signature check failed at the header (line 1): it was edited after "
            "it was written. Do not trust this cassette; restore it from where it was "
            "committed", path=path, seq=None)
    prev = header_sig if isinstance(header_sig, str) else ""
    observations: list[dict[str, Any]] = []
    end: dict[str, Any] | None = None
    end_offset: int | None = None
    requests: dict[int, Any] = {}
    sigs: list[str] = [prev]
    for index, (offset, raw) in enumerate(lines[1:], start=1):
        seq = index - 1
        line = _validate.parse_line(raw, path, f"line {index + 1} (seq {seq})", seq)
        sig = line.pop("sig", None) if isinstance(line, dict) else None
        if key is not None:
            if not _signed(key, prev, line, sig, path, seq):
                raise SignatureError(
                    f"{path}: signature check failed at seq {seq} (line {index + 1}): the "
                    "line was edited, inserted, deleted or moved after it was written. Do "
                    "not trust this cassette; restore it from where it was committed",
                    path=path, seq=seq)
        prev = sig if isinstance(sig, str) else ""
        sigs.append(prev)
        if not isinstance(line, dict) or line.get("seq") != seq:
            got = line.get("seq") if isinstance(line, dict) else None
            raise CorruptCassette(f"{path}: line {index + 1} has seq {got!r}, expected {seq}: "
                                  "lines were deleted, inserted or reordered", path=path, seq=seq)
        if not isinstance(line.get("kind"), str) or line["kind"] not in KINDS:
            raise CorruptCassette(f"{path}: seq {seq} has unknown kind {line.get('kind')!r}",
                                  path=path, seq=seq)
        if end is not None:
            raise CorruptCassette(f"{path}: seq {seq} follows the end line (seq {end['seq']})",
                                  path=path, seq=seq)
        _validate.check_line(line, path, seq)
        if line["kind"] == "end":
            end, end_offset = line, offset
            continue
        if line["kind"] == "model":
            try:
                requests[seq] = _delta.decode(line["request"], requests)
                _compact.expand(line, observations, requests.get(seq))
            except (KeyError, IndexError, TypeError, ValueError, AttributeError,
                    RecursionError) as exc:
                raise CorruptCassette(f"{path}: seq {seq}: it refers to an earlier line that "
                                      f"is missing or different ({exc!r})", path=path,
                                      seq=seq) from None
        observations.append(line)
    if torn is not None and not allow_torn:
        seq = len(lines) - 1
        checked = "verified" if key is not None else "well-formed (not verified)"
        raise TornCassette(
            f"{path}: the last line (seq {seq}, byte {torn}) is torn: the recording process "
            f"died while writing it. The {len(lines)} lines before it are {checked}. Resume "
            "the run to cut it (deja resume), or use the intact part (--allow-torn for deja "
            "replay, verify and fork; allow_torn=True in Python)",
            path=path, seq=seq, offset=torn)
    if end is None and not allow_incomplete and not (torn is not None and allow_torn):
        if not observations:
            raise CorruptCassette(
                f"{path} holds only its header: no observation and no end line (the run "
                "never got going, or everything after the header was cut off)", path=path,
                seq=0)
        last = len(observations) - 1
        raise CorruptCassette(
            f"{path}: no end line after seq {last}: the file was truncated or the run "
            "crashed. Resume the run, or allow an incomplete cassette (--allow-incomplete)",
            path=path, seq=last + 1)
    return Cassette(path=path, header=header, observations=tuple(observations), end=end,
                    verified=key is not None, verify_note=verdict.note, torn_offset=torn,
                    requests=requests, sigs=tuple(sigs), size=size, end_offset=end_offset)
