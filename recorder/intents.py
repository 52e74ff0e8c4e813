"""Side-effecting tools: intent before, outcome after, and settling the ones in between.

A tool declared ``@recorder.tool(side_effect=True, settle=check)`` writes an ``intent``
line, forced to disk, before its body runs and an ``outcome`` line after. Its body gets a
stable idempotency key (``<run id>:<seq of the intent>``): as its ``idempotency_key``
argument when it declares one, and from :func:`idempotency_key` in any case. Pass it to
the system the tool changes, so that doing the same thing twice is recognised there.

When a crashed run is resumed and its log ends with an intent but no outcome, the tool
may or may not have done its work. deja never guesses: it calls ``check(intent)``, which
looks at the outside world (by the idempotency key) and answers with
:meth:`Settled.done` (with the result to record), :meth:`Settled.not_done` (the tool runs
now, with the same key) or :meth:`Settled.unknown` (the run stops with status
``needs_attention`` and the reason). No settle function means unknown.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("deja_idempotency_key",
                                                                  default=None)


def idempotency_key() -> str | None:
    """The idempotency key of the side-effecting tool call running now, if any."""
    return _key.get()


@contextlib.contextmanager
def key_in_effect(key: str | None) -> Iterator[None]:
    """Make ``key`` what :func:`idempotency_key` returns while a tool's body runs."""
    token = _key.set(key)
    try:
        yield
    finally:
        _key.reset(token)


@dataclass(frozen=True)
class Intent:
    """A side-effecting call that was about to run when the log ends."""

    run: str
    seq: int
    name: str
    args: dict[str, Any]
    key: str


class Effect(enum.StrEnum):
    """Whether an intent's effect took place, as a settle function found out."""

    DONE = "done"
    NOT_DONE = "not_done"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Settled:
    """What a settle function found out about an intent."""

    state: Effect
    result: Any = None
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def done(cls, result: Any = None) -> Settled:
        """The effect happened; ``result`` is recorded as the tool's result."""
        return cls(Effect.DONE, result=result)

    @classmethod
    def not_done(cls) -> Settled:
        """The effect did not happen; run the tool now with the same key."""
        return cls(Effect.NOT_DONE)

    @classmethod
    def unknown(cls, reason: str) -> Settled:
        """It cannot be told; stop the run for a person to decide."""
        return cls(Effect.UNKNOWN, reason=reason)
