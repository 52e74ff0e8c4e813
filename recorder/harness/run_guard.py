"""The guards of one recorded run, applied at its boundaries: the session's first
interceptor (:class:`recorder.capture.sources.Interceptor`).

A recording session calls :meth:`RunGuard.before_call` before a request goes out,
:meth:`RunGuard.after_exchange` once it is logged, and :meth:`RunGuard.before_tool`
before a tool body runs. Every decision that refuses something is logged as a
``control`` line (through ``emit``) before its error is raised in the agent.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from recorder import providers
from recorder.capture.exchange import HttpRequest, upstream
from recorder.capture.redact import DEFAULT, Redaction
from recorder.capture.sources import Interceptor
from recorder.cassette.schema import Control, Kind
from recorder.errors import (
    BudgetExhausted,
    Cancelled,
    CircuitOpen,
    ConfigError,
    LoopDetected,
    RunStopped,
)
from recorder.harness.guards import BREAKERS, Clock, LoopWatch, MaxTokens, is_failure
from recorder.harness.progress import Progress, cancel_path, cancel_requested
from recorder.harness.settings import Settings

log = logging.getLogger("deja.recorder")

Emit = Callable[[str, dict[str, Any]], None]


class RunGuard(Interceptor):
    """Budgets, cancel, loop guard, circuit breaker and progress of one run."""

    def __init__(self, run: str, settings: Settings, emit: Emit, *, clock: Clock | None = None,
                 artefacts: list[str] | None = None, progress_interval: float = 0.2,
                 redaction: Redaction | None = None) -> None:
        self.run = run
        # Messages name the call (its URL may carry a secret in its query): redacted at the
        # source, so the agent sees the same text live as on replay.
        self.redaction = redaction or DEFAULT
        self.settings = settings
        self.budgets = settings.budgets
        self._emit = emit
        self._clock = clock or time.monotonic
        self._t0 = self._clock()
        self._lock = threading.Lock()
        self.loop = LoopWatch(settings.loop)
        self.turns = 0
        self.tokens = 0
        self.spend = 0.0
        self.stopped: RunStopped | None = None
        self._cancel_seen: dict[str, Any] | None = None
        self._cancel_file = cancel_path(run)
        self._cancel_checked = float("-inf")
        self._call_names: dict[tuple[bool, str, str], tuple[str, str, str]] = {}
        self._hosts: dict[str, str] = {}
        b = self.budgets
        self.progress = Progress(run, {
            "turn_limit": b.turns, "budget_s": b.seconds, "token_limit": b.tokens,
            "dollar_limit": b.dollars, "tokens": 0, "spend_usd": 0.0, "elapsed_s": 0.0,
            "artefacts": list(artefacts or [])}, interval=progress_interval,
            redaction=self.redaction)

    # -- counters carried over from a recorded prefix (resume, fork)

    def absorb(self, obs: Mapping[str, Any]) -> None:
        if obs.get("kind") == Kind.MODEL and 200 <= (obs.get("response") or {}).get("status", 0) \
                < 300:
            self.turns += 1
        if obs.get("kind") in (Kind.TOOL, Kind.INTENT) and "within" not in obs:
            self.loop.remember(obs["name"], obs.get("args"))
        usage = obs.get("usage") or {}
        self.tokens += usage.get("input_tokens", 0) + usage.get("output_tokens", 0)
        self.spend += obs.get("cost_usd") or 0.0

    def absorbed(self) -> None:
        """Publish the counters carried over from a recorded prefix."""
        self.progress.update(turn=self.turns, tokens=self.tokens,
                             spend_usd=round(self.spend, 6), step="replaying the recorded steps",
                             force=True)

    # -- decisions

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def _stop(self, exc: RunStopped, event: str) -> RunStopped:
        self._emit(event, {"reason": exc.reason, "message": str(exc), **exc.detail})
        if not isinstance(exc, CircuitOpen):
            self.stopped = exc
            self.progress.update(status=exc.end_status, step=str(exc), force=True)
        return exc

    CANCEL_POLL = 0.02  # seconds between looks at the flag file after writes

    def _look_for_cancel(self, *, always: bool) -> None:
        if self._cancel_seen is not None:
            return
        now = time.monotonic()
        if always or now - self._cancel_checked >= self.CANCEL_POLL:
            self._cancel_checked = now
            self._cancel_seen = cancel_requested(self.run, self._cancel_file)

    def _common(self, what: str) -> None:
        self._look_for_cancel(always=True)
        if self._cancel_seen is not None:
            reason = self._cancel_seen.get("reason") or "cancel requested"
            raise self._stop(Cancelled(
                f"run {self.run} was cancelled ({reason}); stopped before {what}",
                reason="cancelled", detail={"before": what, **self._cancel_seen}),
                Control.CANCELLED)
        b = self.budgets
        if b.seconds is not None and self.elapsed() >= b.seconds:
            raise self._budget("seconds", round(self.elapsed(), 3), b.seconds, what)

    def _budget(self, name: str, used: Any, limit: Any, what: str) -> RunStopped:
        return self._stop(BudgetExhausted(
            f"run {self.run}: {name} budget exhausted ({used} of {limit}); stopped before "
            f"{what}. Raise the budget (record(budgets=...), [tool.deja.budgets] or the "
            "--max-* flags) to let it run further", reason=f"{name}_budget",
            detail={"budget": name, "used": used, "limit": limit, "before": what}),
            Control.BUDGET_EXHAUSTED)

    _NAMES_KEPT = 512  # calls whose names are remembered (an agent calls a few URLs)

    def _names(self, request: HttpRequest, provider: str | None) -> tuple[str, str, str]:
        """How a call is named in messages (its URL redacted), its progress step and its
        upstream host: the same for every call of a URL, so worked out once."""
        key = (bool(provider), request.method, request.url)
        names = self._call_names.get(key)
        if names is None:
            what = (f"{'model' if provider else 'HTTP'} call {request.method} "
                    f"{self.redaction.url(request.url)}")
            names = (what, f"waiting for {what}", upstream(request.url))
            if len(self._call_names) >= self._NAMES_KEPT:
                self._call_names.clear()
            self._call_names[key] = names
        return names

    def host(self, url: str) -> str:
        """The upstream host of ``url`` (see :func:`upstream`), remembered per URL."""
        host = self._hosts.get(url)
        if host is None:
            if len(self._hosts) >= self._NAMES_KEPT:
                self._hosts.clear()
            host = self._hosts[url] = upstream(url)
        return host

    def before_call(self, request: HttpRequest, provider: str | None) -> None:
        """Before a request goes out: cancel, budgets, per-turn ceiling, circuit breaker."""
        what, step, host = self._names(request, provider)
        self._common(what)
        if provider:
            self._model_budgets(request, providers.get(provider), what)
        if self.settings.breaker.enabled:
            allowed, detail = BREAKERS.get(host, self.settings.breaker).allow()
            if not allowed:
                raise self._stop(CircuitOpen(
                    f"circuit open for {host}: too many failures in the last "
                    f"{self.settings.breaker.window:g}s; calls fail fast for "
                    f"{detail.get('retry_in_s')}s more (nothing was sent)",
                    reason="circuit_open", detail=detail), Control.CIRCUIT_OPEN)
        self.progress.update(step=step, elapsed_s=round(self.elapsed(), 3))

    def _model_budgets(self, request: HttpRequest, provider: providers.Provider,
                       what: str) -> None:
        b = self.budgets
        if b.turns is not None and self.turns >= b.turns:
            raise self._budget("turns", self.turns, b.turns, what)
        if b.tokens is not None and self.tokens >= b.tokens:
            raise self._budget("tokens", self.tokens, b.tokens, what)
        if b.dollars is not None and self.spend >= b.dollars:
            raise self._budget("dollars", round(self.spend, 6), b.dollars, what)
        if b.max_tokens is None and b.dollars is None:
            return
        try:
            body = json.loads(request.body)
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        model = provider.request_model(body, request.url)
        if b.dollars is not None and self.settings.prices.lookup(model) is None:
            raise ConfigError(
                f"run {self.run} has a dollar budget but no price for model "
                f"{model!r}; add it (record(prices=...) or [tool.deja.prices]) "
                "so that spending can be counted. Nothing was sent")
        asked = provider.request_max_tokens(body)
        if b.max_tokens is not None and isinstance(asked, int) and asked > b.max_tokens:
            if b.max_tokens_mode is MaxTokens.CLAMP:
                body = provider.with_max_tokens(body, b.max_tokens)
                request.original_body = request.body
                request.body = json.dumps(body, separators=(",", ":")).encode("utf-8")
                self._emit(Control.MAX_TOKENS_CLAMPED, {"asked": asked, "limit": b.max_tokens})
                return
            raise self._budget("max_tokens", asked, b.max_tokens, what)

    def after_exchange(self, request: HttpRequest, *, model: bool, status: int | None,
                       error: BaseException | None, usage: dict[str, Any] | None,
                       cost: float | None) -> None:
        if self.settings.breaker.enabled:
            BREAKERS.get(self.host(request.url), self.settings.breaker).record(
                is_failure(status, error))
        with self._lock:
            if model and status is not None and 200 <= status < 300:
                self.turns += 1
            usage = usage or {}
            self.tokens += usage.get("input_tokens", 0) + usage.get("output_tokens", 0)
            self.spend += cost or 0.0
        self.progress.update(turn=self.turns, tokens=self.tokens,
                             spend_usd=round(self.spend, 6),
                             elapsed_s=round(self.elapsed(), 3),
                             step=f"{'model' if model else 'HTTP'} response {status}")
        self.after_write()

    def before_tool(self, name: str, args: Any) -> None:
        what = f"tool {name}"
        self._common(what)
        loop = self.loop.check(name, args)
        if loop is not None:
            raise self._stop(LoopDetected(
                f"run {self.run}: tool {name} called with the same arguments "
                f"{loop.get('times', 2)} times within the last {loop['window']} tool calls "
                f"({loop['pattern']}); stopped before running it again",
                reason="loop_detected", detail=loop), Control.LOOP_DETECTED)
        self.progress.update(step=f"tool {name}({_short(args)})",
                             elapsed_s=round(self.elapsed(), 3))

    def after_write(self) -> None:
        """Cancel is read after writes too (at most every 20 ms: the read before the next
        call is what takes effect, this one only notices it sooner)."""
        self._look_for_cancel(always=False)

    def finish(self, end: dict[str, Any]) -> None:
        totals = end.get("totals") or {}
        self.progress.update(status=end.get("status"), step=f"ended: {end.get('status')}",
                             turn=self.turns, tokens=self.tokens, spend_usd=round(self.spend, 6),
                             elapsed_s=totals.get("duration_s", round(self.elapsed(), 3)),
                             totals=totals, ended=True, force=True)


def _short(args: Any, width: int = 60) -> str:
    text = json.dumps(args, ensure_ascii=False, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"
