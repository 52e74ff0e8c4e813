"""Lines are written whole, even when a stop signal lands in the middle of one.

A stop signal becomes an exception raised by the signal handler wherever the main thread
happens to be (``deja.boot`` raises ``Interrupted``). Landing between a line's ``write``
and the writer's note of it (its signature, the next ``seq``), it would leave the file
ahead of the writer, and the next line (the run's end line) would be signed against the
wrong predecessor: a cassette that no longer verifies. So the writer marks the few
statements of each append as one section (:data:`WHOLE`), and a handler that calls
:func:`interrupt` while the main thread is inside one has its exception raised as the
section ends, when the line and the writer agree again.
"""

from __future__ import annotations

import threading
from types import TracebackType

_MAIN = threading.main_thread().ident


class _State:
    depth = 0
    pending: BaseException | None = None


_state = _State()


class _Whole:
    """``with WHOLE:``: a signal's exception waits for the end of the section."""

    __slots__ = ()

    def __enter__(self) -> None:
        if threading.get_ident() == _MAIN:
            _state.depth += 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if threading.get_ident() == _MAIN:
            _state.depth -= 1
            if not _state.depth and _state.pending is not None:
                pending, _state.pending = _state.pending, None
                raise pending from exc


WHOLE = _Whole()


def interrupt(exc: BaseException) -> None:
    """From a signal handler: raise ``exc`` now, or when the line being written is whole."""
    if _state.depth:
        _state.pending = exc
        return
    raise exc
