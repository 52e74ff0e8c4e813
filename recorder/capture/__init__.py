"""Capture: the seam between an agent's calls and the observation log.

- :mod:`.session`: a :class:`~recorder.capture.session.Session` and the one that is active;
  recording, replay, fork and resume are each one;
- :mod:`.vcr`: vcrpy's patchers, driven by the active session; :mod:`._httpx` is deja's
  own stub for the httpx transports;
- :mod:`.mcp`: the MCP SDK's transports and requests, driven by the active session;
- :mod:`.exchange`: one HTTP exchange as deja sees it, whichever client made it;
- :mod:`.redact`: what never reaches disk: the rules of a run and how they are applied;
  :mod:`._secrets` holds the built-in ones, what looks like a secret.

:func:`install` is what a session holds while it is active: every patch, put back when the
block ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recorder.capture.session import Session

__all__ = ["install"]


@contextlib.contextmanager
def install(session: Session) -> Iterator[None]:
    """Route every supported HTTP client and the MCP SDK through ``session`` while the
    block runs."""
    from recorder.capture import mcp, vcr

    with vcr.install(session), mcp.install(session):
        yield
