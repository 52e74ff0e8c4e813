"""What ``deja ls`` and ``deja view`` print while they bring the index up to date.

Indexing a folder of many runs for the first time takes a while, and a command that
says nothing meanwhile looks hung. :func:`indexing_progress` gives
:meth:`viewer.index.RunIndex.refresh` a callback that draws a progress bar on stderr, but
only when stderr is a terminal and there are at least ``min_files`` files to read: piped
or redirected output (a script, CI) stays exactly what it was.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from viewer.index import Progress

MIN_FILES = 20  # fewer files are indexed faster than a bar can be read


@contextmanager
def indexing_progress(stream: IO[str] | None = None, *, min_files: int = MIN_FILES
                      ) -> Iterator[Progress]:
    """A ``progress(done, total)`` callback for ``RunIndex.refresh``; the bar (if one was
    drawn) is closed when the block ends."""
    out = stream if stream is not None else sys.stderr
    state: dict[str, Any] = {}

    def progress(done: int, total: int) -> None:
        if "bar" not in state:
            if total < min_files or not _is_terminal(out):
                state["bar"] = None
            else:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

                bar = Progress(TextColumn("indexing cassettes"), BarColumn(),
                               MofNCompleteColumn(), console=Console(file=out), transient=True)
                bar.start()
                state["bar"], state["task"] = bar, bar.add_task("index", total=total)
        if state["bar"] is not None:
            state["bar"].update(state["task"], completed=done, total=total)

    try:
        yield progress
    finally:
        if state.get("bar") is not None:
            state["bar"].stop()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
