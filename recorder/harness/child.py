"""A child process that dies with its parent: on Linux, a parent-death signal (SIGTERM)
set between fork and exec, so that a launcher or worker killed even with SIGKILL never
leaves its program running unwatched."""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable
from typing import Any

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
