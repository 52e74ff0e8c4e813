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
import functools
import importlib.metadata
import itertools
import json
import logging
import os
import platform
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from recorder import effects, providers
from recorder import values as _values
from recorder.canonical import content_decoded, digest, fingerprint
from recorder.capture import session
from recorder.capture import vcr as capture
from recorder.capture.exchange import (
    HttpRequest,
    HttpResponse,
    Redaction,
    RequestReader,
    classify_texts,
    response_record,
    semantic_headers,
)
from recorder.cassette import CassetteWriter, Fsync, compact
from recorder.cassette.keys import Keyring, load_keyring, require_signing_key
from recorder.cassette.schema import (
    EndStatus,
    Totals,
    add_step,
    run_file,
    run_status,
    utc_stamp,
    zero_totals,
)
from recorder.errors import (
    CannotLaunch,
    RunStopped,
    SessionError,
    UnserializableValue,
)
from recorder.harness.guards import BreakerSettings, Budgets, Clock, LoopSettings
from recorder.harness.run_guard import RunGuard
from recorder.harness.settings import resolve as resolve_settings
from recorder.providers import model_provider, volatile_header

log = logging.getLogger("deja.recorder")

_PACKAGES = ("deja", "anthropic", "httpx2", "vcrpy")

# The tool call whose body is running. Observations made inside a tool's body are marked
# ``within`` it: a replay serves the tool whole and never asks for them.
_within: contextvars.ContextVar[str | None] = contextvars.ContextVar("deja_within", default=None)


def new_run_id() -> str:
    """Sortable by start time: ``r_`` + 12 hex digits of milliseconds + 8 random."""
    return f"r_{int(time.time() * 1000):012x}{secrets.token_hex(4)}"


@functools.cache
def _versions() -> dict[str, str]:
    """What the header records of the software that wrote it (read once per process: a
    recording proxy starts many runs)."""
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def portable_launch(argv: list[str], cwd: Path, cassette: Path) -> dict[str, Any]:
    """How to re-launch the run, without this machine's paths where it can be helped.

    When the cassette lies under ``cwd`` (a cassette committed with its project), ``cwd``
    is stored relative to the cassette's directory and ``cassette`` is the cassette's
    path relative to ``cwd``: a replay from any checkout finds the directory again, and a
    copy of the file somewhere else is recognised as such (see :func:`launch_dir`).
    Otherwise ``cwd`` is absolute. The interpreter is stored as ``python``; arguments
    that are paths under ``cwd`` become relative to it.
    """
    cwd = cwd.resolve()
    target = cassette.resolve()
    inside = target.parent.is_relative_to(cwd)
    where = os.path.relpath(cwd, target.parent) if inside else str(cwd)
    out = []
    for i, arg in enumerate(argv):
        if i == 0 and Path(arg).name.startswith("python"):
            arg = "python"
        elif os.path.isabs(arg) and Path(arg).resolve().is_relative_to(cwd):
            arg = os.path.relpath(Path(arg).resolve(), cwd)
        out.append(arg)
    return {"argv": out, "cwd": where,
            "cassette": target.relative_to(cwd).as_posix() if inside else None}


def launch_dir(cassette: Path, header: Mapping[str, Any]) -> Path:
    """The directory to re-run a recorded command in, found from where the cassette is.

    Raises :class:`CannotLaunch` when it cannot be found: the header's absolute directory
    does not exist here, or the cassette is not where it was recorded relative to its
    project (a copy or a move), so that its relative directory would land somewhere the
    run never was.
    """
    cwd = header.get("cwd")
    where = cassette.resolve().parent
    if not isinstance(cwd, str) or not cwd:
        raise CannotLaunch(f"{cassette} does not record the directory its command ran in")
    if os.path.isabs(cwd):
        if not Path(cwd).is_dir():
            raise CannotLaunch(f"{cassette} was recorded with its command run in {cwd}, which "
                               "does not exist on this machine")
        return Path(cwd)
    recorded = header.get("cassette")
    if isinstance(recorded, str):  # the cassette's folder, relative to the run's directory
        parts = Path(recorded).parent.parts
        if parts and where.parts[-len(parts):] != parts:
            raise CannotLaunch(
                f"{cassette} was recorded as {recorded}, relative to the directory its "
                f"command ran in; this copy lies in {where}, not in a folder "
                f"{Path(*parts).as_posix()}, so that directory is unknown here")
    root = Path(os.path.normpath(where / cwd))
    if not root.is_dir():
        raise CannotLaunch(f"{cassette} was recorded with its command run in {cwd} relative "
                           f"to the cassette ({root}), which does not exist")
    return root


