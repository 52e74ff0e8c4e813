"""Cutting what a power loss leaves after a cassette's last whole line (``deja repair``).

The writer makes one ``write`` per line, so a crash leaves whole lines and at most one torn
line, which ``deja resume`` cuts. A power loss can leave more: the file's new length
reaches the disk before its data does, and the bytes after the last line read back as
zeros or as a fragment of a line, even after a run's end line. Such a file no longer
verifies, and a run that had ended cannot be resumed to cut them. :func:`plan` finds the
lines that verify from the start (the header's key must be this machine's, and the header
must verify); :func:`apply` keeps a copy of the file as it is (``<name>.bak``) and cuts it
after them.

What is cut must be junk: bytes in which no line deja wrote can be seen. A line after the
verified ones that looks like a cassette line (a ``seq`` or a ``sig`` in it) means the file
was edited, not cut short: :class:`NotRepairable`, and nothing is written.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from recorder.cassette import lock
from recorder.cassette.keys import Keyring
from recorder.cassette.reader import Prefix, peek_header, verified_prefix
from recorder.errors import CassetteWriteError, NotRepairable

__all__ = ["Repair", "apply", "plan"]

_SHOWN = 48  # bytes of the cut shown in a report


@dataclass(frozen=True)
class Repair:
    """What repairing a cassette keeps and cuts (``backup`` once it is done)."""

    path: Path
    size: int  # bytes in the file
    keep: int  # bytes kept: the header and every line after it that verifies
    lines: int  # whole lines kept, the header's included
    last_seq: int | None  # the seq of the last line kept (None: only the header)
    end: str | None  # the status of the end line kept (None: the run has none)
    cut: bytes  # the first bytes cut, to show
    backup: Path | None = None

    @property
    def needed(self) -> bool:
        return self.keep < self.size

    def describe(self) -> str:
        """The repair in words: what is cut and what the run is afterwards."""
        if not self.needed:
            return f"{self.path}: nothing to cut: every line verifies"
        kept = (f"after seq {self.last_seq}" if self.last_seq is not None
                else "after the header")
        more = "..." if self.size - self.keep > len(self.cut) else ""
        state = (f"the run ended {self.end}" if self.end is not None else
                 f"the run has no end line (it can be resumed: deja resume {self.path})")
        return (f"{self.path}: {self.size - self.keep} bytes {kept} (from byte {self.keep} "
                f"of {self.size}: {self.cut!r}{more}); {self.lines} lines verify and are "
                f"kept; {state}")


def plan(path: str | Path, *, keyring: Keyring | None = None) -> Repair:
    """What :func:`apply` would do to ``path``; refuses a cassette that cannot be checked
    here, one whose verified lines are followed by something other than junk
    (:class:`NotRepairable`), and one whose header does not verify."""
    prefix = verified_prefix(path, keyring=keyring)
    if not prefix.junk:
        raise _not_junk(prefix)
    with Path(prefix.path).open("rb") as f:
        f.seek(prefix.keep)
        cut = f.read(_SHOWN)
    return Repair(path=prefix.path, size=prefix.size, keep=prefix.keep, lines=prefix.lines,
                  last_seq=prefix.last_seq,
                  end=str(prefix.end["status"]) if prefix.end is not None else None, cut=cut)


def _not_junk(prefix: Prefix) -> NotRepairable:
    assert prefix.fault is not None  # junk is all there is after a whole, verified file
    return NotRepairable(
        f"{prefix.fault} (deja repair cuts only what a power loss leaves after the last line "
        "that verifies, and this looks like lines of a cassette, edited rather than cut "
        "short: nothing was written)", path=prefix.path, seq=prefix.fault.seq)


def apply(path: str | Path, *, keyring: Keyring | None = None) -> Repair:
    """Cut ``path`` after its last verified line (as :func:`plan` says), holding its
    writer lock, once a copy of the file as it was is on disk (``backup``)."""
    path = Path(path)
    header = peek_header(path)
    held = lock.acquire(path, run=header.get("run") if header is not None else None,
                        what="deja repair")
    try:
        done = plan(path, keyring=keyring)  # under the lock: nobody appends meanwhile
        if not done.needed:
            return done
        backup = _backup_name(path)
        try:
            shutil.copyfile(path, backup)
            _sync(backup)
            with path.open("r+b") as f:
                f.truncate(done.keep)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise CassetteWriteError(f"cannot repair {path}: {exc.strerror or exc}; the file "
                                     "is as it was", path=path) from None
        return replace(done, backup=backup)
    finally:
        held.release()


def _backup_name(path: Path) -> Path:
    """``<name>.bak``, or ``<name>.bak.N`` when that is taken: never overwritten."""
    candidate = path.with_name(path.name + ".bak")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.bak.{n}")
        n += 1
    return candidate


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
