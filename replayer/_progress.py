"""A progress bar for a replay on a terminal: long replays are not silent.

``deja replay``, ``deja fork`` and ``deja resume`` serve the recorded steps inside the
program they run, so the bar lives there too, on the program's stderr, and only when
that is a terminal (piped or redirected output gets nothing, not even escape codes). It
is transient: it disappears once the recorded steps are served (a fork or a resume then
goes on live, without it). While it shows, what the program prints goes through rich's
console above the bar, so the two do not garble each other; stdout is routed that way only
when it is a terminal too, so a program whose stdout is piped keeps writing to its pipe.

The bar counts the recorded calls the replay serves (model and HTTP calls, tool calls,
effects, recorded harness stops) against those the cassette holds; it updates at most ten
times a second whatever the rate of steps.
"""

from __future__ import annotations

import os
import sys
import threading

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def _terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class ReplayProgress:
    """A transient bar: ``advance`` as calls are served, ``close`` when done."""

    def __init__(self, label: str, total: int) -> None:
        console = Console(file=sys.stderr, stderr=True)
        self._progress = Progress(
            TextColumn("[bold]deja[/] {task.description}"), BarColumn(bar_width=24),
            MofNCompleteColumn(), TextColumn("recorded calls served"), TimeElapsedColumn(),
            console=console, transient=True, refresh_per_second=10,
            redirect_stdout=_terminal(sys.stdout), redirect_stderr=True)
        self._task = self._progress.add_task(label, total=total)
        self._lock = threading.Lock()
        self._closed = False
        self._progress.start()

    @classmethod
    def on_terminal(cls, label: str, total: int) -> ReplayProgress | None:
        """A bar when stderr is a terminal that can draw one; else None."""
        if not _terminal(sys.stderr) or os.environ.get("TERM") == "dumb" or total <= 0:
            return None
        return cls(label, total)

    def update(self, served: int) -> None:
        with self._lock:
            if not self._closed:
                self._progress.update(self._task, completed=served)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._progress.stop()