def startable(argv: list[str], cwd: Path) -> str | None:
    """Why ``argv`` cannot start in ``cwd`` (None: it can, as far as can be told before
    running it): a missing program, script or module."""
    import importlib.machinery
    import shutil

    if not argv:
        return "there is no command"
    program = argv[0]
    if Path(program).name.startswith("python"):
        rest = argv[1:]
        while rest and rest[0] in ("-u", "-B", "-O", "-OO", "-s", "-E", "-I", "-X"):
            rest = rest[2:] if rest[0] == "-X" else rest[1:]
        if not rest or rest[0] == "-c":
            return None
        if rest[0] == "-m":
            if len(rest) < 2:
                return "python -m names no module"
            top = rest[1].split(".")[0]
            found = importlib.machinery.PathFinder.find_spec(top, [str(cwd), *sys.path[1:]])
            if not found:
                return f"no module {rest[1]!r} is importable from {cwd}"
            if rest[1] == "pytest":  # the tests it was given (file or file::test) are here
                for arg in rest[2:]:
                    name = arg.split("::")[0]
                    if not arg.startswith("-") and (name.endswith(".py") or "::" in arg) \
                            and not (cwd / name).exists():
                        return f"the test file {name} is not in {cwd}"
            return None
        if rest[0].startswith("-"):
            return None
        script = Path(rest[0])
        script = script if script.is_absolute() else cwd / script
        if script.is_dir() or script.suffix in (".zip", ".pyz"):  # a package with __main__
            ok = (script / "__main__.py").is_file() if script.is_dir() else script.is_file()
            return None if ok else f"{rest[0]} in {cwd} has no __main__.py"
        return None if script.is_file() else f"the script {rest[0]} is not in {cwd}"
    if os.sep in program:
        path = Path(program) if os.path.isabs(program) else cwd / program
        return None if path.is_file() else f"the program {program} is not in {cwd}"
    return None if shutil.which(program) else f"no program {program!r} on PATH"


def status_for(error: BaseException | None) -> str:
    """The end status of a run that stopped with ``error`` (None: it completed)."""
    if error is None:
        return EndStatus.COMPLETED
    if isinstance(error, RunStopped):
        return error.end_status
    if isinstance(error, KeyboardInterrupt):
        return EndStatus.INTERRUPTED
    return EndStatus.ERROR


def error_record(exc: BaseException) -> dict[str, str]:
    cls = type(exc)
    return {"type": cls.__qualname__, "module": cls.__module__, "message": str(exc)}


@dataclasses.dataclass
class _ToolCall:
    key: str | None
    result: Any = None


