"""Replay, then live, through the proxy: ``deja proxy --replay CASSETTE --then live``.

The run is :mod:`replayer.then_live`'s: a session that copies the recording into a new run
as if live while the agent asks what it asked before, and goes live at the first request
the recording does not hold, into a new cassette whose header names the parent and the
step it left. What the proxy adds is the agent's tools, which it sees only as results in
the agent's next request (:mod:`deja.proxy._tool_steps`):

- while the recording is served, a tool result other than the recorded one is where the
  run leaves it, at that tool's step (a replay through the proxy calls it a divergence
  there); the request that carries it is the first to go live;
- once the run has left, each new result is logged as in a recording. A tool the tool
  policy would not have run live (a ``refuse``, ``static`` or ``recorded`` rule: a proxied
  run does not know which tools have side effects, so only a rule given by name counts)
  ran in the agent all the same: the proxy cannot stop an agent's own tool. It says so,
  and for a ``static`` or ``recorded`` rule it gives the model the policy's answer in place
  of the agent's result, in that request and every later one, as a fork puts its edit;
  the tool's line holds that answer, marked with its rule (and, for ``recorded``, the step
  it came from), so that a replay of the new run puts it in place again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from deja.proxy._tool_steps import Reading, Result, call_of, changed_result
from deja.proxy.runs import ProxyRun, substituted
from recorder.canonical import digest
from recorder.cassette import Cassette
from recorder.cassette.schema import Kind, add_step
from recorder.errors import DivergenceInfo
from recorder.step_lines import StepLines
from replayer.tool_policy import Rule, ToolPolicy, ToolRule

if TYPE_CHECKING:
    from replayer.continuation import ContinuationSession
    from replayer.replay import ReplaySession

__all__ = ["CANNOT_STOP", "AgentTools", "Following", "left_at", "told"]

log = logging.getLogger("deja.proxy")

CANNOT_STOP = "the proxy cannot stop an agent's own tool"
# what marks a tool line whose result the model was given in place of the agent's
MARKS = ("edited", "policy", "from")


class AgentTools:
    """The tool policy of a run's live part (a fork's, a replay-then-live's) over the
    agent's own tools, which the proxy sees only as results: each new result of a tool
    the policy would not have run live is reported, and where its rule has an answer the
    model is given that answer instead (:meth:`take`); the tool's line holds what the model
    was given (:meth:`observe`)."""

    def __init__(self, session: ContinuationSession, parent: Cassette,
                 tools: ToolPolicy) -> None:
        self.session, self.parent, self.tools = session, parent, tools
        self._lines = StepLines(session.redaction, session.prices)
        self._answers: dict[str, list[Mapping[str, Any]]] = {}  # the parent's, by fp
        self.marks: dict[str, dict[str, Any]] = {}  # call id -> what its line is marked
        self.ran: dict[str, dict[str, Any]] = {}  # call id -> the report's row
        recorded: Sequence[Mapping[str, Any]] = parent.observations
        for obs in recorded:
            if obs.get("kind") == Kind.TOOL and "observed" in obs and "result" in obs:
                self._answers.setdefault(str(obs.get("fp")), []).append(obs)

    def attach(self, run: ProxyRun) -> ProxyRun:
        """``run``'s live part is under this policy."""
        run.policy = self
        return run

    def take(self, run: ProxyRun, reading: Reading) -> None:
        """A request's tool results once the run is live: the new ones are put to the
        tool policy (while a fork serves its prefix, none is)."""
        if run.recording is None:
            return
        self._decide_new(run, reading, 0)

    def _decide_new(self, run: ProxyRun, reading: Reading, first: int) -> None:
        for result in reading.results[first:]:
            if result.fresh and result.run_id not in run.logged \
                    and result.run_id not in self.ran:
                self._decide(run, reading, result)

    def rows(self) -> list[dict[str, Any]]:
        """The tools that ran in the agent though the policy would not have run them."""
        return list(self.ran.values())

    def _decide(self, run: ProxyRun, reading: Reading, result: Result) -> None:
        """A new result of a tool the policy would not have run live: reported, and where
        the rule has an answer (and the format a place for it), given to the model."""
        name, args = call_of(run, reading, result)
        rule = self.tools.rule_for(name, side_effect=False)
        if rule.rule is Rule.LIVE:
            return
        row: dict[str, Any] = {"tool": name, "rule": rule.spec(), "call_id": result.run_id}
        self.ran[result.run_id] = row
        answer = self._answer(rule, name, args) if result.placed.slot is not None else None
        if answer is None:
            row["given"] = _AGENTS[rule.rule if result.placed.slot is not None else None]
        else:  # given as the rule says, an error or not, whatever the agent sent
            value, marks = answer
            sent = result.placed.sent
            run.edits[result.run_id] = json.dumps(value, ensure_ascii=False) \
                if isinstance(sent, str) and not isinstance(value, str) else value
            run.edit_errors[result.run_id] = marks["is_error"]
            self.marks[result.run_id] = marks
            row["given"] = "the model was given the static value instead" \
                if rule.rule is Rule.STATIC else \
                f"the model was given the result recorded at step {marks['from']['seq']} instead"
        log.warning("%s", told(row))

    def _answer(self, rule: ToolRule, name: str,
                args: Any) -> tuple[Any, dict[str, Any]] | None:
        """What ``rule`` gives the model for a call of ``name`` with ``args``, and the marks
        of its line, with whether it is an error (a static value is not; a recorded answer
        is if it was); None: nothing (``refuse``, or no recorded answer)."""
        if rule.rule is Rule.STATIC:
            return rule.value, {"policy": Rule.STATIC.value, "is_error": False}
        if rule.rule is not Rule.RECORDED:
            return None
        key = self._lines.args_key(args if isinstance(args, dict) else {"input": args})
        answers = self._answers.get(digest(["tool", name, key]))  # as a line's fp is made
        if not answers:
            return None
        found = answers.pop(0) if len(answers) > 1 else answers[0]  # in order, then the last
        return found.get("result"), {"policy": Rule.RECORDED.value,
                                     "from": {"run": self.parent.run, "seq": found["seq"]},
                                     "is_error": bool(found.get("is_error"))}

    # -- the run's tool lines

    def observe(self, name: str, args: dict[str, Any], result: Any, *, call_id: str,
                is_error: bool, start: float | None, ms: float | None) -> None:
        """Log a tool result the agent sent, as a recording does
        (:meth:`recorder.record.RecordSession.observe_tool`), unless the model was given
        another in its place: then the line holds that one, marked (``policy`` and
        ``from``, or a parent's ``edited``), counted and seen by the guards alike."""
        session = self.session
        assert session.writer is not None
        step = session.writer.next_seq
        if call_id in self.ran:
            self.ran[call_id]["step"] = step
        marks = dict(self.marks.get(call_id) or {})
        if not marks:
            session.observe_tool(name, args, result, call_id=call_id, is_error=is_error,
                                 start=start, ms=ms)
            return
        line = self._lines.observed_tool(name, args, result, call_id=call_id,
                                         is_error=marks.pop("is_error", is_error),
                                         start=start, ms=ms, observed="proxy", step=step)
        line.update(marks)
        session.append_line(line)
        add_step(session.totals, line)
        for interceptor in session.interceptors:
            interceptor.before_tool(name, line["args"])


