"""The seam between capture and storage: a Session, and the one that is active.

Capture code (HTTP patchers, ``@tool``, effects) knows nothing about cassettes. It asks the
active session what to do: :class:`recorder.record.RecordSession` lets the call go out and
logs what came back; a replay session (in ``replayer``) serves it from the log. One
session is active per process; its HTTP patches are installed while it is active.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from recorder.capture.exchange import HttpRequest, HttpResponse
from recorder.errors import SessionError

if TYPE_CHECKING:
    from recorder.record import RecordSession

log = logging.getLogger("deja.recorder")


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
    #: A call may be answered from a log (a replay, a fork's or a resume's prefix): a
    #: request is read whole before it is answered, never left for the log to read later.
    consults_log: bool = False

    def recorder(self) -> RecordSession | None:
        """The recording that writes this run's log, if any (a fork's, even while it still
        serves its prefix)."""
        return None

    def writing_live(self) -> bool:
        """Whether a call that reaches the session now goes out live and is logged."""
        return False

    @abc.abstractmethod
    def begin_http(self, request: HttpRequest) -> HttpResponse | None:
        """Before a request goes out: a response to serve instead, or None to send it."""

    @abc.abstractmethod
    def end_http(self, request: HttpRequest, response: HttpResponse | None, timing: Timing,
                 error: BaseException | None = None) -> Any:
        """After a live exchange completed (or failed with ``error``); returns what was
        logged, if anything."""

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


def mode() -> str | None:
    """What deja is doing with this process: ``"record"``, ``"replay"``, ``"fork"`` (its
    replayed prefix and its live part alike) or ``"resume"``; None when no session is
    active. A tool with side effects can ask it before acting; a program ``deja`` launched
    also finds it in ``DEJA_MODE``."""
    return _active.mode if _active is not None else None


_stopping = threading.Event()


def mark_stopping() -> None:
    """A signal is stopping this process (``deja.boot``): an exchange whose response is
    cut from here on is not logged, so a resume sends it again instead of serving a
    truncated body as if the model had said it."""
    _stopping.set()


def stopping() -> bool:
    return _stopping.is_set()


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


S = TypeVar("S", bound=Session)
F = TypeVar("F", bound=Callable[..., Any])  # a decorated function keeps its type


class Scope(contextlib.ContextDecorator, Generic[S]):
    """A session around a block or a decorated function (sync or async).

    What ``record()``, ``replay()``, ``fork()`` and ``resume()`` return: each gives how its
    session is opened and how it is closed, and the scope does the rest. ``close`` gets the
    session and the block's exception and returns the scope's :attr:`result`; ``check``, if
    given, then looks at that result and may raise (a replay's divergence), so that the
    result is kept either way. With ``join=True`` a block entered while another session is
    active (``deja record`` around a program that calls ``record()`` itself) uses that
    session and closes nothing; otherwise it is a :class:`SessionError`.

    Each decorated call gets a scope of its own, so concurrent calls of an async function do
    not share a session.
    """

    def __init__(self, open: Callable[[], S], close: Callable[[S, BaseException | None], Any],
                 *, check: Callable[[S, Any, BaseException | None], None] | None = None,
                 join: bool = False, name: str = "session") -> None:
        self._open, self._close, self._check = open, close, check
        self._join, self._name = join, name
        self._stack: list[S | None] = []
        self.session: S | None = None  # the session of the last block entered
        self.result: Any = None  # what closing it returned

    def __enter__(self) -> S:
        current = active()
        if current is not None:
            if not self._join:
                raise SessionError(f"{self._name}: a {current.mode} session is already active "
                                   f"({current.path}); deja runs one session per process")
            log.info("%s: a %s session is already active; using it", self._name, current.mode)
            self._stack.append(None)
            # joining: the outer session serves, whatever its class (see ``join``)
            return current  # type: ignore[return-value]
        self.session = self._open()
        self._stack.append(self.session)
        return self.session

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        opened = self._stack.pop()
        if opened is None:
            return
        self.result = self._close(opened, exc)
        if self._check is not None:
            self._check(opened, self.result, exc)

    def _recreate_cm(self) -> Scope[S]:
        fresh = copy.copy(self)
        fresh._stack = []
        return fresh

    def __call__(self, func: F) -> F:
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                with self._recreate_cm():
                    return await func(*args, **kwargs)
            return cast(F, wrapper)
        return super().__call__(func)