class RecordSession(session.Session):
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
                 header: dict[str, Any] | None = None) -> None:
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
        self._compactor = compact.Compactor()
        self._requests = RequestReader()  # a conversation's resent history is parsed once
        self._urls: dict[str, str] = {}
        self._volatile: dict[str | None, dict[str, bool]] = {}  # by provider, header name
        self._headers: dict[tuple[str | None, tuple[tuple[str, str], ...]], list[list[str]]] = {}

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

    def _error(self, exc: BaseException) -> dict[str, str]:
        """The error record of ``exc`` as stored: its message redacted and writable."""
        record = error_record(exc)
        message = self.redaction.text(record["message"])
        record["message"] = message.encode("utf-8", "backslashreplace").decode("utf-8")
        return record

    def end_line(self, status: str | None = None,
                 error: BaseException | None = None) -> dict[str, Any]:
        """The end line this run would close with now (``status`` follows from ``error``)."""
        assert self.writer is not None
        with self._lock:
            totals = dict(self.totals, cost_usd=round(self.totals["cost_usd"], 8),
                          duration_s=round(time.perf_counter() - self._t0, 3),
                          observations=self.writer.next_seq)
        stopped = self.guard.stopped if self.guard is not None else None
        if error is None and stopped is not None:
            error = stopped  # the agent caught the guard's error, but the run is over
        if status is None and self.writer.failed is not None:
            status = EndStatus.INTERRUPTED  # stopped by the disk, not by the run: it resumes
            error = error or self.writer.failed
        end: dict[str, Any] = {"status": status or status_for(error), "totals": totals}
        if error is not None:
            end["error"] = self._error(error)
            if isinstance(error, RunStopped):
                end["reason"] = error.reason
        return end

    def log_control(self, event: str, detail: dict[str, Any]) -> None:
        """Log a control event (a guard's decision, a fork's edit, a resume), forced to
        disk before the run goes on."""
        self.append_line({"kind": "control", "event": event, "detail": detail}, sync=True)

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
        self.before_call(request)
        # Before anything is sent, as a replay matches it: a request the cassette cannot
        # hold is refused here (UnserializableValue), on replay at the same point.
        self._classify(request)
        return None

    def before_call(self, request: HttpRequest) -> None:
        """The guards' part of :meth:`begin_http`: what must hold before a call goes out
        (nothing failed to write, the budgets, cancel, the breaker). The recording proxy
        calls only this before forwarding, having checked the body itself, and leaves
        reading the request for the log to :meth:`end_http`, off the call's path."""
        self._check_writable()
        if self.guard is not None:
            self.guard.before_call(request, model_provider(request.method, request.url))

    def _classify(self, request: HttpRequest) -> tuple[str, str | None, Any]:
        if request.classified is None:
            request.classified = classify_texts(
                request.method, request.url,
                request.original_body if request.original_body is not None else request.body,
                self.redaction, self._requests)[:3]
        return request.classified

    def end_http(self, request: HttpRequest, response: HttpResponse | None, timing: session.Timing,
                 error: BaseException | None = None) -> dict[str, Any]:
        """Log a finished exchange (or a failed one, with ``error``), count it, and let the
        guards see it; returns the observation as a reader sees it."""
        kind, provider, body = self._classify(request)
        is_model = kind == "model"
        obs = self._exchange_line(request, kind, provider, body)
        seam = providers.for_line(obs)
        obs["t"] = round(timing.start, 3)
        obs["ms"] = round(timing.ms, 2)
        if (timing.ttfb_ms is not None and response is not None
                and seam.is_stream(response.headers)):
            obs["ttft_ms"] = round(timing.ttfb_ms, 2)
        usage: dict[str, Any] = {}
        cost = None
        if response is not None:
            obs["response"] = response_record(response, self.redaction)
            if is_model:
                usage, cost = self._model_outcome(obs, seam, response, body)
        if error is not None:
            obs["error"] = {**self._error(error), "has_response": response is not None}
        if request.original_body is not None:
            obs["clamped_max_tokens"] = seam.request_max_tokens(json.loads(request.body))
        counted = dict(obs)  # as a reader sees it: compaction drops what it can derive
        self._write_exchange(obs, body if is_model else None)
        with self._lock:
            add_step(self.totals, counted)
        if self.guard is not None:
            self.guard.after_exchange(
                model=is_model, status=response.status if response is not None else None,
                error=error, usage=usage or None, cost=cost, host=self.guard.host(request.url))
        return counted

    # URLs and request headers repeat call after call: their redacted forms are kept, up
    # to this many of each (the same rules give the same result every time).
    _KEPT = 256

    def _redacted_url(self, url: str) -> str:
        redacted = self._urls.get(url)
        if redacted is None:
            if len(self._urls) >= self._KEPT:
                self._urls.clear()
            redacted = self._urls[url] = self.redaction.url(url)
        return redacted

    def _request_headers(self, headers: list[tuple[str, str]],
                         provider: str | None) -> list[list[str]]:
        """:func:`semantic_headers` of a request, worked out once for each set of headers
        it keeps (a header's value that changes every call, such as ``content-length``, is
        a volatile one and not part of the set)."""
        volatile = self._volatile.get(provider)
        if volatile is None or len(volatile) >= self._KEPT:
            volatile = self._volatile[provider] = {}
        kept = []
        for name, value in headers:
            drop = volatile.get(name)
            if drop is None:
                drop = volatile[name] = volatile_header(name, provider)
            if not drop:
                kept.append((name, value))
        key = (provider, tuple(kept))
        stored = self._headers.get(key)
        if stored is None:
            if len(self._headers) >= self._KEPT:
                self._headers.clear()
            stored = self._headers[key] = semantic_headers(kept, self.redaction, provider)
        return [list(pair) for pair in stored]

    def _exchange_line(self, request: HttpRequest, kind: str, provider: str | None,
                       body: Any) -> dict[str, Any]:
        """The request half of a model or HTTP line, redacted (the model request's body is
        stored apart, as a delta of its conversation)."""
        url = self._redacted_url(request.url)
        headers = self._request_headers(request.headers, provider if kind == "model" else None)
        if kind == "model":
            return {"kind": "model", "provider": provider, "url": url,
                    "request_headers": headers}
        return {"kind": "http", "method": request.method.upper(), "url": url,
                "fp": fingerprint("http", request.method, url, body),
                "request": {"headers": headers, "body": body}}

    def _model_outcome(self, obs: dict[str, Any], seam: providers.Provider,
                       response: HttpResponse, body: Any) -> tuple[dict[str, Any], float | None]:
        """What a model response says (usage, stop reason, API error) and what it cost,
        added to its line (read by ``seam``, its provider); returns the usage and the cost."""
        # read as the SDK reads it: a compressed body decompressed (it is stored as received)
        summary = seam.summarize(response.status, response.headers,
                                 content_decoded(response.body, response.headers))
        usage = summary.get("usage") or {}
        cost = seam.cost(summary.get("model") or seam.request_model(body), usage, self.prices)
        obs.update({"usage": {k: v for k, v in usage.items() if v} or None,
                    "stop_reason": summary.get("stop_reason"), "cost_usd": cost})
        if summary.get("error"):
            obs["api_error"] = summary["error"]
        return usage, cost

    def _write_exchange(self, obs: dict[str, Any], request_body: Any) -> None:
        """Append an exchange's line: a model line compacted (what the reader can derive is
        left out) with its request body, an HTTP line as it is."""
        if obs["kind"] != "model":
            self.append_line(obs)
            return
        url, full_req = obs["url"], obs["request_headers"]
        full_resp = obs["response"]["headers"] if "response" in obs else None
        stored = self._compactor.compact(obs)
        line = self.append_line(stored, request_body=request_body, has_request=True,
                                reply=compact.reply_message(stored))
        self._compactor.written(line["seq"], url, full_req, full_resp)

    # Lines redacted whole as they are appended (model and HTTP lines are redacted field by
    # field in end_http: their bodies are large and redacted as raw bytes).
    _REDACTED_WHOLE = frozenset({"tool", "intent", "outcome", "effect", "control"})

    def append_line(self, obs: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """Write one observation line (marked ``within`` the running tool call, redacted
        whole unless a model or HTTP line); its ``kwargs`` go to the writer."""
        assert self.writer is not None
        within = _within.get()
        if within is not None:
            obs["within"] = within
        if obs.get("kind") in self._REDACTED_WHOLE:
            obs = self.redaction.value(obs)
        return self.writer.append(obs, **kwargs)

    def _args_key(self, args: dict[str, Any]) -> Any:
        """Tool arguments as stored and matched: JSON, secrets redacted (so recording,
        the loop guard and replay all compare the same form)."""
        return self.redaction.value(_values.args_key(args))

    def _enter_tool(self, tool: session.ToolSpec) -> contextvars.Token:
        return _within.set(f"{tool.name}#{next(self._tool_calls)}")

    def before_tool(self, tool: session.ToolSpec, args: dict[str, Any],
                    key: Any = None) -> None:
        """Called before a live tool call; the harness guards decide here. ``key`` is
        ``_args_key(args)`` when the caller has it already."""
        self._check_writable()
        if self.guard is not None:
            self.guard.before_tool(tool.name, self._args_key(args) if key is None else key)

    def _open_intent(self, tool: session.ToolSpec, args: dict[str, Any],
                     key: Any = None) -> tuple[int, str]:
        key = self._args_key(args) if key is None else key
        line = self.append_line({"kind": "intent", "name": tool.name, "args": key,
                             "fp": digest(["tool", tool.name, key]),
                             "t": round(time.time(), 3)}, sync=True)
        return line["seq"], f"{self.run_id}:{line['seq']}"

    @contextlib.contextmanager
    def _live_tool(self, tool: session.ToolSpec, args: dict[str, Any],
                   intent: tuple[int, str] | None):
        """Guards, intent, timing and the ``within`` mark around a tool body; logs it."""
        key = self._args_key(args)  # the guards' and the intent's: both before the body runs
        self.before_tool(tool, args, key)
        if tool.side_effect and intent is None:
            intent = self._open_intent(tool, args, key)
        call = _ToolCall(intent[1] if intent else None)
        start, t0 = time.time(), time.perf_counter()
        token = self._enter_tool(tool)
        try:
            yield call
        except Exception as exc:
            _within.reset(token)
            self.log_tool(tool, args, start, t0, error=exc, intent=intent)
            raise
        _within.reset(token)
        self.log_tool(tool, args, start, t0, result=call.result, intent=intent)

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
                 intent: tuple[int, str] | None = None) -> None:
        """Write a tool's line: ``tool``, or ``outcome`` of ``intent`` (seq, key).

        A result the cassette cannot hold is refused with ``UnserializableValue``, and the
        refusal is written first as the tool's ``error``, so that a replay raises it at the
        same step and an agent that catches it replays identical.
        """
        assert self.writer is not None
        t, ms = round(start, 3), round((time.perf_counter() - t0) * 1000, 2)
        obs: dict[str, Any]
        if intent is not None:  # an outcome names its intent, which holds the arguments
            obs = {"kind": "outcome", "name": tool.name, "intent": intent[0], "key": intent[1],
                   "t": t, "ms": ms}
        else:  # the arguments as they are once the body has run
            key = self._args_key(args)
            obs = {"kind": "tool", "name": tool.name, "args": key,
                   "fp": digest(["tool", tool.name, key]), "t": t, "ms": ms}
        refused: UnserializableValue | None = None
        if error is not None:
            obs["error"] = self._error(error)
        else:
            value = tool.encode(result) if tool.encode else result
            try:
                obs["result"] = _values.encode(
                    value, where=f"result of tool {tool.name!r} (step {self.writer.next_seq})")
            except UnserializableValue as exc:
                refused = exc
                obs["error"] = self._error(exc)
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
        key = self.redaction.value(_values.args_key(args if isinstance(args, dict)
                                                    else {"input": args}))
        obs: dict[str, Any] = {"kind": "tool", "name": name, "args": key,
                               "fp": digest(["tool", name, key]), "observed": observed,
                               "call_id": call_id,
                               "t": round(start if start is not None else time.time(), 3),
                               "ms": None if ms is None else round(ms, 2)}
        obs["result"] = _values.encode(result, where=f"result of tool {name!r} "
                                                     f"(step {self.writer.next_seq})")
        if is_error:
            obs["is_error"] = True
        self.append_line(obs)
        with self._lock:
            add_step(self.totals, obs)
        if self.guard is not None:
            self.guard.before_tool(name, key)

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
        obs: dict[str, Any] = {"kind": "effect", "name": name}
        refused: UnserializableValue | None = None
        try:
            obs["value"] = _values.encode(value, where=f"effect {name!r}")
        except UnserializableValue as exc:
            refused, error = exc, error_record(exc)
            # The message may quote the refused text (a lone surrogate); the line must still
            # be writable as UTF-8.
            error["message"] = error["message"].encode("utf-8", "backslashreplace").decode()
            obs["error"] = error
        if site is not None:
            obs["site"] = site.record()
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


