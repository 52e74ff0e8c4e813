"""Who answers a call is data: the sources a session asks, and the interceptors that watch.

A recording session may hold an ordered list of **sources**. Every HTTP exchange, tool call
and effect is offered to the open sources in turn; the first that answers serves it, and a
call that none answers goes out live (the request is sent, the tool's body runs, the value
is produced) and is logged. What each kind of session is, in these terms:

===========================  =====================================================
record                       no source: every call live, logged
replay                       the log alone (:class:`replayer.replay.ReplaySession`):
                             a call it cannot answer is a ``Divergence``
fork, resume                 the recorded prefix while it lasts, then live, logged
fork ``--then-replay``       the prefix, then another run's log, copied as if live
replay, then live            the log while the program asks what it asked before,
                             copied; at the first miss it closes and calls go live
===========================  =====================================================

A source that :attr:`Source.copies` serves calls *as if live*: the interceptors see them
and the session logs them into its own cassette. A source that does not copy is a replayed
prefix: its steps are in the cassette already and the guards absorbed them at the start.

**Interceptors** see every live (or copied) call before it is answered and every exchange
after it: the run's guard (budgets, the loop guard, the breaker, cancel) is the first; a
tool policy or injected faults are further ones. An interceptor stops a run by raising.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recorder.capture.exchange import HttpRequest, HttpResponse
    from recorder.capture.session import ToolSpec
    from recorder.effects import Site

__all__ = ["Action", "Decision", "Interceptor", "Source"]


class Action(enum.StrEnum):
    """What happens to a tool call a source is asked to answer."""

    ANSWER = "answer"  # answered from the log: the body does not run
    RUN = "run"  # the body runs live (with ``key``: an intent's, found not done)
    SETTLE = "settle"  # the log ends inside this side effect (``intent``): settle it first


@dataclass(frozen=True)
class Decision:
    """The answer a session's sources give to a tool call."""

    action: Action
    value: Any = None  # ANSWER: the tool's result
    intent: Mapping[str, Any] | None = None  # SETTLE: the intent line with no outcome
    key: tuple[int, str] | None = None  # RUN: the (seq, key) of the intent it settles

    @classmethod
    def answer(cls, value: Any) -> Decision:
        return cls(Action.ANSWER, value=value)

    @classmethod
    def run(cls, key: tuple[int, str] | None = None) -> Decision:
        return cls(Action.RUN, key=key)

    @classmethod
    def settle(cls, intent: Mapping[str, Any]) -> Decision:
        return cls(Action.SETTLE, intent=intent)


class Source(abc.ABC):
    """Something that answers calls from recorded observations (a cassette's log)."""

    #: Serve calls as if live: seen by the interceptors and logged by the session.
    copies: bool = False
    #: A call it cannot answer is passed on to the next source (and the source closes)
    #: instead of raising ``Divergence``.
    passes: bool = False

    @property
    @abc.abstractmethod
    def open(self) -> bool:
        """Whether it still answers: a prefix closes once every step was served, a log
        that passes on a miss closes at its first miss."""

    @abc.abstractmethod
    def answer_http(self, request: HttpRequest) -> Mapping[str, Any] | None:
        """The observation that answers ``request``; None passes it on (the source closes);
        a source that does not pass raises ``Divergence``."""

    @abc.abstractmethod
    def answer_tool(self, tool: ToolSpec, args: dict[str, Any]) -> Mapping[str, Any] | None:
        """The ``tool`` or ``intent`` line that answers the call, as :meth:`answer_http`."""

    @abc.abstractmethod
    def answer_effect(self, name: str, site: Site | None) -> Mapping[str, Any] | None:
        """The ``effect`` line that answers ``name`` asked for at ``site``."""

    # -- what an answer means

    @abc.abstractmethod
    def response_of(self, obs: Mapping[str, Any]) -> HttpResponse:
        """The response an ``http`` or ``model`` line serves (its recorded error marked)."""

    @abc.abstractmethod
    def tool_value(self, tool: ToolSpec, obs: Mapping[str, Any]) -> Any:
        """The value a tool line returned, or its recorded error, raised again."""

    @abc.abstractmethod
    def effect_value(self, obs: Mapping[str, Any]) -> Any:
        """The value of an effect line, or the refusal it recorded, raised again."""

    @abc.abstractmethod
    def outcome_of(self, intent: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The outcome line of a side effect's intent, if the log holds one."""

    @abc.abstractmethod
    def unsettled(self, tool: ToolSpec, intent: Mapping[str, Any]) -> Exception:
        """The error of a call that reaches a side effect the log ended inside."""

    @abc.abstractmethod
    def request_body(self, seq: int) -> Any:
        """The request body a model line at ``seq`` was sent with (to copy the line)."""


class Interceptor(abc.ABC):
    """Sees each live or copied call before it is answered, and each exchange after it."""

    @abc.abstractmethod
    def before_call(self, request: HttpRequest, provider: str | None) -> None:
        """Before a request is answered; raise to stop the run."""

    @abc.abstractmethod
    def after_exchange(self, request: HttpRequest, *, model: bool, status: int | None,
                       error: BaseException | None, usage: dict[str, Any] | None,
                       cost: float | None) -> None:
        """After a live exchange was logged, with what it cost."""

    @abc.abstractmethod
    def before_tool(self, name: str, args: Any) -> None:
        """Before a tool call is answered (``args`` as the log keys them); raise to stop."""
