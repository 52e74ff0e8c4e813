"""A worker's children: what a run's ``deja record``/``deja resume`` writes to stderr,
passed on to the worker's own stderr as it comes, line by line, and its last lines kept,
so that a run that fails says why in its record and in its failure alert (the program's
traceback, deja's message), not only in a log on the worker's machine; and the child
processes themselves (agents, a suite's incidents), stopped together when the worker
stops."""

from __future__ import annotations

import collections
import contextlib
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from recorder.background import start_quiet

TAIL_LINES = 20
TAIL_BYTES = 4000


class StderrTail:
    """Copy ``stream`` to this process's stderr in a thread; keep its last lines."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._lines: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)
        self._thread = threading.Thread(target=self._copy, name="deja-run-stderr",
                                        daemon=True)
        start_quiet(self._thread)  # the worker's stop signals reach its main thread

    def _copy(self) -> None:
        out = sys.stderr.buffer
        with self._stream:
            for line in iter(self._stream.readline, b""):
                self._lines.append(line)
                with contextlib.suppress(OSError, ValueError):  # the worker's own stderr
                    out.write(line)
                    out.flush()

    def text(self, timeout: float = 5.0) -> str:
        """The last lines, once the stream has ended (or ``timeout`` has passed)."""
        self._thread.join(timeout)
        text = b"".join(self._lines).decode("utf-8", "replace")
        return text[-TAIL_BYTES:]


class Children:
    """The child processes a worker runs: added as they start, taken away as they end,
    and stopped together (SIGTERM, then up to ``grace`` seconds for all of them to end)
    when the worker stops."""

    def __init__(self) -> None:
        self._running: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()

    def add(self, child: subprocess.Popen[bytes]) -> None:
        with self._lock:  # those that ended meanwhile go (a caller may not say)
            self._running = {c for c in self._running if c.poll() is None} | {child}

    def discard(self, child: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._running.discard(child)

    def stop(self, grace: float = 15.0) -> None:
        with self._lock:
            children = list(self._running)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(0.1, deadline - time.monotonic()))
