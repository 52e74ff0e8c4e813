"""The harness guards: budgets, the loop guard and the circuit breaker.

They decide between observations, before the next call goes out; the model cannot
override them. Each decision that stops something is written to the log as a ``control``
observation before the error reaches the agent, so a replay reproduces it exactly.

- **Budgets** (:class:`Budgets`): model turns, cumulative tokens (input + output), a
  per-turn ``max_tokens`` ceiling (a request asking for more is refused, or clamped),
  wall-clock seconds and dollars. Crossing one ends the run ``exhausted`` at the next
  boundary: at most the one call in flight overshoots.
- **Loop guard** (:class:`LoopSettings`): the same tool call (name and arguments, key order
  ignored) ``repeats`` times within the last ``window`` tool calls, or an A-B-A-B
  alternation, stops the run with :class:`LoopDetected` before the call runs.
- **Circuit breaker** (:class:`Breaker`): per upstream host, shared by every run in the
  process. ``failures`` failures within ``window`` seconds open it; while open, calls
  fail fast with :class:`CircuitOpen` and nothing is sent; after ``cooldown`` seconds one
  probe goes through and its success closes it. Every HTTP attempt counts, SDK retries
  included (each is a request the failing upstream had to take, and counting them is
  what stops a retry storm); every attempt is recorded either way. Failures are
  transport errors, 5xx, 408 and 429; other 4xx are the caller's mistakes and do not
  count.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from recorder.canonical import digest
from recorder.errors import ConfigError

Clock = Callable[[], float]


def _number(name: str, value: Any, *, integer: bool) -> float | int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"budget {name} must be a number, not {value!r}")
    if value < 0:
        raise ConfigError(f"budget {name} must not be negative (got {value}); leave it unset "
                          "for no limit")
    if integer and int(value) != value:
        raise ConfigError(f"budget {name} must be a whole number (got {value})")
    return int(value) if integer else float(value)


class MaxTokens(enum.StrEnum):
    """What a request asking for more than the ``max_tokens`` budget gets."""

    REFUSE = "refuse"  # stopped before it goes out
    CLAMP = "clamp"  # sent with max_tokens lowered to the budget


@dataclass(frozen=True)
class Budgets:
    """Limits of one run; ``None`` means no limit."""

    turns: int | None = None
    tokens: int | None = None
    max_tokens: int | None = None
    max_tokens_mode: MaxTokens = MaxTokens.REFUSE
    seconds: float | None = None
    dollars: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "max_tokens_mode":
                continue
            value = _number(f.name, getattr(self, f.name), integer=f.name != "seconds"
                            and f.name != "dollars")
            object.__setattr__(self, f.name, value)
        try:
            object.__setattr__(self, "max_tokens_mode", MaxTokens(self.max_tokens_mode))
        except ValueError:
            raise ConfigError(f"max_tokens_mode must be 'refuse' or 'clamp', not "
                              f"{self.max_tokens_mode!r}") from None

    @classmethod
    def of(cls, value: Budgets | Mapping[str, Any] | None) -> Budgets:
        if value is None:
            return cls()
        if isinstance(value, Budgets):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"budgets must be a table of limits, not {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown budget(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(known))}")
        return cls(**value)

    def merged(self, **overrides: Any) -> Budgets:
        data = asdict(self)
        data.update({k: v for k, v in overrides.items() if v is not None})
        return Budgets(**data)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class LoopSettings:
    """Stop a run that keeps making the same tool call."""

    repeats: int = 3
    window: int = 5
    alternation: bool = True
    enabled: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.repeats, int) and self.repeats >= 2):
            raise ConfigError(f"loop guard repeats must be an integer >= 2, not {self.repeats!r}")
        if not (isinstance(self.window, int) and self.window >= self.repeats):
            raise ConfigError(f"loop guard window must be an integer >= repeats "
                              f"({self.repeats}), not {self.window!r}")

    @classmethod
    def of(cls, value: LoopSettings | Mapping[str, Any] | bool | None) -> LoopSettings:
        return _settings(cls, value, "loop guard")


class LoopWatch:
    """The recent tool calls of one run, checked before each new one."""

    def __init__(self, guard: LoopSettings) -> None:
        self.guard = guard
        self._recent: deque[str] = deque(maxlen=guard.window)

    @staticmethod
    def call_hash(name: str, args: Any) -> str:
        return digest(["tool", name, args])

    def remember(self, name: str, args: Any) -> None:
        """A call made before (a resumed run's history), not checked."""
        self._recent.append(self.call_hash(name, args))

    def check(self, name: str, args: Any) -> dict[str, Any] | None:
        """The loop this call would make, or None; the call is remembered either way."""
        if not self.guard.enabled:
            return None
        h = self.call_hash(name, args)
        recent = [*self._recent, h]
        self._recent.append(h)
        count = recent[-self.guard.window:].count(h)  # this call and window - 1
        if count >= self.guard.repeats:
            return {"pattern": "repeat", "tool": name, "args": args, "times": count,
                    "window": self.guard.window}
        if self.guard.alternation and len(recent) >= 4:
            a, b, c, d = recent[-4:]
            if a == c and b == d and a != b:
                return {"pattern": "alternation", "tool": name, "args": args,
                        "window": self.guard.window}
        return None


@dataclass(frozen=True)
class BreakerSettings:
    failures: int = 5
    window: float = 60.0
    cooldown: float = 30.0
    enabled: bool = True

    def __post_init__(self) -> None:
        for name in ("failures", "window", "cooldown"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"circuit breaker {name} must be a number, not {value!r}")
        if not (self.failures >= 1 and self.window > 0 and self.cooldown >= 0):
            raise ConfigError("circuit breaker: failures >= 1, window > 0, cooldown >= 0")

    @classmethod
    def of(cls, value: BreakerSettings | Mapping[str, Any] | bool | None) -> BreakerSettings:
        return _settings(cls, value, "circuit breaker")


def _settings(cls: Any, value: Any, what: str) -> Any:
    """Settings from True/None (defaults), False (off), an instance, or a table."""
    if value is None or value is True:
        return cls()
    if value is False:
        return cls(enabled=False)
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} settings must be a table, not {value!r}")
    try:
        return cls(**value)
    except TypeError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def is_failure(status: int | None, error: BaseException | None) -> bool:
    """Does this outcome count against the upstream?"""
    if error is not None and status is None:
        return True
    if status is None:
        return False
    return status >= 500 or status in (408, 429)


