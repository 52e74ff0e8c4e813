"""Nondeterministic values as observations: clock, uuid, random, and your own.

Each function returns a live value while recording (and logs it) and the recorded value
while replaying; with no session active it just returns a live value. Use them wherever
the agent's behaviour depends on the value, so that a replay takes the same path::

    started = recorder.now()
    request_id = recorder.uuid4()
    temperature = recorder.value("temperature", lambda: read_sensor())
"""

from __future__ import annotations

import random as _random
import time
import uuid as _uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from . import session


def value(name: str, produce: Callable[[], Any] | Any) -> Any:
    """A custom value: ``produce()`` (or ``produce`` itself) live, the recorded one on replay."""
    make = produce if callable(produce) else (lambda: produce)
    current = session.active()
    if current is None:
        return make()
    return current.effect(name, make)


def now() -> float:
    """``time.time()``."""
    return float(value("time", time.time))


def utcnow() -> datetime:
    """The current time as an aware UTC datetime."""
    return datetime.fromtimestamp(now(), UTC)


def uuid4() -> _uuid.UUID:
    """A random UUID."""
    return _uuid.UUID(value("uuid", lambda: str(_uuid.uuid4())))


def random() -> float:
    """``random.random()``."""
    return float(value("random", _random.random))


def randint(a: int, b: int) -> int:
    """``random.randint(a, b)``."""
    return int(value("randint", lambda: _random.randint(a, b)))
