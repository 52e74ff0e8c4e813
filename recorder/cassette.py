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

from . import _compact, _delta
from ._canonical import canonical
from .errors import (
    ConfigError,
    CorruptCassette,
    KeyMissing,
    SignatureError,
    TornCassette,
    UnsupportedFormat,
)
from .keys import Keyring, key_id

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


class _GroupSync:
    """Forces a file to disk from a background thread, whenever lines were written.

    Passes are at least ``INTERVAL`` seconds apart, so a burst of fast calls shares one
    fsync instead of queueing behind one each.
    """

    INTERVAL = 0.01

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._wake = threading.Event()
        self._stop = False
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
            except OSError:  # the file was closed under us; the closer syncs itself
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


class CassetteWriter:
    """Appends signed lines to a cassette file. Thread-safe."""

    def __init__(self, path: str | Path, header: dict[str, Any], key: bytes,
                 fsync: Fsync | str = Fsync.TURN, *, overwrite: bool = False) -> None:
        self.path = Path(path)
        self.fsync = Fsync.parse(fsync)
        self._key = key
        self._lock = threading.Lock()
        self._delta = _delta.DeltaEncoder()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        flags |= os.O_TRUNC if overwrite else os.O_EXCL
        try:
            self._fd = os.open(self.path, flags, 0o644)
        except FileExistsError:
            raise ConfigError(f"cassette {self.path} already exists; choose another path "
                              "or pass overwrite=True (--force)") from None
        self._prev = ""
        self._seq = 0
        self._group: _GroupSync | None = None
        self.closed = False
        header = {"format": FORMAT, **{k: v for k, v in header.items() if k != "format"}}
        header["key_id"] = key_id(key)
        self.header = header
        self._write(header, sync=True)

    @classmethod
    def reopen(cls, cassette: Cassette, key: bytes, fsync: Fsync | str = Fsync.TURN
               ) -> CassetteWriter:
        """Continue an unfinished cassette (a crashed run being resumed).

        A torn last line is cut first (the caller has reported it). ``key`` must be the key
        the cassette is signed with, so that the chain goes on unbroken.
        """
        if cassette.end is not None:
            raise ConfigError(f"{cassette.path}: the run already ended with status "
                              f"{cassette.end.get('status')!r}; there is nothing to resume")
        if key_id(key) != cassette.header.get("key_id"):
            raise ConfigError(f"{cassette.path} is signed with key {cassette.header.get('key_id')}"
                              "; continuing it needs that key")
        self = cls.__new__(cls)
        self.path = Path(cassette.path)
        self.fsync = Fsync.parse(fsync)
        self._key = key
        self._lock = threading.Lock()
        self._delta = _delta.DeltaEncoder()
        for seq in sorted(cassette.requests)[-_delta.WINDOW:]:
            self._delta.prime(seq, cassette.requests[seq])
        if cassette.torn_offset is not None:
            os.truncate(self.path, cassette.torn_offset)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0))
        self._prev = cassette.sigs[-1]
        self._seq = len(cassette.observations)
        self._group = None
        self.closed = False
        self.header = cassette.header
        return self

    def append_copy(self, line: dict[str, Any], request_body: Any = None) -> dict[str, Any]:
        """Write a line copied from another cassette at the same ``seq`` (a fork's prefix).

        Its stored request, a delta against earlier lines, stays valid because the lines
        before it were copied at the same positions; ``request_body`` is its full request.
        """
        with self._lock:
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

    def append(self, obs: dict[str, Any], *, request_body: Any = None, has_request: bool = False,
               sync: bool = False) -> dict[str, Any]:
        """Assign ``seq``, sign and write ``obs``; returns the line as written.

        With ``has_request`` the model request ``request_body`` is stored as a delta
        against an earlier request of the same conversation.
        """
        with self._lock:
            if self.closed:
                raise ConfigError(f"cassette {self.path} is closed; nothing more can be appended")
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
            if self.closed:
                raise ConfigError(f"cassette {self.path} is already closed")
            line = {"seq": self._seq, "kind": "end", **end}
            self._stop_group()
            self._write(line, sync=True)
            self._seq += 1
            self.closed = True
            os.close(self._fd)
            return line

    def abandon(self) -> None:
        """Close the file without an end line (the run is to be resumed later)."""
        with self._lock:
            if not self.closed:
                self._stop_group()
                self.closed = True
                os.fsync(self._fd)
                os.close(self._fd)

    def _stop_group(self) -> None:
        if self._group is not None:
            self._group.stop()
            self._group = None

    def _write(self, line: dict[str, Any], *, sync: bool) -> None:
        body = canonical(line)
        sig = encode_sig(_mac(self._key, self._prev, body))
        # Every line keeps its field order on disk ("format" first in the header; a tool
        # result's or effect's dict keys as returned, so a replay gives back the same order);
        # the signature covers the canonical (sorted) form, which the reader recomputes.
        body = json.dumps(line, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        data = memoryview(body[:-1] + b',"sig":"' + sig.encode("ascii") + b'"}\n')
        while data:
            data = data[os.write(self._fd, data):]
        if sync:
            os.fsync(self._fd)
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


def _lines(path: Path) -> tuple[list[tuple[int, bytes]], int | None]:
    """Split the file into (offset, line) pairs; the offset of a torn last line, if any."""
    data = path.read_bytes()
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
    return out, torn


def load(path: str | Path, *, keyring: Keyring | None = None, require_signature: bool = False,
         allow_torn: bool = False, allow_incomplete: bool = True) -> Cassette:
    """Read and check a cassette.

    The signature chain is verified when ``keyring`` holds the key the header names;
    otherwise the cassette loads unverified (``verified`` is False and ``verify_note`` says
    why) unless ``require_signature``. The structure (JSON, dense seq, kinds, one end line
    at the end) is always checked.
    """
    path = Path(path)
    if not path.exists():
        raise CorruptCassette(f"no cassette at {path}", path=path)
    lines, torn = _lines(path)
    if not lines:
        if torn is not None:
            raise TornCassette(f"{path}: the header line is torn (the recording crashed while "
                               "starting); nothing can be replayed", path=path, offset=0)
        raise CorruptCassette(f"{path} is empty; it is not a deja cassette", path=path)
    try:
        header = json.loads(lines[0][1])
    except ValueError as exc:
        raise CorruptCassette(f"{path}: line 1 is not JSON ({exc}); not a deja cassette",
                              path=path) from None
    if not isinstance(header, dict) or "format" not in header:
        raise CorruptCassette(f"{path}: line 1 has no 'format' field; not a deja cassette",
                              path=path)
    if header["format"] not in READABLE_FORMATS:
        raise UnsupportedFormat(
            f"{path}: cassette format {header['format']!r} is not supported by this deja "
            f"(it reads {', '.join(READABLE_FORMATS)}); upgrade deja to read it", path=path)
    if torn is not None and not allow_torn:
        seq = len(lines) - 1
        raise TornCassette(
            f"{path}: the last line (seq {seq}, byte {torn}) is torn: the recording process "
            "died while writing it. Everything before it is intact; resume the run to cut "
            "it, or pass allow_torn (--allow-torn) to use the intact part",
            path=path, seq=seq, offset=torn)

    key = None
    note = ""
    kid = header.get("key_id")
    if keyring is not None and kid:
        key = keyring.get(kid)
    if key is None:
        note = (f"not verified: key {kid} is not available (set DEJA_KEY or DEJA_OLD_KEYS)"
                if kid else "not verified: the header names no key")
        if require_signature:
            raise KeyMissing(f"{path}: signature required but {note[len('not verified: '):]}")
    else:
        note = f"verified with key {kid}"

    prev = ""
    observations: list[dict[str, Any]] = []
    end: dict[str, Any] | None = None
    requests: dict[int, Any] = {}
    sigs: list[str] = []
    for index, (_offset, raw) in enumerate(lines):
        if index == 0:
            line = header
        else:
            try:
                line = json.loads(raw)
            except ValueError as exc:
                raise CorruptCassette(f"{path}: line {index + 1} (seq {index - 1}) is not "
                                      f"valid JSON: {exc}", path=path, seq=index - 1) from None
        sig = line.pop("sig", None) if isinstance(line, dict) else None
        sigs.append(sig if isinstance(sig, str) else "")
        seq = index - 1
        if key is not None:
            if not check_sig(key, prev, line, sig):
                what = "the header" if index == 0 else f"seq {seq}"
                raise SignatureError(
                    f"{path}: signature check failed at {what} (line {index + 1}): the line "
                    "was edited, inserted, deleted or moved after it was written. Do not "
                    "trust this cassette; restore it from where it was committed",
                    path=path, seq=None if index == 0 else seq)
            prev = sig
        if index == 0:
            continue
        if not isinstance(line, dict) or line.get("seq") != seq:
            got = line.get("seq") if isinstance(line, dict) else None
            raise CorruptCassette(f"{path}: line {index + 1} has seq {got}, expected {seq}: "
                                  "lines were deleted, inserted or reordered", path=path, seq=seq)
        if line.get("kind") not in KINDS:
            raise CorruptCassette(f"{path}: seq {seq} has unknown kind {line.get('kind')!r}",
                                  path=path, seq=seq)
        if end is not None:
            raise CorruptCassette(f"{path}: seq {seq} follows the end line (seq {end['seq']})",
                                  path=path, seq=seq)
        if line["kind"] == "end":
            end = line
            continue
        if line["kind"] == "model":
            try:
                if "request" in line:
                    requests[seq] = _delta.decode(line["request"], requests)
                _compact.expand(line, observations, requests.get(seq))
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise CorruptCassette(f"{path}: seq {seq}: it refers to an earlier line that "
                                      f"is missing or different ({exc!r})", path=path,
                                      seq=seq) from None
        observations.append(line)
    if end is None and not allow_incomplete:
        last = len(observations) - 1
        raise CorruptCassette(
            f"{path}: no end line after seq {last}: the file was truncated or the run "
            "crashed. Resume the run, or allow an incomplete cassette (--allow-incomplete)",
            path=path, seq=last + 1)
    return Cassette(path=path, header=header, observations=tuple(observations), end=end,
                    verified=key is not None, verify_note=note, torn_offset=torn,
                    requests=requests, sigs=tuple(sigs))
