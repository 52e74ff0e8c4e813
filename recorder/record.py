"""Recording a run: ``record(...)`` and the session that writes the observation log.

::

    import recorder

    with recorder.record("cassettes/") as run:      # a directory: <run id>.jsonl inside
        agent()                                      # model, HTTP, tool and effect calls logged
    print(run.path, run.totals)

``record`` works as a decorator too, on sync and async functions.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from recorder import capture, effects
from recorder.canonical import digest
from recorder.capture import mcp, session
from recorder.capture.exchange import HttpRequest, HttpResponse, Redaction
from recorder.capture.sources import Interceptor
from recorder.cassette import CassetteWriter, Fsync, compact
from recorder.cassette.keys import Keyring, load_keyring, require_signing_key
from recorder.cassette.schema import (
    Control,
    EndStatus,
    Kind,
    Totals,
    add_step,
    run_file,
    utc_stamp,
    zero_totals,
)
from recorder.errors import NeedsAttention, RunStopped, SessionError
from recorder.harness.guards import BreakerSettings, Budgets, Clock, LoopSettings
from recorder.harness.run_guard import RunGuard
from recorder.harness.settings import resolve as resolve_settings
from recorder.launch import _versions, new_run_id, portable_launch
from recorder.providers import model_provider
from recorder.step_lines import StepLines

log = logging.getLogger("deja.recorder")

# The tool call whose body is running. Observations made inside a tool's body are marked
# ``within`` it: a replay serves the tool whole and never asks for them.
_within: contextvars.ContextVar[str | None] = contextvars.ContextVar("deja_within", default=None)


def current_body() -> str | None:
    """The tool call whose body is running here (``name#n``), if any: what the lines made
    inside it are marked ``within``."""
    return _within.get()


def status_for(error: BaseException | None) -> str:
    """The end status of a run that stopped with ``error`` (None: it completed)."""
    if error is None:
        return EndStatus.COMPLETED
    if isinstance(error, RunStopped):
        return error.end_status
    if isinstance(error, KeyboardInterrupt):
        return EndStatus.INTERRUPTED
    return EndStatus.ERROR


@dataclasses.dataclass
class _ToolCall:
    key: str | None
    result: Any = None


class RecordSession(session.Session, mcp.McpSeam):
    """Writes every observation of one run to its cassette as it happens."""

    mode = "record"

    def __init__(self, path: str | Path, *, labels: dict[str, Any] | None = None,
                 fsync: Fsync | str | None = None, redact_headers: tuple[str, ...] = (),
                 redact_body: tuple[str, ...] = (), redact_patterns: tuple[str, ...] = (),
                 redact_query: tuple[str, ...] = (), redaction: Redaction | None = None,
                 prices: dict[str, Any] | None = None,
                 argv: list[str] | None = None, entry: str | None = None,
                 overwrite: bool = False, keyring: Keyring | None = None,
                 run_id: str | None = None, parent: dict[str, Any] | None = None,
                 writer: CassetteWriter | None = None,
                 budgets: Budgets | dict[str, Any] | None = None,
                 loop_guard: LoopSettings | dict[str, Any] | bool | None = None,
                 breaker: BreakerSettings | dict[str, Any] | bool | None = None,
                 clock: Clock | None = None, progress_interval: float = 0.2,
                 header: dict[str, Any] | None = None,
                 interceptors: tuple[Interceptor, ...] = ()) -> None:
        self.run_id = run_id or new_run_id()
        self.path = run_file(path, self.run_id)
        self.settings = resolve_settings(
            budgets=budgets, loop_guard=loop_guard, breaker=breaker, prices=prices, fsync=fsync,
            redact_headers=redact_headers, redact_body=redact_body,
            redact_patterns=redact_patterns, redact_query=redact_query)
        self.fsync = Fsync.parse(self.settings.fsync or Fsync.TURN)
        self.labels = dict(labels or {})
        # ``redaction`` (a continued run's recorded rules) replaces the resolved ones whole
        self.redaction = redaction or self.settings.redaction
        self.prices = self.settings.prices
        self._clock = clock
        self._progress_interval = progress_interval
        self.guard: RunGuard | None = None
        # Who sees each live call before and after it: the run's guard first (at start).
        self.interceptors: tuple[Interceptor, ...] = tuple(interceptors)
        self._argv = list(argv if argv is not None else [sys.executable, *sys.argv])
        self._entry = entry
        self._overwrite = overwrite
        self._keyring = keyring
        self._header = dict(header or {})  # more header fields (a proxied run's proxy)
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.totals: Totals = zero_totals()  # counted as a cassette's steps are: add_step
        self.writer: CassetteWriter | None = writer
        self.parent = parent
        self.end: dict[str, Any] | None = None
        self._patches: contextlib.ExitStack | None = None
        self._tool_calls = itertools.count()
        self._opened: set[str] = set()  # the tool calls lines were made inside (``within``)
        # the NeedsAttention this session raised: the run ends so even if the program
        # catches one, and a tool body it went through is left under way, with no line
        self._attention: list[NeedsAttention] = []
        self._compactor = compact.Compactor()
        self._lines = StepLines(self.redaction, self.prices)

    def recorder(self) -> RecordSession:
        return self

    def writing_live(self) -> bool:
        return True

    # -- lifecycle

    def start(self, *, intercept: bool = True) -> RecordSession:
        """Open the cassette and the guards. With ``intercept`` (the default) the session
        becomes the process's active one and its HTTP patches are installed; without it
        (the recording proxy, which runs many sessions at once) calls reach it only through
        :meth:`begin_http`, :meth:`end_http` and :meth:`observe_tool`."""
        if self.writer is None:
            self.writer = self._new_writer()
        self.guard = RunGuard(self.run_id, self.settings, self.log_control, clock=self._clock,
                              artefacts=[str(self.path)],
                              progress_interval=self._progress_interval,
                              redaction=self.redaction)
        self.interceptors = (self.guard, *self.interceptors)
        if not intercept:
            log.info("recording run %s to %s", self.run_id, self.path)
            return self
        session.activate(self)
        try:
            stack = contextlib.ExitStack()
            stack.enter_context(capture.install(self))
            self._patches = stack
        except BaseException:
            session.deactivate(self)
            raise
        log.info("recording run %s to %s", self.run_id, self.path)
        return self

    def _new_writer(self) -> CassetteWriter:
        ring = self._keyring or load_keyring()
        header = {
            "run": self.run_id, "parent": self.parent,
            "created": utc_stamp(),
            **self._launch(), "versions": dict(_versions()),
            "labels": self.redaction.value(dict(self.labels)),  # names count: ci_token=...
            **self.settings.to_header(),
            "fsync": self.fsync.value, "redact": self.redaction.to_header(),
            **self.redaction.value(self._header),
        }
        return CassetteWriter(self.path, header, require_signing_key(ring), self.fsync,
                              overwrite=self._overwrite)

    def _launch(self) -> dict[str, Any]:
        """How to re-launch the run, with secrets out of the command (``--api-key X``, a
        key-shaped argument, a URL with a password) and the directory."""
        launch = portable_launch(self._argv, Path.cwd(), self.path)
        return {"argv": self.redaction.argv(launch["argv"]),
                "cwd": self.redaction.text(launch["cwd"]),
                "cassette": launch["cassette"] and self.redaction.text(launch["cassette"]),
                "entry": self.redaction.text(self._entry) if self._entry else self._entry}

    def end_line(self, status: str | None = None,
                 error: BaseException | None = None) -> dict[str, Any]:
        """The end line this run would close with now (``status`` follows from ``error``)."""
        assert self.writer is not None
        with self._lock:
            totals = dict(self.totals, cost_usd=round(self.totals["cost_usd"], 8),
                          duration_s=round(time.perf_counter() - self._t0, 3),
                          observations=self.writer.next_seq)
        stopped = self.guard.stopped if self.guard is not None else None
        stopped = stopped or (self._attention[0] if self._attention else None)
        if error is None and stopped is not None:
            error = stopped  # the agent caught the harness's error, but the run is over
        if status is None and self.writer.failed is not None:
            status = EndStatus.INTERRUPTED  # stopped by the disk, not by the run: it resumes
            error = error or self.writer.failed
        end: dict[str, Any] = {"status": status or status_for(error), "totals": totals}
        if error is not None:
            end["error"] = self._lines.error(error)
            if isinstance(error, RunStopped):
                end["reason"] = error.reason
        return end

    def log_control(self, event: str, detail: dict[str, Any]) -> None:
        """Log a control event (a guard's decision, a fork's edit, a resume), forced to
        disk before the run goes on."""
        self.append_line({"kind": Kind.CONTROL.value, "event": event, "detail": detail},
                         sync=True)

    def _stop(self) -> None:
        try:
            if self._patches is not None:
                self._patches.close()
                self._patches = None
        finally:
            session.deactivate(self)

    def close(self, status: str | None = None, error: BaseException | None = None) -> dict:
        """Write the end line with status and totals; remove the patches.

        Without ``status``, it follows from ``error`` (see :func:`status_for`).
        """
        if self.end is not None:
            return self.end
        self._stop()
        assert self.writer is not None
        self.end = self.writer.close(self.end_line(status, error))
        if self.guard is not None:
            self.guard.finish(self.end)
        return self.end

    def hand_over(self, error: BaseException | None = None) -> dict[str, Any]:
        """Stop without writing the end line; return it for the launching process to write.

        ``deja record`` uses this: only the parent knows the program's exit status.
        """
        end = self.end_line(None, error)
        self.abandon()
        if self.guard is not None:
            self.guard.finish(end)
        return end

    def abandon(self) -> None:
        """Stop without an end line, leaving the cassette resumable."""
        self._stop()
        if self.writer is not None:
            self.writer.abandon()

    # -- the capture seam

    def _check_writable(self) -> None:
        """After a failed write nothing more goes out: its result could not be logged."""
        if self.writer is not None and self.writer.failed is not None:
            raise self.writer.failed

    def begin_http(self, request: HttpRequest) -> HttpResponse | None:
        if mcp.carries(request.url):  # an MCP server's own traffic: its requests are logged
            return None
        self.before_call(request)
        # Before anything is sent, as a replay matches it: a request the cassette cannot
        # hold is refused here (UnserializableValue), on replay at the same point.
        self._lines.classify(request)
        return None

    def before_call(self, request: HttpRequest) -> None:
        """The guards' part of :meth:`begin_http`: what must hold before a call goes out
        (nothing failed to write, the budgets, cancel, the breaker). The recording proxy
        calls only this before forwarding, having checked the body itself, and leaves
        reading the request for the log to :meth:`end_http`, off the call's path."""
        self._check_writable()
        if self.interceptors:
            provider = model_provider(request.method, request.url)
            for interceptor in self.interceptors:
                interceptor.before_call(request, provider)

    def end_http(self, request: HttpRequest, response: HttpResponse | None, timing: session.Timing,
                 error: BaseException | None = None) -> dict[str, Any]:
        """Log a finished exchange (or a failed one, with ``error``), count it, and let the
        guards see it; returns the observation as a reader sees it (an MCP server's own
        traffic is no step: nothing)."""
        if mcp.carries(request.url):
            return {}
        kind, _, body = self._lines.classify(request)
        is_model = kind == Kind.MODEL
        obs, usage, cost = self._lines.exchange(request, response, timing, error)
        counted = dict(obs)  # as a reader sees it: compaction drops what it can derive
        self._write_exchange(obs, body if is_model else None)
        with self._lock:
            add_step(self.totals, counted)
        status = response.status if response is not None else None
        for interceptor in self.interceptors:
            interceptor.after_exchange(request, model=is_model, status=status, error=error,
                                       usage=usage or None, cost=cost)
        return counted

    def _write_exchange(self, obs: dict[str, Any], request_body: Any) -> None:
        """Append an exchange's line: a model line compacted (what the reader can derive is
        left out) with its request body, an HTTP line as it is."""
        if obs["kind"] != Kind.MODEL:
            self.append_line(obs)
            return
        url, full_req, provider = obs["url"], obs["request_headers"], obs.get("provider")
        full_resp = obs["response"]["headers"] if "response" in obs else None
        assert self.writer is not None
        stored = self._compactor.compact(obs, edits="header_edits" in self.writer.features)
        line = self.append_line(stored, request_body=request_body, has_request=True,
                                reply=compact.reply_message(stored, provider, full_resp))
        self._compactor.written(line["seq"], url, full_req, full_resp)

    # Lines redacted whole as they are appended (model and HTTP lines are redacted field by
    # field as they are built, StepLines.exchange: their bodies are large and redacted as
    # raw bytes).
    _REDACTED_WHOLE = frozenset({Kind.TOOL, Kind.MCP, Kind.INTENT, Kind.OUTCOME, Kind.EFFECT,
                                 Kind.CONTROL})

    def append_line(self, obs: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """Write one observation line (marked ``within`` the running tool call, redacted
        whole unless a model or HTTP line); its ``kwargs`` go to the writer."""
        assert self.writer is not None
        within = _within.get()
        if within is not None:
            obs["within"] = within
            self._opened.add(within)
        if obs.get("kind") in self._REDACTED_WHOLE:
            obs = self.redaction.value(obs)
        return self.writer.append(obs, **kwargs)

    def _enter_tool(self, tool: session.ToolSpec, call: str,
                    intent: tuple[int, str] | None) -> contextvars.Token:
        """Mark what runs from here on as made inside tool call ``call`` (``name#n``),
        whose intent, for a side effect, is ``intent`` (seq, key)."""
        return _within.set(call)

    @contextlib.contextmanager
    def _for_a_person(self) -> Iterator[None]:
        """Where this session may stop the run for a person: the NeedsAttention raised is
        kept (:attr:`_attention`)."""
        try:
            yield
        except NeedsAttention as exc:
            self._attention.append(exc)
            raise

    def _names_calls(self) -> bool:
        """Whether this cassette's tool lines name their calls (the ``tool_calls`` feature:
        a call its lines never name was under way where the log ends)."""
        return self.writer is not None and "tool_calls" in self.writer.features

    def before_tool(self, tool: session.ToolSpec, args: dict[str, Any],
                    key: Any = None) -> None:
        """Called before a live tool call; the harness guards decide here. ``key`` is
        ``StepLines.args_key(args)`` when the caller has it already."""
        self._check_writable()
        if self.interceptors:
            key = self._lines.args_key(args) if key is None else key
            for interceptor in self.interceptors:
                interceptor.before_tool(tool.name, key)

    def _open_intent(self, tool: session.ToolSpec, args: dict[str, Any], key: Any,
                     call: str) -> tuple[int, str]:
        obs = {"kind": Kind.INTENT.value, "name": tool.name, "args": key,
               "fp": digest(["tool", tool.name, key]), "t": round(time.time(), 3)}
        if self._names_calls():
            obs["call"] = call
        line = self.append_line(obs, sync=True)
        return line["seq"], f"{self.run_id}:{line['seq']}"

    @contextlib.contextmanager
    def _live_tool(self, tool: session.ToolSpec, args: dict[str, Any],
                   intent: tuple[int, str] | None):
        """Guards, intent, timing and the ``within`` mark around a tool body; logs it."""
        # the guards' and the intent's key: both before the body runs
        key = self._lines.args_key(args)
        self.before_tool(tool, args, key)
        name = f"{tool.name}#{next(self._tool_calls)}"
        if tool.side_effect and intent is None:
            intent = self._open_intent(tool, args, key, name)
        call = _ToolCall(intent[1] if intent else None)
        start, t0 = time.time(), time.perf_counter()
        token = self._enter_tool(tool, name, intent)
        try:
            yield call
        except Exception as exc:
            _within.reset(token)
            if not any(exc is stop for stop in self._attention):  # else it never ended:
                self.log_tool(tool, args, start, t0, error=exc, intent=intent, call=name)
            raise  # the run stops for a person inside it
        _within.reset(token)
        self.log_tool(tool, args, start, t0, result=call.result, intent=intent, call=name)

    def run_tool(self, tool: session.ToolSpec, args: dict[str, Any],
                 run: Callable[[str | None], Any],
                 intent: tuple[int, str] | None = None) -> Any:
        """Run a tool's body live and log it (an intent first for a side effect)."""
        with self._live_tool(tool, args, intent) as call:
            call.result = run(call.key)
        return call.result

    async def run_tool_async(self, tool: session.ToolSpec, args: dict[str, Any],
                             run: Callable[[str | None], Any],
                             intent: tuple[int, str] | None = None) -> Any:
        with self._live_tool(tool, args, intent) as call:
            call.result = await run(call.key)
        return call.result

    def call_tool(self, tool: session.ToolSpec, args: dict[str, Any],
                  run: Callable[[str | None], Any]) -> Any:
        return self.run_tool(tool, args, run)

    async def call_tool_async(self, tool: session.ToolSpec, args: dict[str, Any],
                              run: Callable[[str | None], Any]) -> Any:
        return await self.run_tool_async(tool, args, run)

    def log_tool(self, tool: session.ToolSpec, args: dict[str, Any], start: float, t0: float,
                 *, result: Any = None, error: BaseException | None = None,
                 intent: tuple[int, str] | None = None, call: str | None = None) -> None:
        """Write a tool's line: ``tool``, or ``outcome`` of ``intent`` (seq, key); one
        whose body ran as ``call`` and made lines names it.

        A result the cassette cannot hold is refused with ``UnserializableValue``, and the
        refusal is written first as the tool's ``error``, so that a replay raises it at the
        same step and an agent that catches it replays identical.
        """
        assert self.writer is not None
        obs, refused = self._lines.tool(
            tool, args, round(start, 3), round((time.perf_counter() - t0) * 1000, 2),
            result=result, error=error, intent=intent, step=self.writer.next_seq)
        if call in self._opened:
            self._opened.discard(call)
            if self._names_calls():
                obs["call"] = call
        self.append_line(obs, sync=tool.side_effect)
        with self._lock:
            add_step(self.totals, obs)
        if refused is not None:
            raise refused

    def observe_tool(self, name: str, args: Any, result: Any, *, call_id: str,
                     is_error: bool = False, start: float | None = None,
                     ms: float | None = None, observed: str = "proxy") -> None:
        """Log a tool call the agent ran itself, seen from outside at a boundary: the
        recording proxy sees it as a ``tool_result`` block of the next model request. The
        line is marked ``observed`` (a replay never asks for it: the request that carries
        the result is matched whole) and names the model's ``call_id``. Then the guards see
        the call, as they see a tool call in process: the loop guard may stop the run here,
        before the result reaches the model."""
        assert self.writer is not None
        obs = self._lines.observed_tool(name, args, result, call_id=call_id, is_error=is_error,
                                        start=start, ms=ms, observed=observed,
                                        step=self.writer.next_seq)
        self.append_line(obs)
        with self._lock:
            add_step(self.totals, obs)
        for interceptor in self.interceptors:
            interceptor.before_tool(name, obs["args"])

    def mcp_answer(self, call: mcp.McpCall) -> mcp.McpReply | None:
        """An MCP request goes to its server: a tool call through the guards first, as any
        tool call, and a destructive one after a ``sending`` control line forced to disk
        (its tool line follows once answered: a log with the first and not the second
        ended while the call was in flight, and a resume does not send it again)."""
        if call.tool is None:
            self._check_writable()
            return None
        key = self._lines.args_key(call.arguments)
        self.before_tool(call.spec(), call.arguments, key)
        if call.destructive:
            self.log_control(Control.SENDING, {
                "tool": call.tool, "fp": digest(["tool", call.tool, key]),
                "server": mcp.label(mcp.server_record(call.server, self.redaction))})
        return None

    def mcp_log(self, call: mcp.McpCall, reply: mcp.McpReply, timing: session.Timing) -> None:
        """Write an MCP request's line once its server answered, before the client sees
        the answer (:meth:`StepLines.mcp`); a destructive tool's is forced to disk."""
        assert self.writer is not None
        obs, refused = self._lines.mcp(call, reply, timing, step=self.writer.next_seq)
        self.append_line(obs, sync=call.destructive)
        with self._lock:
            add_step(self.totals, obs)
        if refused is not None:
            raise refused

    def effect(self, name: str, produce: Callable[[], Any]) -> Any:
        site = effects.call_site()
        return self.log_effect(name, produce(), site)

    def log_effect(self, name: str, value: Any, site: effects.Site | None) -> Any:
        """Write an effect line for ``value`` asked for at ``site``; returns ``value``.

        A value the cassette cannot hold is refused with ``UnserializableValue``, and the
        refusal is written first (an ``error`` in place of the value), so that a replay
        raises it at the same point and an agent that catches it replays identical.
        """
        assert self.writer is not None
        obs, refused = self._lines.effect(name, value, site)
        self.append_line(obs)
        with self._lock:
            add_step(self.totals, obs)
        if refused is not None:
            raise refused
        return value


def record(path: str | Path = "cassettes", *, labels: dict[str, Any] | None = None,
           fsync: Fsync | str | None = None, redact_headers: tuple[str, ...] = (),
           redact_body: tuple[str, ...] = (), redact_patterns: tuple[str, ...] = (),
           redact_query: tuple[str, ...] = (), prices: dict[str, Any] | None = None,
           overwrite: bool = False, keyring: Keyring | None = None,
           budgets: Budgets | dict[str, Any] | None = None,
           loop_guard: LoopSettings | dict[str, Any] | bool | None = None,
           breaker: BreakerSettings | dict[str, Any] | bool | None = None,
           clock: Clock | None = None) -> session.Scope[RecordSession]:
    """Record a run into a cassette at ``path`` (a file, or a directory for ``<run>.jsonl``).

    ``fsync``: ``"sync"`` forces every line to disk before the call returns, ``"turn"``
    (default) side effects, control and end lines before it returns and model lines by a
    background group commit, ``"exit"`` only the end. ``budgets``, ``loop_guard`` and
    ``breaker`` set the harness guards (see :mod:`recorder.harness.guards`; defaults and
    ``[tool.deja]`` in :mod:`recorder.harness.settings`); ``clock`` replaces ``time.monotonic`` for
    the wall-clock budget (tests). ``prices`` overrides the dollar price table.

    Secrets never reach disk (:mod:`recorder.capture.redact`): secret headers, URL userinfo,
    query parameters named like secrets and well-known key shapes are redacted
    everywhere; ``redact_headers`` (names), ``redact_body`` (JSON pointers such as
    ``/metadata/user_id``), ``redact_patterns`` (regular expressions) and
    ``redact_query`` (parameter names) add to them, as does ``[tool.deja.redact]``. A bad
    pattern is a ``ConfigError`` here, before anything runs.
    """
    if fsync is not None:
        Fsync.parse(fsync)
    resolve_settings(budgets=budgets, loop_guard=loop_guard, breaker=breaker, prices=prices,
                     redact_headers=tuple(redact_headers), redact_body=tuple(redact_body),
                     redact_patterns=tuple(redact_patterns), redact_query=tuple(redact_query))
    headers, body, patterns, query = (tuple(redact_headers), tuple(redact_body),
                                      tuple(redact_patterns), tuple(redact_query))

    def open_session() -> RecordSession:
        return RecordSession(
            path, labels=labels, fsync=fsync, redact_headers=headers, redact_body=body,
            redact_patterns=patterns, redact_query=query, prices=prices, overwrite=overwrite,
            keyring=keyring, budgets=budgets, loop_guard=loop_guard, breaker=breaker,
            clock=clock).start()

    # Inside ``deja record`` or ``deja replay`` the outer session keeps serving: the block
    # joins it and adds nothing of its own.
    return session.Scope(open_session,
                         lambda rec, exc: rec.close(error=exc), join=True,
                         name=f"record({path})")


def start(path: str | Path, **kwargs: Any) -> RecordSession:
    """Start recording without a ``with`` block (used by the ``deja record`` bootstrap)."""
    if session.active() is not None:
        raise SessionError("a session is already active in this process")
    return RecordSession(path, **kwargs).start()
