"""Replay a recorded run: the agent's code runs again, every observation comes from the log.

::

    import replayer

    with replayer.replay("cassettes/r_0193....jsonl") as run:
        agent()                        # no network: model, HTTP, tools, effects all served
    print(run.result.report())

A call the cassette cannot answer raises :class:`recorder.Divergence` at once, with the
recorded and the replayed request and their diff; it reaches the agent as that error (the
anthropic SDK does not wrap or retry it). When the block ends, a divergence the agent
swallowed, or recorded steps the agent never asked for, raise ``Divergence`` too unless
``raise_on_divergence=False``. Retries recorded with their backoff replay without waiting.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from recorder import capture, providers
from recorder import values as _values
from recorder.canonical import Parts
from recorder.capture import mcp, session
from recorder.capture.exchange import (
    HttpRequest,
    HttpResponse,
    Redaction,
    RequestReader,
    classify_texts,
    request_fingerprint,
    response_from_record,
)
from recorder.capture.sources import Decision, Source
from recorder.cassette import Cassette, load
from recorder.cassette.keys import Keyring, load_keyring
from recorder.cassette.rows import run_totals, step_count
from recorder.cassette.schema import Control, Kind
from recorder.effects import Site, call_site
from recorder.errors import (
    BudgetExhausted,
    Cancelled,
    CircuitOpen,
    CorruptCassette,
    Divergence,
    DivergenceInfo,
    LoopDetected,
    SessionError,
    ToolReplayError,
)
from recorder.imports import when_imported
from replayer._exact import ExactBytes
from replayer.index import FAMILY, Index, heads, tool_key
from replayer.policy import ReplayPolicy
from replayer.result import ReplayResult
from replayer.verdicts import Asked, Change, Referee, Tally, recorded_request

if TYPE_CHECKING:
    from replayer.continuation import ContinuationSession

log = logging.getLogger("deja.replayer")

# What a replay raises at each control line that refused a call (schema.STOPS).
_STOP_ERRORS = {Control.BUDGET_EXHAUSTED: BudgetExhausted, Control.CANCELLED: Cancelled,
                Control.LOOP_DETECTED: LoopDetected, Control.CIRCUIT_OPEN: CircuitOpen}


class _NoSleepTime(types.ModuleType):
    """``time`` with ``sleep`` doing nothing: the SDK's retry backoff during a replay."""

    def __init__(self) -> None:
        super().__init__("time")

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        return None


class _NoSleepAnyio(types.ModuleType):
    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("anyio")
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    async def sleep(self, seconds: float) -> None:
        await self._real.sleep(0)


@contextlib.contextmanager
def _no_retry_sleep() -> Iterator[None]:
    """Replace the SDKs' retry sleeps with no-ops for the duration of the replay: now for
    an SDK already imported, else the moment the program imports it (importing both SDKs
    up front would cost a replay over a second)."""
    with contextlib.ExitStack() as stack:
        def quiet(name: str) -> None:
            mod = sys.modules[name]
            if getattr(mod, "time", None) is time:
                stack.enter_context(_setattr(mod, "time", _NoSleepTime()))
            real_anyio = getattr(mod, "anyio", None)
            if isinstance(real_anyio, types.ModuleType) and real_anyio.__name__ == "anyio":
                stack.enter_context(_setattr(mod, "anyio", _NoSleepAnyio(real_anyio)))

        for name in ("anthropic._base_client", "openai._base_client"):
            stack.enter_context(when_imported(name, functools.partial(quiet, name)))
        yield


@contextlib.contextmanager
def _placeholder_keys() -> Iterator[None]:
    """A placeholder in each provider's API key variable left unset, for the duration of
    the replay (``anthropic.Anthropic()`` refuses to start without a key, and a replay sends
    nothing); taken out again unless the program set its own meanwhile."""
    added = providers.placeholder_keys(os.environ)
    os.environ.update(added)
    try:
        yield
    finally:
        for var in added:
            if os.environ.get(var) == providers.PLACEHOLDER_KEY:
                del os.environ[var]


