"""The cassette directory as the workers see it: the one every worker of a runs database
writes to, whether it takes lines now, and how a run's cassette stands in it.

- :func:`check_shared`, at a worker's start: the directory is the one the other workers
  of this database write to (a marker with a token, the same token in the database);
- :func:`disk_trouble`: a probe of :data:`PROBE_BYTES` written and synced there, or why it
  cannot be (full, read-only, failing); a run stopped by its directory is dispatched again
  once a probe writes there (``deja.runs.worker.reconcile``);
- :func:`cassette_state` and :func:`_write_error`: a run's cassette on disk (no header, a
  recorded prefix, or ended) and whether its end line says a write failed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

from deja.runs.errors import CassettesNotShared
from deja.runs.store import DISK_ERROR, Store
from recorder.harness.progress import cassette_end

SHARE_MARKER = ".deja-share"
PROBE_BYTES = 256 * 1024  # written to a cassette directory to tell whether it takes lines


def check_shared(store: Store, cassettes: Path) -> None:
    """The cassette directory must be the one every worker of this database writes to.

    The first worker leaves a marker with a random token in it and the token in the
    database; a worker that finds another token (or none) where the database expects one
    is looking at a different directory: a share that is not mounted, or another path.
    """
    try:
        cassettes.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CassettesNotShared(f"the cassette directory {cassettes} cannot be created "
                                 f"({exc.strerror or exc}); set DEJA_CASSETTE_DIR to a "
                                 "writable directory every worker reaches") from None
    marker = cassettes / SHARE_MARKER
    found = _read_marker(marker)
    created = False
    if found is None:  # the first worker here: create it whole, or read the winner's
        draft = cassettes / f"{SHARE_MARKER}.{os.getpid()}"
        try:
            draft.write_text(os.urandom(12).hex() + "\n")
            os.link(draft, marker)
            created = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise CassettesNotShared(
                f"the cassette directory {cassettes} cannot be written ({exc.strerror or exc}): "
                "its first worker leaves a marker there. Free the disk (or fix its "
                "permissions) and start the worker again") from None
        finally:
            draft.unlink(missing_ok=True)
        found = _read_marker(marker)
    expected = store.get_meta("cassette_share")
    if expected is None and found is not None:
        if store.set_meta("cassette_share", found):
            store.set_meta("cassette_dir", str(cassettes))
            return
        expected = store.get_meta("cassette_share")
    if found != expected:
        if created:  # not the directory the database knows: leave it as it was
            marker.unlink(missing_ok=True)
            found = None
        where = store.get_meta("cassette_dir") or "the shared directory"
        raise CassettesNotShared(
            f"the cassette directory {cassettes} is not the one the other workers of this "
            f"database write to ({where}: its marker {SHARE_MARKER} is "
            f"{'missing' if found is None else 'different'} here). Mount that shared "
            "directory at the same path on every worker (NFS or the like, with working "
            "flock and rename) and point DEJA_CASSETTE_DIR at it")


def _read_marker(marker: Path) -> str | None:
    try:
        return marker.read_text().strip() or None
    except OSError:
        return None


def disk_trouble(directory: Path) -> str | None:
    """Why ``directory`` cannot take a cassette's lines now (full, read-only, failing), or
    None when a probe of :data:`PROBE_BYTES` is written and synced there."""
    probe = directory / f".deja-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            left = memoryview(b"\0" * PROBE_BYTES)
            while left:  # a short write is how a full disk answers first
                left = left[os.write(fd, left):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{directory}: {exc.strerror or exc}"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def cassette_state(path: Path) -> tuple[str, dict[str, Any] | None]:
    """``("none", None)`` when no header is on disk, ``("open", None)`` for a recorded
    prefix, ``("ended", end_line)`` for a run that ended."""
    return cassette_end(path)


def _write_error(end: dict[str, Any] | None) -> str | None:
    """The message of an end line that says a cassette write failed (a full disk)."""
    error = (end or {}).get("error")
    if isinstance(error, dict) and error.get("type") == DISK_ERROR:
        return str(error.get("message") or "a cassette write failed")
    return None
