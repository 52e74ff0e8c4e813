"""A recording whose calls are first offered to sources: what fork and resume share.

Its sources (:mod:`recorder.capture.sources`) are asked in order. A fork's or a resume's
recorded prefix comes first: while it lasts, every call is served from it exactly as a
replay would (a miss is a ``Divergence``; nothing reaches the network, no tool body runs).
Once every observation of the prefix has been served the run goes live: calls go out and
are appended to the writer, with the harness guards of a normal recording, unless a
source that copies answers them first (a fork's ``then_replay`` cassette, served and
logged as if live).

An intent without an outcome in a resume's prefix (a crash inside a side-effecting tool)
is settled when the agent reaches it, and the rest of the prefix is still served (a side
effect that finished beside it is answered from its outcome): see
:mod:`recorder.intents`. A fork never settles one; it stops for a person.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from recorder import values as _values
from recorder.canonical import digest
from recorder.capture import mcp, session
from recorder.capture.exchange import HttpRequest, HttpResponse, Redaction
from recorder.capture.sources import Action, Decision, Source
from recorder.cassette import Cassette, CassetteWriter
from recorder.cassette.keys import Keyring
from recorder.cassette.schema import Control, Kind, add_step, replayed_totals
from recorder.effects import call_site
from recorder.errors import Divergence, DivergenceInfo, KeyMissing, NeedsAttention, ToolRefused
from recorder.harness.guards import Budgets
from recorder.intents import Effect, Intent, Settled
from recorder.record import RecordSession, current_body
from replayer.replay import ReplaySession, rebuild_error
from replayer.tool_policy import RecordedTools, Rule, ToolPolicy, ToolRule
from replayer.under_way import UnderWay, call_lines, mcp_in_flight

log = logging.getLogger("deja.replayer")
_NOT_COPIED = frozenset({"seq", "sig", "call"})  # of a tool line copied from another run


def signing_key(cassette: Cassette, keyring: Keyring) -> bytes:
    """The key a continuation of ``cassette`` is signed with when none is configured: the
    one it was signed with."""
    key = keyring.get(str(cassette.header.get("key_id")))
    if key is None:
        raise KeyMissing(f"{cassette.path} is signed with key {cassette.header.get('key_id')}, "
                         "which is not available (DEJA_KEY, the key file or DEJA_OLD_KEYS)")
    return key


def scope(make: Callable[[], ContinuationSession], *, abandon_on_divergence: bool,
          name: str) -> session.Scope[ContinuationSession]:
    """A fork or a resume around a block: ``make`` writes what must come first and returns
    the session. With ``abandon_on_divergence`` (resume) an agent that no longer matches its
    own log leaves the cassette as it was, with no end line, to be resumed by a fixed agent."""
    def close(continued: ContinuationSession, exc: BaseException | None) -> None:
        if isinstance(exc, Divergence) and abandon_on_divergence:
            continued.abandon()
        else:
            continued.close(error=exc)

    def open_() -> ContinuationSession:
        made = make()
        try:
            return made.start()
        except BaseException:  # it never started: nothing of it is written
            made.unstarted()
            raise

    return session.Scope(open_, close, name=name)


class ContinuationSession(RecordSession):
    """Serve ``prefix``, then record live into ``writer`` (after ``then_replay``, if any,
    or whatever ``sources`` answer as if live)."""

    def __init__(self, prefix: Cassette, writer: CassetteWriter, *,
                 on_live: Callable[[ContinuationSession], None] | None = None,
                 on_leave: Callable[[ContinuationSession], None] | None = None,
                 then_replay: Cassette | None = None, sources: Sequence[Source] = (),
                 mode: str = "fork", tool_policy: ToolPolicy | None = None,
                 recorded_runs: Sequence[Cassette] = (), resend: Iterable[str] = (),
                 under_way_in: Cassette | None = None, **kwargs: Any) -> None:
        # The run keeps the guards it was recorded with (its header); counters carry over
        # from the prefix once the guard exists (start).
        recorded = prefix.header
        budgets = recorded.get("budgets")
        if budgets is not None:
            kwargs.setdefault("budgets", Budgets(**budgets))
        kwargs.setdefault("loop_guard", recorded.get("loop"))
        kwargs.setdefault("breaker", recorded.get("breaker"))
        # ...and its redaction rules: the live steps redact (and fingerprint) as the
        # recorded ones did, and as a replay of the whole run will.
        kwargs.setdefault("redaction", Redaction.from_header(recorded.get("redact")))
        super().__init__(writer.path, run_id=writer.header["run"], writer=writer, **kwargs)
        self.mode = mode  # "fork" or "resume" (recorder.mode())
        self.prefix = ReplaySession(prefix, until_used_up=True)
        after = [ReplaySession(then_replay, copies=True)] if then_replay is not None else []
        # who answers a call, in order; what none answers goes out live
        self.sources: tuple[Source, ...] = (self.prefix, *after, *sources)
        self.live = False
        self._on_live = on_live
        self._on_leave = on_leave  # called once, when a log that passes a miss on closes
        # what a tool call none of them answers does (None: it runs, as in a recording)
        self.tool_policy = tool_policy
        self._recorded = RecordedTools(recorded_runs or (prefix,)) if tool_policy else None
        self.policy_calls: list[dict[str, Any]] = []  # the calls it answered, for a report
        # the tool bodies run live while the prefix is still served (a side effect a
        # resume settled as not done): what they call goes live, not to the prefix
        self._live_bodies: set[str] = set()
        for obs in prefix.observations:
            self._count(obs)
        # tool calls under way where the prefix (or the log a replay-then-live serves) ends,
        # with side effects made inside them
        logged = under_way_in or prefix
        lines, next_number = call_lines(logged.observations)
        self._under_way = UnderWay(lines, logged.header.get("features") or ())
        self._tool_calls = itertools.count(next_number)  # a new body's id never repeats one
        # destructive MCP calls sent with no answer logged (seqs, by fingerprint), and the
        # tools that may be sent or run again when the run stopped inside them (--resend)
        self._in_flight = mcp_in_flight(lines)
        self.resend = frozenset(resend)

    consults_log = True

    def unstarted(self) -> None:
        """A session whose :meth:`start` failed stops and lets its cassette go: a resumed
        one as it was found (:meth:`CassetteWriter.undo_reopen`), a fork's removed (nothing
        of the program ran)."""
        self._stop()
        if self.writer is not None:
            self.writer.discard()

    def writing_live(self) -> bool:
        return not self.serving  # the prefix is served, not written

    def start(self, *, intercept: bool = True) -> ContinuationSession:
        super().start(intercept=intercept)
        assert self.guard is not None
        for obs in self.prefix.cassette.observations:
            self.guard.absorb(obs)
        self.guard.absorbed()
        return self

    # -- bookkeeping

    def _count(self, obs: Mapping[str, Any]) -> None:
        add_step(self.totals, obs)  # the rule a cassette's totals are counted by

    @property
    def serving(self) -> bool:
        """Still serving the prefix (switches to live the moment it is used up)."""
        if not self.live and not self.prefix.open:
            self.go_live()
        return not self.live

    def go_live(self) -> None:
        if self.live:
            return
        self.live = True
        self.prefix.stop_progress()
        log.info("run %s: recorded prefix served (%d steps); going live", self.run_id,
                 len(self.prefix.index.used))
        self._first_live_line()

    def _first_live_line(self) -> None:
        """What comes before the run's first line made live (a resume's ``resumed``
        control line), once: when it goes live, or when it settles a side effect while
        its prefix is still served."""
        on_live, self._on_live = self._on_live, None
        if on_live is not None:
            on_live(self)

    def end_line(self, status: str | None = None,
                 error: BaseException | None = None) -> dict[str, Any]:
        self.serving  # noqa: B018 (a prefix used up by the last call: the run went live)
        end = super().end_line(status, error)
        end["totals"]["replayed"] = replayed_totals(self.prefix.cassette.observations)
        return end

    def _asked(self) -> tuple[Source, ...]:
        """The sources a call is offered to now: the prefix alone while it lasts (none to
        a call made inside a body run live meanwhile), then those that copy and are
        still open."""
        if self.serving:
            return () if current_body() in self._live_bodies else (self.prefix,)
        return tuple(s for s in self.sources if s.copies and s.open)

    # -- calls

    def begin_http(self, request: HttpRequest) -> HttpResponse | None:
        if mcp.carries(request.url):  # an MCP server's own traffic: its requests were served
            return None
        found = self._from_sources(lambda: RecordSession.begin_http(self, request),
                                   lambda source: source.answer_http(request))
        if found is not None:
            return found[0].response_of(found[1])
        return super().begin_http(request)

    def _from_sources(self, guard: Callable[[], Any],
                      answer: Callable[[Source], Mapping[str, Any] | None]
                      ) -> tuple[Source, Mapping[str, Any]] | None:
        """The first source that answers a call (``answer``), and its line; a source that
        copies logs the line, and the guards see the call as a live one (``guard``)."""
        for source in self._asked():
            # The guards see a call served as if live before it is matched, as a live one
            # is before it is sent (a clamped max_tokens is what the source matches); a
            # source that may pass the call on to live is asked first, so they see it once.
            early = source.copies and not source.passes
            if early:
                guard()
            obs = answer(source)
            if obs is None:
                self._passed(source)
                continue
            if source.copies:
                if not early:
                    guard()
                self._log_copied(source, obs)
            return source, obs
        return None

    def _passed(self, source: Source) -> None:
        """A source passed a call on: if that closed it (a log that passes its first miss
        on), the run has left it (a replay-then-live's fork point)."""
        if source.passes and not source.open and self._on_leave is not None:
            leave, self._on_leave = self._on_leave, None
            leave(self)

    def leave(self, source: ReplaySession, divergence: DivergenceInfo) -> None:
        """Leave ``source`` (a log that passes its first miss on) at a miss found outside
        it, as if the log had missed there: the recording proxy's, a tool result the agent
        sent other than the recorded one, which no call asks the log for."""
        if source.divergence is None:
            source.divergence = divergence
        source.missed = True
        self._passed(source)

    def _log_copied(self, source: Source, obs: Mapping[str, Any]) -> None:
        """Log an observation served from ``source`` as if it had come from the network."""
        copy = {k: v for k, v in obs.items() if k not in ("seq", "sig", "request")}
        if obs["kind"] == Kind.MODEL:
            self.append_line(copy, request_body=source.request_body(obs["seq"]),
                             has_request=True)
        else:
            if "request" in obs:
                copy["request"] = obs["request"]
            self.append_line(copy)
        self._count(obs)

    def decide(self, tool: session.ToolSpec, args: dict[str, Any]) -> Decision:
        """Answer a tool call from the prefix while it lasts (settling the intent it ends
        inside, if any), then from the sources that copy, else run it live. A side effect
        a body run again had made before the run stopped is answered from that first."""
        with self._for_a_person():
            made = self._made(tool.name, args, tool.side_effect)
            if made is not None:
                return self._made_before(tool, args, *made)
            return self._decide(tool, args)

    def _made(self, name: str, args: dict[str, Any], side_effect: bool
              ) -> tuple[Mapping[str, Any], Mapping[str, Any] | None] | None:
        """What a call made in a body run again stands for, made by the call under way it
        runs again (:mod:`replayer.under_way`); a body bound by this call says so first
        (a ``continues`` line: what it makes from here counts as that call's)."""
        if not self._under_way:
            return None
        made = self._under_way.take(current_body(), name, digest(
            ["tool", name, self._lines.args_key(args)]), side_effect)
        if made is None:
            return None
        line, outcome, bound = made
        if bound is not None:
            self.log_control(Control.CONTINUES, {"call": bound})
        return line, outcome

    def _decide(self, tool: session.ToolSpec, args: dict[str, Any]) -> Decision:
        for source in self._asked():
            early = source.copies and not source.passes  # the guards first, as for HTTP
            if early:
                self.before_tool(tool, args)
            obs = source.answer_tool(tool, args)
            if obs is None:
                self._passed(source)
                continue
            if source.copies:
                if not early:
                    self.before_tool(tool, args)
                return Decision.answer(self._copied_tool(source, tool, obs))
            if obs["kind"] == Kind.INTENT and source.outcome_of(obs) is None:
                return self._unfinished(tool, args, obs)
            return Decision.answer(source.tool_value(tool, obs))
        return self._by_policy(tool, args)

    def _by_policy(self, tool: session.ToolSpec, args: dict[str, Any]) -> Decision:
        """A live call under the tool policy: run, or answered (recorded, static) or
        refused without running, logged with its rule (:mod:`replayer.tool_policy`)."""
        answered = self._policy(tool, args)
        if answered is None:
            return Decision.run()
        rule, answer = answered
        if isinstance(answer.get("refused"), ToolRefused):
            raise answer["refused"]
        if "error" in answer:
            raise rebuild_error(tool.name, answer["error"])
        value = rule.value if rule.rule is Rule.STATIC else _values.decode(answer.get("result"))
        return Decision.answer(tool.decode(value) if tool.decode else value)

    def _policy(self, tool: session.ToolSpec, args: dict[str, Any],
                shape: Callable[[Any], Any] = lambda value: value,
                extra: Mapping[str, Any] | None = None
                ) -> tuple[ToolRule, Mapping[str, Any]] | None:
        """What the tool policy does with a live call: None to run it; else its rule and
        the answer, logged as the tool's line with the rule (``shape``: a static value as
        the tool returns it; ``extra``: more of the line). A refusal's answer holds the
        error to raise, ``refused``."""
        if self.tool_policy is None or self._recorded is None:
            return None
        rule = self.tool_policy.rule_for(tool.name, side_effect=tool.side_effect)
        if rule.rule is Rule.LIVE:
            return None
        key = self._lines.args_key(args)
        self.before_tool(tool, args, key)  # the guards see it as they see a live call
        served = self._recorded.take(tool.name, key) if rule.rule is Rule.RECORDED else None
        if served is not None:
            cassette, answer = served
            self._policy_line(tool, args, Rule.RECORDED, {k: answer[k] for k in
                                                         ("result", "error") if k in answer},
                              source={"run": cassette.run, "seq": answer["seq"]}, extra=extra)
            return rule, answer
        if rule.rule is Rule.STATIC:
            static = {"result": _values.encode(shape(rule.value), where=f"static result of "
                                               f"tool {tool.name!r}")}
            self._policy_line(tool, args, Rule.STATIC, static, extra=extra)
            return rule, static
        why = ("it has side effects and is never run live here unless named"
               if tool.side_effect else "the tool policy refuses it")
        refused = ToolRefused(
            f"tool {tool.name!r} was not run: {why} (--live-tool {tool.name} runs it; "
            f"{tool.name}=static:JSON answers it)", tool=tool.name)
        error = {"error": self._lines.error(refused)}
        self._policy_line(tool, args, Rule.REFUSE, error, extra=extra)
        return ToolRule(Rule.REFUSE), {**error, "refused": refused}

    def _policy_line(self, tool: session.ToolSpec, args: dict[str, Any], rule: Rule,
                     answer: dict[str, Any], source: dict[str, Any] | None = None,
                     extra: Mapping[str, Any] | None = None) -> None:
        """Log a call the tool policy answered as the tool's line, marked with its rule."""
        obs, _ = self._lines.tool(tool, args, round(time.time(), 3), 0.0, result=None,
                                  error=None, intent=None, step=-1)
        obs.pop("result", None)
        obs.update(extra or {})
        obs.update(answer, policy=rule.value)
        if source is not None:
            obs["from"] = source
        line = self.append_line(obs, sync=tool.side_effect)
        self._count(obs)
        self.policy_calls.append({"seq": line["seq"], "tool": tool.name, "rule": rule.value,
                                  **({"from": source} if source else {})})

    # -- MCP requests (recorder.capture.mcp)

    def mcp_answer(self, call: mcp.McpCall) -> mcp.McpReply | None:
        """An MCP request: served from the prefix while it lasts (then by a source that
        copies), else sent to its server, a tool call under the tool policy (a tool its
        server annotated ``destructiveHint: true`` is a side effect)."""
        with self._for_a_person():
            if call.tool is not None:
                made = self._made(call.tool, call.arguments, call.destructive)
                if made is not None:  # made by the call under way this body runs again
                    return mcp.reply_of(made[0])
            return self._mcp_answer(call)

    def _mcp_answer(self, call: mcp.McpCall) -> mcp.McpReply | None:
        found = self._from_sources(
            lambda: RecordSession.mcp_answer(self, call),
            lambda source: source.answer_mcp(call) if isinstance(source, mcp.McpSource)
            else None)
        if found is not None:
            return mcp.reply_of(found[1])
        if call.tool is not None and call.destructive:
            self._not_in_flight(call)
        answered = None if call.tool is None else self._policy(
            call.spec(), call.arguments, mcp.tool_result, {"mcp": {
                "server": mcp.server_record(call.server, self.redaction),
                "method": call.method}})
        if answered is None:
            return super().mcp_answer(call)
        return mcp.reply_of({**answered[1], "kind": Kind.TOOL.value})

    def _not_in_flight(self, call: mcp.McpCall) -> None:
        """A destructive MCP tool call about to be sent live that the prefix shows in
        flight (its ``sending`` line without its tool line: the run stopped before the
        server's answer was logged) is not sent again, unless the tool is named to be
        (``resend``): whether it took effect is unknown and no settle function can tell."""
        assert call.tool is not None
        fp = digest(["tool", call.tool, self._lines.args_key(call.arguments)])
        sent = self._in_flight.get(fp)
        if not sent:
            return
        seq = sent.pop(0)
        if call.tool in self.resend:
            log.warning("run %s: MCP tool %r (sent at step %s, no answer logged) is sent "
                        "again, as asked", self.run_id, call.tool, seq)
            return
        raise NeedsAttention(
            f"run {self.run_id}: destructive MCP tool {call.tool!r} was sent to its server "
            f"at step {seq} and the run stopped before its answer was logged; whether it "
            "took effect is unknown, so it is not sent again. Check on the server, then "
            f"resume with --resend {call.tool} to send it again, or fork at a step before "
            f"{seq}", reason="unsettled_intent", detail={"seq": seq, "tool": call.tool})

    def _unfinished(self, tool: session.ToolSpec, args: dict[str, Any],
                    obs: Mapping[str, Any]) -> Decision:
        """A side effect whose intent the prefix holds, and not its outcome. A resume
        settles it (the run stopped inside it) and goes on serving the rest of its
        prefix: a call that ran beside it and finished is answered from its outcome,
        never run again. Any other continuation (a fork, a replay-then-live) stops for a
        person: its prefix ends where the other run went on, the side effect finished
        there or was given up, and this run can tell neither."""
        if self.mode == "resume":
            self._first_live_line()
            return self._settle(tool, args, obs)
        raise NeedsAttention(
            f"run {self.run_id}: side-effecting tool {tool.name!r} was under way at step "
            f"{obs['seq']} where this run's recorded steps end, with no outcome among them; "
            "it is not run again and its effect is not guessed. Fork at a step before its "
            "intent or after its outcome", reason="unsettled_intent",
            detail={"seq": obs["seq"], "tool": tool.name})

    def _settle(self, tool: session.ToolSpec, args: dict[str, Any],
                obs: Mapping[str, Any]) -> Decision:
        """Ask the tool's settle function whether the intent ``obs`` took effect: its
        result is logged as the outcome, or the body runs with the intent's key, or the
        run stops for a person (:class:`NeedsAttention`)."""
        key = f"{self.run_id}:{obs['seq']}"
        intent = Intent(run=self.run_id, seq=obs["seq"], name=tool.name,
                        args=_values.decode(obs.get("args")), key=key)
        if tool.settle is None and tool.name in self.resend:
            log.warning("intent seq %s of %s, which has no settle function, is run again "
                        "with its key, as asked", obs["seq"], tool.name)
            return Decision.run((obs["seq"], key))
        if tool.settle is None:
            raise NeedsAttention(
                f"run {self.run_id}: side-effecting tool {tool.name!r} was running when the "
                f"run stopped (intent seq {obs['seq']}, key {key}) and has no settle "
                "function, so whether it took effect is unknown. Check by the key, then "
                f"give the tool settle=, or resume with --resend {tool.name} to run it "
                "again with the same key", reason="unsettled_intent",
                detail={"seq": obs["seq"], "key": key, "tool": tool.name})
        verdict = tool.settle(intent)
        if not isinstance(verdict, Settled):
            raise NeedsAttention(f"settle function of {tool.name!r} returned {verdict!r}, not "
                                 "a recorder.Settled", reason="bad_settle",
                                 detail={"seq": obs["seq"], "key": key})
        log.info("intent seq %s of %s settled: %s", obs["seq"], tool.name, verdict.state)
        if verdict.state == Effect.DONE:
            now = time.perf_counter()
            self.log_tool(tool, args, time.time(), now, result=verdict.result,
                          intent=(obs["seq"], key))
            return Decision.answer(verdict.result)
        if verdict.state == Effect.NOT_DONE:
            return Decision.run((obs["seq"], key))
        raise NeedsAttention(
            f"run {self.run_id}: cannot tell whether {tool.name!r} (intent seq {obs['seq']}, "
            f"key {key}) took effect: {verdict.reason}", reason="unsettled_intent",
            detail={"seq": obs["seq"], "key": key, "tool": tool.name, "why": verdict.reason})

    def _made_before(self, tool: session.ToolSpec, args: dict[str, Any],
                     made: Mapping[str, Any], outcome: Mapping[str, Any] | None
                     ) -> Decision:
        """A call made inside a tool call under way when the run stopped, met again as
        that call's body runs again (:mod:`replayer.under_way`): a side effect answered
        from its outcome, or settled as the intent a run stopped inside; a tool call with
        side effects inside it answered from its line."""
        log.info("run %s: %s (step %s) was made inside a tool call under way when the run "
                 "stopped: not made again", self.run_id, tool.name, made["seq"])
        if made["kind"] == Kind.INTENT and outcome is None:
            self._first_live_line()
            return self._settle(tool, args, made)
        return Decision.answer(self.prefix.tool_value(tool, outcome or made))

    def _enter_tool(self, tool: session.ToolSpec, call: str,
                    intent: tuple[int, str] | None) -> Any:
        bound = None
        if self._under_way:
            bound = self._under_way.bind(tool.name, call, intent[0] if intent else None,
                                         tool.side_effect)
            if bound is not None and self.mode != "resume":
                error = NeedsAttention(
                    f"run {self.run_id}: tool call {bound.id} was under way where this "
                    f"run's recorded steps end, and had made side effects inside it (step "
                    f"{bound.made[0][0]['seq']}); its body is not run again. "
                    "Resume the run, or fork at a step before the call",
                    reason="unsettled_intent", detail={"tool": tool.name, "call": bound.id})
                self._attention.append(error)
                raise error
        token = super()._enter_tool(tool, call, intent)
        if self.serving:  # a body run live before the prefix is used up
            self._live_bodies.add(call)
        if bound is not None and intent is not None:  # a side effect's body, run again
            self.log_control(Control.CONTINUES, {"call": bound.id})
        return token

    def call_tool(self, tool: session.ToolSpec, args: dict[str, Any],
                  run: Callable[[str | None], Any]) -> Any:
        decision = self.decide(tool, args)
        if decision.action is Action.ANSWER:
            return decision.value
        return self.run_tool(tool, args, run, intent=decision.key)

    async def call_tool_async(self, tool: session.ToolSpec, args: dict[str, Any],
                              run: Callable[[str | None], Any]) -> Any:
        decision = self.decide(tool, args)
        if decision.action is Action.ANSWER:
            return decision.value
        return await self.run_tool_async(tool, args, run, intent=decision.key)

    def _copied_tool(self, source: Source, tool: session.ToolSpec,
                     obs: Mapping[str, Any]) -> Any:
        """Log a tool call served from ``source`` as a live call would be; its value.

        A side effect is logged as a live one is: its intent, then its outcome pointing at
        this run's intent seq, both forced to disk.
        """
        outcome = source.outcome_of(obs) if obs["kind"] == Kind.INTENT else None
        if obs["kind"] == Kind.INTENT and outcome is None:
            # The other run stopped inside this side effect: nothing to copy, nothing known.
            raise source.unsettled(tool, obs)
        side_effect = outcome is not None
        # a ``call`` names the other run's body, whose lines are not copied: it is left out
        line = self.append_line({k: v for k, v in obs.items() if k not in _NOT_COPIED},
                                sync=side_effect)
        if outcome is not None:
            copy = {k: v for k, v in outcome.items() if k not in _NOT_COPIED}
            copy["intent"] = line["seq"]
            # The key stays the other run's (``<its run>:<its intent seq>``), not this run's
            # ``<run>:<seq>``: the body ran once, in the other run, and presented that key to
            # the system it changed (the copied result may well contain it). A lookup by key
            # must find that effect; a key minted here was never sent anywhere, and checking
            # by it would report the effect as not done and invite running it again.
            self.append_line(copy, sync=True)
            self._count(outcome)
        else:
            self._count(obs)
        return source.tool_value(tool, obs)  # the recorded value, or its recorded error

    def effect(self, name: str, produce: Callable[[], Any]) -> Any:
        site = call_site()
        for source in self._asked():
            obs = source.answer_effect(name, site)
            if obs is None:
                self._passed(source)
                continue
            if source.copies:
                # Logged as if live: with this run's call site, and the recorded value or
                # refusal as stored there.
                line: dict[str, Any] = {"kind": Kind.EFFECT.value, "name": name}
                line.update({k: obs[k] for k in ("value", "error") if k in obs})
                if site is not None:
                    line["site"] = site.record()
                self.append_line(line)
                self._count(obs)
            return source.effect_value(obs)
        return self.log_effect(name, produce(), site)