@contextlib.contextmanager
def _setattr(obj: Any, name: str, value: Any):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class ReplaySession(session.Session, Source, mcp.McpSeam, mcp.McpSource):
    """Serves a loaded cassette to the agent's calls: as the session of a replay, or as a
    source of a continuing run (:mod:`recorder.capture.sources`). An MCP client's requests
    are served too (:mod:`recorder.capture.mcp`): its server is never started.

    As a source: ``until_used_up`` (a fork's or a resume's prefix) closes it once every
    step was served; ``on_miss="pass"`` closes it at the first call it cannot answer
    instead of raising ``Divergence`` (replay, then live); ``copies`` serves calls as if
    live, for the continuing run to log.
    """

    mode = "replay"
    consults_log = True

    def __init__(self, cassette: Cassette, *, raise_on_divergence: bool = True,
                 until_used_up: bool = False, on_miss: str = "diverge",
                 copies: bool = False, policy: ReplayPolicy | None = None) -> None:
        if on_miss not in ("diverge", "pass"):
            raise ValueError(f"on_miss: 'diverge' or 'pass', not {on_miss!r}")
        self.cassette = cassette
        self.until_used_up, self.copies = until_used_up, copies
        self.passes = on_miss == "pass"
        self.missed = False  # a miss passed on (on_miss="pass"): closed from here on
        self.path = cassette.path
        self.raise_on_divergence = raise_on_divergence  # read by replay()'s scope
        # what a request is matched on: the stored fingerprints (exact), else its key
        # under the policy (equivalent); each call graded, each divergence named
        self.policy = policy or ReplayPolicy()
        self.index = Index(cassette)
        self.referee = Referee(cassette, self.index, self.policy)
        self.tally = Tally()
        # Exactly the rules the recording used, so requests fingerprint the same way.
        self.redaction = Redaction.from_header(cassette.header.get("redact"))
        self._parts = Parts()  # the history the agent resends, hashed once
        self._requests = RequestReader()  # and parsed once
        # a request sent as recorded, byte for byte, is matched without reading it
        self.exact_bytes = ExactBytes(heads(cassette.observations), cassette.observations,
                                      self.index.used, self.request_body, self.redaction.url)
        self._lock = threading.Lock()
        self.divergence: DivergenceInfo | None = None
        self.notes: list[str] = []
        self.result: ReplayResult | None = None
        self._first: float | None = None  # the first call asked for
        self._last: float | None = None  # the last one answered
        self._progress: Any = None
        self._patches: contextlib.ExitStack | None = None

    def start(self) -> ReplaySession:
        session.activate(self)
        try:
            stack = contextlib.ExitStack()
            stack.enter_context(capture.install(self))
            stack.enter_context(_no_retry_sleep())
            stack.enter_context(_placeholder_keys())
            self._patches = stack
        except BaseException:
            session.deactivate(self)
            raise
        return self

    def show_progress(self, label: str = "replaying") -> None:
        """Draw a progress bar on stderr while the steps are served, if it is a terminal
        (see :mod:`replayer._progress`); it goes at :meth:`stop_progress` or ``finish``."""
        from replayer._progress import ReplayProgress

        self._progress = ReplayProgress.on_terminal(label, self.index.total)

    def stop_progress(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.close()

    def _tick(self, served: bool = True) -> None:
        """A call was asked for (``served=False``) or answered: timing and progress."""
        now = time.perf_counter()
        if self._first is None:
            self._first = now
        if served:
            self._last = now
            progress = self._progress
            if progress is not None:
                progress.update(len(self.index.used))

    def _steps_served(self, unused: tuple[int, ...]) -> int:
        """The steps the replay went through (see :class:`ReplayResult`)."""
        used = self.index.used
        tracked = used.union(unused)
        reached = max(used, default=-1)
        return sum(1 for seq in range(len(self.cassette.observations))
                   if seq in used or (seq not in tracked and (not unused or seq < reached)))

    def finish(self) -> ReplayResult:
        if self.result is not None:
            return self.result
        self.stop_progress()
        try:
            if self._patches is not None:
                self._patches.close()
        finally:
            session.deactivate(self)
        unused = tuple(self.index.unused())
        if self.divergence is None and unused:
            self.divergence = self.referee.missing(unused)
            self.tally.diverged(Change.MISSING_CALL, sum(  # by heads: no line restored
                1 for seq in unused if heads(self.cassette.observations)[seq].kind in FAMILY))
        grades, kinds, equivalent = self.tally.summary()
        end: Mapping[str, Any] = self.cassette.end or {}
        serving = (self._last or self._first or 0.0) - (self._first or 0.0)
        self.result = ReplayResult(
            path=str(self.path), run=self.cassette.run,
            steps_served=self._steps_served(unused), steps_recorded=step_count(self.cassette),
            divergence=self.divergence, unused=unused, verified=self.cassette.verified,
            verify_note=self.cassette.verify_note, recorded_status=end.get("status"),
            seconds=round(serving, 6), notes=tuple(self.notes),
            totals=run_totals(self.cassette),
            recorded_exit_code=end.get("exit_code") if isinstance(end.get("exit_code"), int)
            else None, grades=grades, kinds=kinds, equivalent=equivalent)
        return self.result

    # -- as a source

    @property
    def open(self) -> bool:
        if self.missed:
            return False
        return self.index.remaining > 0 if self.until_used_up else True

    def _missed(self, miss: Divergence) -> None:
        """A call this log cannot answer: passed on (closing it) or raised."""
        if not self.passes:
            raise miss
        self.missed = True  # self.divergence keeps where: the step the run left the log
        log.info("%s: the run asked for something else at step %s; going live", self.path,
                 miss.info.step)

    def _answered(self, take: Callable[..., Mapping[str, Any]],
                  *args: Any) -> Mapping[str, Any] | None:
        try:
            return take(*args)
        except Divergence as miss:
            self._missed(miss)
            return None

    def answer_http(self, request: HttpRequest) -> Mapping[str, Any] | None:
        return self._answered(self.match_http, request)

    def answer_tool(self, tool: session.ToolSpec, args: dict[str, Any]) -> Mapping[str, Any] | None:
        return self._answered(self.take_tool, tool, args)

    def answer_effect(self, name: str, site: Site | None) -> Mapping[str, Any] | None:
        return self._answered(self.take_effect, name, site)

    def answer_mcp(self, call: mcp.McpCall) -> Mapping[str, Any] | None:
        return self._answered(self.take_mcp, call)

    def outcome_of(self, intent: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return self.index.outcomes.get(intent["seq"])

    def request_body(self, seq: int) -> Any:
        return self.cassette.requests.get(seq)

    # -- divergence

    def _diverge(self, asked: Asked, what: str) -> Divergence:
        """The divergence of a call nothing recorded answers, named and counted."""
        self._tick()
        info = self.referee.divergence(asked, what)
        self.tally.diverged(Change(info.category or Change.CHANGED_REQUEST))
        with self._lock:
            if self.divergence is None:
                self.divergence = info
        return Divergence(info, path=self.path)

    # -- the capture seam

    def raise_recorded_stop(self) -> None:
        """Raise the harness decision recorded at this point of the run, if there is one."""
        self._tick(served=False)
        stop = self.index.pending_stop()
        if stop is None:
            return
        self._tick()
        detail = dict(stop.get("detail") or {})
        message = detail.pop("message", None) or (
            f"the recorded run was stopped here: {stop['event']} "
            f"{json.dumps(detail, default=str)}")
        cls = _STOP_ERRORS[stop["event"]]
        raise cls(f"{message} [replayed from seq {stop['seq']}]", reason=detail.get("reason"),
                  detail=detail)

    def match_http(self, request: HttpRequest, *, served: bool = False) -> Mapping[str, Any]:
        """The recorded observation that answers ``request``; a Divergence if none does.
        ``served``: only to serve its response (a request sent as recorded, byte for
        byte, gets its line as :meth:`~recorder.cassette.lines.Lines.served` restores it)."""
        self.raise_recorded_stop()
        head = self.exact_bytes.find(request.method, request.url, request.body)
        obs = self.index.take(("net", str(head.fp)), served=served) if head is not None else None
        if obs is not None:
            self.tally.exact()
            self._tick()
            return obs
        kind, provider, body, texts, _ = classify_texts(request.method, request.url,
                                                     request.body, self.redaction,
                                                     self._requests)
        url = self.redaction.url(request.url)
        actual: Any = body if kind == Kind.MODEL else {
            "method": request.method.upper(), "url": url, "body": body}
        obs = self.index.take(("net", request_fingerprint(kind, provider, request.method, url,
                                                          body, self._parts, texts)))
        if obs is not None:
            self.tally.exact()
            self._tick()
            return obs
        # no exact match: the request as the policy reads it (ids renamed, declared fields
        # left out, text normalised), against the recorded ones read alike
        asked = Asked("net", actual, kind, provider, request.method, url,
                      self.policy.key(kind, provider, request.method, url, body))
        loose = kind == Kind.MODEL or self.policy.ignore or self.policy.normalise
        obs = self.index.take_loose(str(asked.key), self.referee.line_key) if loose else None
        if obs is None:
            raise self._diverge(asked, f"the agent sent a {kind} request "
                                       f"({request.method} {url})")
        fields = self.referee.equivalent_fields(obs, actual)
        if fields:
            self.tally.equivalent_call(obs["seq"], fields)
        else:  # the same request, written otherwise (its keys in another order)
            self.tally.exact()
        self._tick()
        return obs

    def response_of(self, obs: Mapping[str, Any]) -> HttpResponse:
        try:  # a signed line deja never wrote is a CorruptCassette, never an SDK traceback
            error = obs.get("error")  # (neither a response nor an error: a KeyError)
            served = response_from_record(obs["response"]) if "response" in obs or not error \
                else HttpResponse(status=0, headers=[], body=b"")
            if error:
                served.extra.update(error=error, has_response=bool(error.get("has_response")))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptCassette(f"{self.path}: seq {obs.get('seq')}: its response cannot be "
                                  f"served ({exc!r})", path=self.path, seq=obs.get("seq")) from None
        return served

    def begin_http(self, request: HttpRequest) -> HttpResponse | None:
        return self.response_of(self.match_http(request, served=True))

    def end_http(self, request: HttpRequest, response: HttpResponse | None,
                 timing: session.Timing, error: BaseException | None = None) -> None:
        raise SessionError("a replay never sends requests")  # pragma: no cover

    def serve_tool(self, tool: session.ToolSpec, args: dict[str, Any]) -> Decision:
        """The recorded answer to a tool call: its value (or its recorded error, raised), or,
        for a side effect the recording ended inside, the intent to settle."""
        obs = self.take_tool(tool, args)
        if obs["kind"] == Kind.INTENT and obs["seq"] not in self.index.outcomes:
            return Decision.settle(obs)
        return Decision.answer(self.tool_value(tool, obs))

    def take_tool(self, tool: session.ToolSpec, args: dict[str, Any]) -> Mapping[str, Any]:
        """The recorded observation that answers this call (a divergence if none does)."""
        key = self.redaction.value(_values.args_key(args))
        return self._take(tool_key(tool.name, key), Asked(
            "tool", {"name": tool.name, "args": key}, Kind.TOOL.value),
            f"the agent called tool {tool.name!r}")

    def take_mcp(self, call: mcp.McpCall) -> Mapping[str, Any]:
        """The recorded line that answers an MCP request (a divergence, naming the server,
        if none does)."""
        family, key, shown = call.match(self.redaction)
        kind = Kind.TOOL if family == "tool" else Kind.MCP
        return self._take((family, key), Asked(family, shown, kind.value),
                          call.described(self.redaction))

    def mcp_answer(self, call: mcp.McpCall) -> mcp.McpReply:
        return mcp.reply_of(self.take_mcp(call))

    def _take(self, key: tuple[str, str], asked: Asked, what: str) -> Mapping[str, Any]:
        self.raise_recorded_stop()
        obs = self.index.take(key)
        if obs is None:
            raise self._diverge(asked, what)
        self.tally.exact()
        self._tick()
        return obs

    def tool_value(self, tool: session.ToolSpec, obs: Mapping[str, Any]) -> Any:
        """The value a recorded tool call returned, or its recorded error, raised again."""
        if obs["kind"] == Kind.INTENT:
            outcome = self.index.outcomes.get(obs["seq"])
            if outcome is None:
                raise self.unsettled(tool, obs)
            obs = outcome
        if "error" in obs:
            raise rebuild_error(tool.name, obs["error"])
        value = _values.decode(obs.get("result"))
        return tool.decode(value) if tool.decode else value

    def unsettled(self, tool: session.ToolSpec, intent: Mapping[str, Any]) -> Divergence:
        """The divergence of a replay that reaches a side effect the recording ended in."""
        info = DivergenceInfo(
            step=intent["seq"], kind=Kind.INTENT.value,
            reason=f"the recording ended inside side-effecting tool {tool.name!r} (intent "
                   f"at seq {intent['seq']} has no outcome); resume the run to settle it",
            expected=recorded_request(self.cassette, intent), actual=None, diff="")
        with self._lock:
            if self.divergence is None:
                self.divergence = info
        return Divergence(info, path=self.path)

    def call_tool(self, tool: session.ToolSpec, args: dict[str, Any],
                  run: Callable[[str | None], Any]) -> Any:
        return self.tool_value(tool, self.take_tool(tool, args))

    async def call_tool_async(self, tool: session.ToolSpec, args: dict[str, Any],
                              run: Callable[[str | None], Any]) -> Any:
        return self.call_tool(tool, args, run)

    def effect(self, name: str, produce: Callable[[], Any]) -> Any:
        return self.effect_value(self.take_effect(name, call_site()))

    def take_effect(self, name: str, site: Site | None) -> Mapping[str, Any]:
        """The recorded effect that answers ``name`` asked for at ``site``: the next one of
        that name recorded there, else (with a note) the next of that name anywhere."""
        self._tick(served=False)
        obs, moved = self.index.take_effect(name, site.file if site else None,
                                            site.function if site else None)
        if obs is None:
            asked: dict[str, Any] = {"effect": name}
            if site is not None:
                asked["site"] = site.record()
            raise self._diverge(Asked("effect", asked, Kind.EFFECT.value),
                                f"the agent asked for effect {name!r}")
        self.tally.exact()
        self._tick()
        at = Site.parse(obs.get("site")) if moved else None
        if at is not None and site is not None:
            note = (f"effect {name!r} asked for at {site} (line {site.line}) but recorded at "
                    f"{at} (line {at.line}, seq {obs['seq']}): the order of effects changed "
                    "(or the call moved); served in recorded order")
            log.warning("%s: %s", self.path, note)
            with self._lock:
                self.notes.append(note)
        return obs

    def effect_value(self, obs: Mapping[str, Any]) -> Any:
        """The value of a recorded effect, or the refusal it recorded, raised again."""
        if "error" in obs:
            raise rebuild_error(f"effect {obs['name']}", obs["error"])
        return _values.decode(obs.get("value"))


def rebuild_error(tool: str, error: Mapping[str, Any]) -> BaseException:
    try:
        cls: Any = importlib.import_module(error.get("module", "builtins"))
        for part in str(error["type"]).split("."):
            cls = getattr(cls, part)
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls(error.get("message", ""))
    except Exception:
        log.debug("could not rebuild %s", error, exc_info=True)
    return ToolReplayError(tool, str(error.get("type")), str(error.get("message", "")))


def _check_replay(replay_session: ReplaySession, result: ReplayResult,
                  exc: BaseException | None) -> None:
    """A divergence ends the block with :class:`Divergence` (unless the block already
    raised one, or the replay was asked not to)."""
    if result.divergence is None or not replay_session.raise_on_divergence:
        return
    if isinstance(exc, Divergence):
        return
    raise Divergence(result.divergence, path=replay_session.path) from exc


@overload
def replay(path: str | Path, *, keyring: Keyring | None = ..., require_signature: bool = ...,
           allow_unverified: bool | None = ..., allow_torn: bool = ...,
           allow_incomplete: bool = ..., raise_on_divergence: bool = ...,
           policy: ReplayPolicy | None = ..., on_divergence: Literal["raise"] = ...,
           out: None = ..., live_tools: Sequence[str] = ...) -> session.Scope[ReplaySession]:
    ...


@overload
def replay(path: str | Path, *, keyring: Keyring | None = ..., require_signature: bool = ...,
           allow_unverified: bool | None = ..., allow_torn: bool = ...,
           allow_incomplete: bool = ..., raise_on_divergence: bool = ...,
           policy: ReplayPolicy | None = ..., on_divergence: Literal["live"],
           out: str | Path | None = ..., live_tools: Sequence[str] = ...
           ) -> session.Scope[ContinuationSession]:
    ...


def replay(path: str | Path, *, keyring: Keyring | None = None, require_signature: bool = False,
           allow_unverified: bool | None = None, allow_torn: bool = False,
           allow_incomplete: bool = False, raise_on_divergence: bool = True,
           policy: ReplayPolicy | None = None, on_divergence: str = "raise",
           out: str | Path | None = None,
           live_tools: Sequence[str] = ()) -> session.Scope[Any]:
    """Replay the cassette at ``path`` around a block or a decorated function.

    The signature chain is verified with the key the cassette names (from ``keyring``,
    else the environment's keys). A cassette whose key is not available is refused
    (:class:`recorder.UnverifiedCassette`) unless ``allow_unverified`` (default: the
    ``DEJA_ALLOW_UNVERIFIED`` environment variable); its result then says ``NOT
    VERIFIED``. ``require_signature`` refuses it even then. A torn last line is refused
    unless ``allow_torn``; a cassette without an end line (truncated, or a crashed run)
    unless ``allow_incomplete``. ``policy`` says what may differ between the recording and
    the replay (:class:`replayer.policy.ReplayPolicy`: ignored fields, normalised text);
    the project's ``[tool.deja.match]`` adds to it. Without one, the replay takes what
    the project and each provider declare volatile
    (:meth:`~replayer.policy.ReplayPolicy.configured`).

    ``on_divergence="live"`` replays until the program asks for something the cassette
    does not hold, then goes live into a new cassette, ``out``, whose header names this
    one and the step it left (:mod:`replayer.then_live`); ``live_tools``: the
    side-effecting tools that may then run for real (none by default).
    """
    if on_divergence == "live":
        from replayer.then_live import then_live

        return then_live(path, out=out, policy=policy, live_tools=live_tools,
                         keyring=keyring)
    if on_divergence != "raise":
        raise ValueError(f"on_divergence: 'raise' or 'live', not {on_divergence!r}")

    def open_replay() -> ReplaySession:
        chosen = ReplayPolicy.configured() if policy is None else \
            policy.merged(ReplayPolicy.configured())
        loaded = load(path, keyring=keyring or load_keyring(create=False),
                      require_signature=require_signature, allow_unverified=allow_unverified,
                      allow_torn=allow_torn, allow_incomplete=allow_incomplete)
        return ReplaySession(loaded, raise_on_divergence=raise_on_divergence,
                             policy=chosen).start()

    return session.Scope(open_replay, lambda replay_session, exc: replay_session.finish(),
                         check=_check_replay, name=f"replay({path})")


def start(path: str | Path, *, progress: bool = False, policy: ReplayPolicy | None = None,
          **kwargs: Any) -> ReplaySession:
    """Start a replay without a ``with`` block (used by the ``deja replay`` bootstrap);
    ``progress`` draws a bar on stderr when it is a terminal (:meth:`show_progress`);
    ``policy``: the command line's rules, added to what the project and each provider
    declare volatile (:meth:`~replayer.policy.ReplayPolicy.configured`)."""
    keyring = kwargs.pop("keyring", None) or load_keyring(create=False)
    chosen = ReplayPolicy.configured(policy)
    replay_session = ReplaySession(load(path, keyring=keyring, **kwargs), policy=chosen).start()
    if progress:
        replay_session.show_progress()
    return replay_session
