"""What a run's ``deja record``/``deja resume`` writes to stderr: passed on to the worker's
own stderr as it comes, line by line, and its last lines kept, so that a run that fails
says why in its record and in its failure alert (the program's traceback, deja's
message), not only in a log on the worker's machine."""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from typing import IO

TAIL_LINES = 20
TAIL_BYTES = 4000


class StderrTail:
    """Copy ``stream`` to this process's stderr in a thread; keep its last lines."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._lines: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)
        self._thread = threading.Thread(target=self._copy, name="deja-run-stderr",
                                        daemon=True)
        self._thread.start()

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