def write_end(path: str | Path, end: dict[str, Any], exit_code: int,
              keyring: Keyring | None = None, *,
              handed: str | None = None) -> dict[str, Any]:
    """Close a cassette a program left open, with the end line it handed over and its exit
    status (``deja record`` does this once the program has exited). ``handed`` is the
    status the program handed over (and wrote in its status record), when the launcher
    has changed it: the record then says the status written."""
    from recorder.cassette import load

    ring = keyring or load_keyring(create=False)
    loaded = load(path, keyring=ring, require_signature=True, allow_incomplete=True)
    handed = handed or end.get("status")
    end = dict(end, exit_code=exit_code)
    if exit_code != 0 and end.get("status") == EndStatus.COMPLETED:
        end["status"] = EndStatus.ERROR
        end.setdefault("reason", f"exit status {exit_code}")
    key = ring.get(str(loaded.header.get("key_id")))
    assert key is not None  # load() verified with it
    written = CassetteWriter.reopen(loaded, key, Fsync.SYNC).close(end)
    if written.get("status") != handed:  # the record said what the program handed over
        from recorder.harness.progress import close_record

        close_record(str(loaded.header.get("run")), run_status(written),
                     str(written.get("reason") or ""))
    return written


def start(path: str | Path, **kwargs: Any) -> RecordSession:
    """Start recording without a ``with`` block (used by the ``deja record`` bootstrap)."""
    if session.active() is not None:
        raise SessionError("a session is already active in this process")
    return RecordSession(path, **kwargs).start()