class BreakerState(enum.StrEnum):
    """Where a circuit breaker is: calls go out, fail fast, or one probe goes out."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    """The circuit breaker of one upstream host. Thread-safe."""

    def __init__(self, host: str, settings: BreakerSettings, clock: Clock) -> None:
        self.host = host
        self.settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: deque[float] = deque()
        self.state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._probe_out = False

    def allow(self) -> tuple[bool, dict[str, Any]]:
        """May a request go out now? (False, detail) while open."""
        with self._lock:
            now = self._clock()
            if self.state is BreakerState.OPEN:
                if now - self._opened_at >= self.settings.cooldown:
                    self.state = BreakerState.HALF_OPEN
                    self._probe_out = False
                else:
                    return False, self._detail(now)
            if self.state is BreakerState.HALF_OPEN:
                if self._probe_out:
                    return False, self._detail(now)
                self._probe_out = True
                return True, {"probe": True}
            return True, {}

    def record(self, failed: bool) -> None:
        with self._lock:
            now = self._clock()
            if self.state is BreakerState.HALF_OPEN:
                self._probe_out = False
                if failed:
                    self.state, self._opened_at = BreakerState.OPEN, now
                else:
                    self.state = BreakerState.CLOSED
                    self._failures.clear()
                return
            if not failed:
                return
            self._failures.append(now)
            while self._failures and now - self._failures[0] > self.settings.window:
                self._failures.popleft()
            if len(self._failures) >= self.settings.failures and self.state is BreakerState.CLOSED:
                self.state, self._opened_at = BreakerState.OPEN, now

    def _detail(self, now: float) -> dict[str, Any]:
        return {"host": self.host, "state": self.state,
                "retry_in_s": round(max(0.0, self.settings.cooldown - (now - self._opened_at)),
                                    3)}


class Breakers:
    """Every host's breaker in this process, shared by all runs."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._by_host: dict[str, Breaker] = {}

    def get(self, host: str, settings: BreakerSettings) -> Breaker:
        with self._lock:
            breaker = self._by_host.get(host)
            if breaker is None:
                breaker = Breaker(host, settings, lambda: self.clock())
                self._by_host[host] = breaker
            elif breaker.settings != settings:
                breaker.settings = settings  # the last run's settings apply; the state stays
            return breaker

    def reset(self) -> None:
        with self._lock:
            self._by_host.clear()


BREAKERS = Breakers()