class Following(AgentTools):
    """A replay-then-live's recording as the proxy follows it for its one run: where the
    run leaves it, what the tool policy gives the model after that, and the report."""

    def __init__(self, session: ContinuationSession, parent: Cassette,
                 tools: ToolPolicy) -> None:
        super().__init__(session, parent, tools)
        # the recording, served while it answers; it passes its first miss on
        self.log = cast("ReplaySession", session.sources[-1])
        self.served_steps: int | None = None  # the new run's steps when it left
        self.live_calls = 0
        recorded: Sequence[Mapping[str, Any]] = parent.observations
        for obs in recorded:  # a result still given in the agent's place is copied so
            call = obs.get("call_id")
            if obs.get("kind") == Kind.TOOL and "observed" in obs and substituted(obs) \
                    and isinstance(call, str):
                self.marks[call] = {k: obs[k] for k in MARKS if k in obs}
                self.marks[call]["is_error"] = bool(obs.get("is_error"))

    def attach(self, run: ProxyRun) -> ProxyRun:
        """``run`` follows this recording: its tool results are compared with the
        recorded ones, and logged anew."""
        run.following = self
        run.remember(self.parent.observations, logged=False)
        return super().attach(run)

    @property
    def serving(self) -> bool:
        """Still in the recording (the agent has asked nothing it does not hold)."""
        return self.log.open

    def take(self, run: ProxyRun, reading: Reading) -> None:
        """A request's tool results, before they are logged and the request answered:
        while the recording is served, the first one other than the recorded result is
        where the run leaves it; from there on, the new ones are put to the tool policy."""
        first = 0
        if self.serving:
            changed = changed_result(run, reading)
            if changed is None:
                return
            first, info = changed
            self.session.leave(self.log, info)
            self._left()
        self._decide_new(run, reading, first)

    def answered(self, served: bool) -> None:
        """The request was answered from the recording (``served``) or sent upstream."""
        if served:
            return
        self.live_calls += 1
        if self.served_steps is None:  # it left at this request
            self._left()

    def _left(self) -> None:
        """The run leaves the recording here: the steps so far were served."""
        assert self.session.writer is not None
        self.served_steps = self.session.writer.next_seq
        info = self.log.divergence
        log.warning("run %s left the recording at %s; live from here", self.session.run_id,
                    left_at(_left_of(info)))
        if info is not None and info.diff:
            log.info("%s", info.diff)

    # -- the end

    def report(self) -> dict[str, Any]:
        """What the run did, once it has ended: the steps served from the recording, where
        it left it, the calls that went live, the new cassette, and the tools that ran in
        the agent though the policy would not have run them."""
        session = self.session
        left = None if self.serving else _left_of(self.log.divergence)
        served = self.served_steps
        if served is None:
            served = session.end["seq"] if session.end is not None else (
                session.writer.next_seq if session.writer is not None else 0)
        return {"parent": str(self.parent.path), "parent_run": self.parent.run,
                "out": str(session.path), "run": session.run_id, "served": served,
                "left": left, "live_calls": self.live_calls,
                "ran_in_agent": self.rows()}


