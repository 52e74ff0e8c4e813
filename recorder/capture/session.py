"""The seam between capture and storage: a Session, and the one that is active.

Capture code (HTTP patchers, ``@tool``, effects) knows nothing about cassettes. It asks the
active session what to do: :class:`recorder.record.RecordSession` lets the call go out and
logs what came back; a replay session (in ``replayer``) serves it from the log. One
session is active per process; its HTTP patches are installed while it is active.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recorder.capture.exchange import HttpRequest, HttpResponse
from recorder.errors import SessionError


@dataclass(frozen=True)
class ToolSpec:
    """A tool as ``@recorder.tool`` declared it."""

    name: str
    encode: Callable[[Any], Any] | None = None
    decode: Callable[[Any], Any] | None = None
    side_effect: bool = False
    settle: Callable[[Any], Any] | None = None
    takes_key: bool = False  # the function declares an ``idempotency_key`` parameter


@dataclass(frozen=True)
class Timing:
    """When a call started (epoch seconds), how long it took, and time to first byte."""

    start: float
    ms: float
    ttfb_ms: float | None = None


class Session(abc.ABC):
    """What the capture layer talks to."""

    mode: str
    path: Path

    @abc.abstractmethod
    def begin_http(self, request: HttpRequest) -> HttpResponse | None:
        """Before a request goes out: a response to serve instead, or None to send it."""

    @abc.abstractmethod
    def end_http(self, request: HttpRequest, response: HttpResponse | None, timing: Timing,
                 error: BaseException | None = None) -> None:
        """After a live exchange completed (or failed with ``error``)."""

    @abc.abstractmethod
    def call_tool(self, tool: ToolSpec, args: dict[str, Any],
                  run: Callable[[str | None], Any]) -> Any:
        """Run (or serve) a synchronous tool call; ``run(idempotency_key)`` runs its body."""

    @abc.abstractmethod
    async def call_tool_async(self, tool: ToolSpec, args: dict[str, Any],
                              run: Callable[[str | None], Any]) -> Any:
        """Run (or serve) an asynchronous tool call; ``run(key)`` returns an awaitable."""

    @abc.abstractmethod
    def effect(self, name: str, produce: Callable[[], Any]) -> Any:
        """A nondeterministic value: produced and logged, or served from the log."""


_lock = threading.Lock()
_active: Session | None = None


def active() -> Session | None:
    """The session of this process, if one is recording or replaying."""
    return _active


def activate(session: Session) -> None:
    global _active
    with _lock:
        if _active is not None:
            raise SessionError(f"a {_active.mode} session is already active ({_active.path}); "
                               "deja runs one session per process")
        _active = session


def deactivate(session: Session) -> None:
    global _active
    with _lock:
        if _active is session:
            _active = None
