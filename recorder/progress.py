"""Progress and cancel: what a run is doing, and a flag anyone can set to stop it.

Each run keeps a status record, ``$DEJA_HOME/runs/<run>.json``, in the shape operators
expect::

    {"run_id": "r_01a2…", "status": "running", "turn": 19, "turn_limit": 60,
     "step": "tool pay(invoice='INV-7')", "elapsed_s": 128.4, "budget_s": 3600,
     "tokens": 91420, "token_limit": 400000, "spend_usd": 1.12, "dollar_limit": 20.0,
     "artefacts": ["cassettes/r_01a2….jsonl"], "cancel": "deja cancel r_01a2…", ...}

It is updated at every step in memory and written (atomically) at most every
``interval`` seconds, the latest state always reaching the file within ``interval``, and
at once when the status changes or the run ends, so that a status line costs the agent's
calls nothing measurable. ``deja status RUN`` prints it.

Cancelling is a flag file, ``$DEJA_HOME/runs/<run>.cancel``: ``deja cancel RUN`` (or the
viewer's button) creates it; the recorder reads it before each call and after writes
(there at most every 20 ms: a run of fast calls pays one system call per call), and the
run stops at the next boundary with status ``cancelled``, never mid-action.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .keys import deja_home


def runs_dir() -> Path:
    return deja_home() / "runs"


def status_path(run: str) -> Path:
    return runs_dir() / f"{run}.json"


def cancel_path(run: str) -> Path:
    return runs_dir() / f"{run}.cancel"


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def request_cancel(run: str, reason: str = "") -> Path:
    """Ask run ``run`` to stop at its next boundary (any process may call this)."""
    path = cancel_path(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"requested": _now_iso(), "reason": reason,
                               "by": f"{socket.gethostname()}:{os.getpid()}"}))
    os.replace(tmp, path)
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


def read_status(run: str) -> dict[str, Any] | None:
    try:
        return json.loads(status_path(run).read_text())
    except FileNotFoundError:
        return None


class Progress:
    """The status record of one run."""

    def __init__(self, run: str, record: dict[str, Any], *, interval: float = 0.2) -> None:
        self.run = run
        self.path = status_path(run)
        self.interval = interval
        self._lock = threading.Lock()
        self._written = 0.0
        self._timer: threading.Timer | None = None
        self.record: dict[str, Any] = {"run_id": run, "status": "running", "turn": 0,
                                       "step": "starting", "pid": os.getpid(),
                                       "host": socket.gethostname(), "started": _now_iso(),
                                       "cancel": f"deja cancel {run}", **record}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()

    def update(self, *, force: bool = False, **fields: Any) -> None:
        with self._lock:
            changed_status = "status" in fields and fields["status"] != self.record["status"]
            self.record.update(fields)
            due = time.monotonic() - self._written >= self.interval
            if force or changed_status or due:
                self._write_locked()
            elif self._timer is None:  # write the latest state once the interval has passed
                self._timer = threading.Timer(self.interval, self._flush)
                self._timer.daemon = True
                self._timer.start()

    def _flush(self) -> None:
        with self._lock:
            self._timer = None
            self._write_locked()

    def _write(self) -> None:
        with self._lock:
            self._write_locked()

    def _write_locked(self) -> None:
        self.record["updated"] = _now_iso()
        tmp = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(self.record, default=str))
        os.replace(tmp, self.path)
        self._written = time.monotonic()