# what the model was given when the rule had no answer for it (None: no place to put one)
_AGENTS: dict[Rule | None, str] = {
    Rule.REFUSE: "the model was given the agent's result",
    Rule.RECORDED: "nothing recorded answers it: the model was given the agent's result",
    Rule.STATIC: "the model was given the agent's result",
    None: "its format has no place for another result: the model was given the agent's result",
}


def _left_of(info: DivergenceInfo | None) -> dict[str, Any]:
    """Where the run left its recording, as the report holds it."""
    if info is None:
        return {"step": None, "kind": Kind.MODEL.value, "category": None,
                "reason": "no reason given"}
    return {"step": info.step, "kind": info.kind, "category": info.category,
            "reason": info.reason}


def left_at(left: Mapping[str, Any]) -> str:
    """Where the run left its recording (a report's ``left``) in words: the step, its kind
    and the kind of change, and why."""
    step = f"step {left['step']}" if left.get("step") is not None else \
        "the end of the recording"
    kind = str(left.get("kind")) + (f", {str(left['category']).replace('_', ' ')}"
                                    if left.get("category") else "")
    return f"{step} ({kind}): {left.get('reason')}"


def told(row: Mapping[str, Any]) -> str:
    """A row of :meth:`Following.report`'s ``ran_in_agent`` as the proxy says it."""
    step = f"step {row['step']}, " if row.get("step") is not None else ""
    return (f"tool {row['tool']} ran in the agent: {CANNOT_STOP} ({step}rule "
            f"{row['rule']}); {row['given']}")
