"""A child process that dies with its parent, and a wait for it that signals interrupt.

On Linux a child gets a parent-death signal (SIGTERM) set between fork and exec, so that
a launcher or worker killed even with SIGKILL never leaves its program running unwatched.
:func:`wait` waits for it as ``Popen.wait`` does, except that a signal which lands just
before the wait starts is acted on at once, not when the child ends by itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
from collections.abc import Callable
from typing import Any, Protocol

_PR_SET_PDEATHSIG = 1


def _find_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up here, not in the child: between fork and exec only the call itself is safe.
_PRCTL = _find_prctl()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def preexec() -> Callable[[], None] | None:
    """The ``preexec_fn`` for ``subprocess.Popen`` (None where there is no such signal)."""
    return _die_with_parent if _PRCTL is not None else None


class Waitable(Protocol):
    pid: int

    def poll(self) -> int | None: ...

    def wait(self) -> int: ...


def wait(child: Waitable) -> int:
    """``child.wait()``, during which the handlers of our signals run as they land.

    A plain ``waitpid`` sleeps through a signal that lands after the interpreter last
    looked for one and before the call starts (CPython runs a handler between bytecodes,
    and a blocking call wakes only for a signal that lands inside it): a SIGTERM to a
    launcher would reach its program only once the program had ended by itself. Here the
    wait is a ``poll`` of the child's pidfd and of the interpreter's signal wakeup
    descriptor, to which every signal writes a byte whenever it lands. Without pidfds
    (before Linux 5.3, other systems) or outside the main thread: ``child.wait()``.
    """
    opened: list[int] = []
    previous: int | None = None
    try:
        try:
            opened.append(os.pidfd_open(child.pid))
        except (AttributeError, OSError):
            return child.wait()
        opened.extend(os.pipe())
        pidfd, wake_r, wake_w = opened
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        try:
            previous = -1  # until set_wakeup_fd returns, what was there is not known
            previous = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            previous = None
            return child.wait()
        poller = select.poll()  # not select(): it refuses a descriptor numbered >= 1024
        poller.register(pidfd, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        while (code := child.poll()) is None:
            poller.poll()
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 256):
                    pass
        return code
    finally:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        for fd in opened:
            os.close(fd)
