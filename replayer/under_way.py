"""Tool calls under way where a log ends, and the side effects their bodies had made.

A tool body's lines are marked ``within`` its call (``name#n``). In a cassette with the
``tool_calls`` feature the tool's own line, or its outcome, names the call (``call``)
once the body is done, and a side effect's intent names the call it opens: a call that
lines are within and that no tool line or outcome names was still running when the run
stopped. A side effect here is an intent (``side_effect=True``) or a destructive MCP tool
call.

A resume runs such a body again when the program calls the tool again: a plain tool has
no intent to settle, and a side effect settled as not done runs its body again. A side
effect the body had already made must not be made twice. While the body runs again, a
call it makes is matched to what the call under way had made: a side effect's intent
(answered from its outcome, or settled as any intent a run stopped inside when it has
none), a destructive MCP call (answered from its line) or a tool call that had finished
with side effects somewhere inside its own body (answered from its line, its body not
run). Each is matched once, by name and arguments; a call of the same tool with other
arguments, or any side effect while some of what it had made is not met yet, stops the
run for a person (it may be the same effect, changed), and any other call runs.

Which new body is which call under way: a side effect's by its intent (exact); a plain
tool's line is written only when its body ends, so a plain tool's body run again is bound
by the first call it makes that a call under way of the same tool had made (two calls of
``checkout`` under way, each paying its own cart, tell apart so). Once bound, the body
writes a ``continues`` control line naming the call it runs again: the new body's lines,
and the line that ends it, then count as that call's, so a resume of the resume (or a
fork of it) sees one call, with all it made, ended or not. A replay-then-live or a fork
never runs such a body again: its log ends where the other run went on, and it stops for
a person when the body would start.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from recorder.cassette.lines import Lines
from recorder.cassette.schema import Control, Kind
from recorder.errors import NeedsAttention


@dataclass
class _Call:
    """One call under way that had made side effects: its id, its tool, and what it had
    made (intents with their outcomes, None when the run stopped inside that side effect
    too; tool lines) that the body run again has not met yet."""

    id: str
    name: str
    made: list[tuple[Mapping[str, Any], Mapping[str, Any] | None]] = field(
        default_factory=list)


def number(call: Any) -> int:
    """The ``n`` of a call id ``name#n`` (-1 when it is none)."""
    if not isinstance(call, str):
        return -1
    digits = call.rpartition("#")[2]
    return int(digits) if digits.isdigit() else -1


def is_side_effect(obs: Mapping[str, Any]) -> bool:
    """An intent, or the line of a destructive MCP tool call."""
    if obs.get("kind") == Kind.INTENT:
        return True
    mcp = obs.get("mcp")
    return obs.get("kind") == Kind.TOOL and isinstance(mcp, Mapping) \
        and mcp.get("destructive") is True


_READ = frozenset({Kind.TOOL, Kind.INTENT, Kind.OUTCOME, Kind.CONTROL})


def call_lines(observations: Sequence[Mapping[str, Any]]
               ) -> tuple[list[Mapping[str, Any]], int]:
    """The lines of a log that say anything of its tool calls (tool, intent, outcome
    and control lines: of a loaded cassette, no other line is restored, a model line's
    ``within`` read from its head), and the number past every call id in it."""
    lines: list[Mapping[str, Any]]
    if isinstance(observations, Lines):
        heads = observations.heads
        lines = [observations[h.seq] for h in heads if h.kind in _READ]
        top = max((number(h.within) for h in heads), default=-1)
    else:
        lines = [o for o in observations if o.get("kind") in _READ]
        top = max((number(o.get("within")) for o in observations), default=-1)
    return lines, max([top, *(number(o.get("call")) for o in lines)]) + 1


class CallTree:
    """The tool calls of a log with the ``tool_calls`` feature: each body run again under
    the id of the call it continues (:meth:`root`), where each call ended (``closed``, the
    seq of its line), the call each was made inside (``parent``; None at the top) and the
    calls inside which a side effect was made, at any depth (``marked``)."""

    def __init__(self, observations: Iterable[Mapping[str, Any]]) -> None:
        self._alias: dict[str, str] = {}
        lines = list(observations)
        for obs in lines:
            if obs.get("kind") == Kind.CONTROL and obs.get("event") == Control.CONTINUES:
                detail, within = obs.get("detail") or {}, obs.get("within")
                if isinstance(within, str) and isinstance(detail.get("call"), str):
                    self._alias[within] = detail["call"]
        self.closed: dict[str, int] = {}
        self.parent: dict[str, str | None] = {}
        inside: list[str] = []
        for obs in lines:
            call, within = self.root(obs.get("call")), self.root(obs.get("within"))
            if call is not None:
                self.parent.setdefault(call, within)
                if obs.get("kind") in (Kind.TOOL, Kind.OUTCOME):
                    self.closed[call] = obs["seq"]
            if within is not None and is_side_effect(obs):
                inside.append(within)
        self.marked: set[str] = set()
        for found in inside:
            current: str | None = found
            while current is not None and current not in self.marked:
                self.marked.add(current)
                current = self.parent.get(current)

    def root(self, call: Any) -> str | None:
        """The call a body's id stands for: itself, or the call it continues."""
        if not isinstance(call, str):
            return None
        seen = {call}
        while call in self._alias and self._alias[call] not in seen:
            call = self._alias[call]
            seen.add(call)
        return call


class UnderWay:
    """The calls under way in a log (its :func:`call_lines`; none unless ``features`` name
    ``tool_calls``) that had made side effects, and the bodies run again bound to them."""

    def __init__(self, observations: Sequence[Mapping[str, Any]],
                 features: Iterable[str]) -> None:
        self._calls: dict[str, _Call] = {}
        self._opened: dict[int, str] = {}  # intent seq -> the call under way it opened
        self._bound: dict[str, _Call] = {}  # a body run again -> the call it stands for
        self._pending: dict[str, str] = {}  # a plain tool's body run again, not bound yet
        self._lock = threading.Lock()
        if "tool_calls" in set(features):
            self._find(observations)

    def _find(self, observations: Sequence[Mapping[str, Any]]) -> None:
        tree = CallTree(observations)
        outcomes = {o["intent"]: o for o in observations if o.get("kind") == Kind.OUTCOME}
        for obs in observations:
            within, kind = tree.root(obs.get("within")), obs.get("kind")
            if within is None or within in tree.closed or within not in tree.marked:
                continue
            if kind == Kind.INTENT:
                made = (obs, outcomes.get(obs["seq"]))
            elif kind == Kind.TOOL and (is_side_effect(obs) or tree.root(obs.get("call"))
                                        in tree.marked):
                made = (obs, None)
            else:
                continue
            self._calls.setdefault(within, _Call(within, within.rpartition("#")[0])) \
                .made.append(made)
        for obs in observations:
            call = tree.root(obs.get("call"))
            if obs.get("kind") == Kind.INTENT and call in self._calls:
                self._opened[obs["seq"]] = call

    def __bool__(self) -> bool:
        return bool(self._calls or self._bound or self._pending)

    def bind(self, name: str, body: str, intent: int | None, side_effect: bool) -> _Call | None:
        """The call under way the body ``body`` of tool ``name`` may run again, if any: a
        side effect's, by its ``intent`` seq, is bound to it now; a plain tool's is bound
        by the first call the body makes that the call under way had made (:meth:`take`)
        and here is the first still unbound."""
        with self._lock:
            if intent is not None:
                id_ = self._opened.pop(intent, None)
                found = self._calls.pop(id_, None) if id_ is not None else None
                if found is not None:
                    self._bound[body] = found
                return found
            if side_effect:  # a side effect made afresh: a new call, bound to none
                return None
            found = next((c for c in self._calls.values() if c.name == name), None)
            if found is not None:
                self._pending[body] = name
            return found

    def take(self, body: str | None, name: str, fp: str, side_effect: bool
             ) -> tuple[Mapping[str, Any], Mapping[str, Any] | None, str | None] | None:
        """What a call of tool ``name`` whose fingerprint (name and arguments) is ``fp``,
        made in the body ``body`` run again, stands for: an intent and its outcome, or a
        tool line, and the call under way the body was bound to by this call (None: it was
        bound before). None: nothing the call under way had made, or no such body.

        While what the call under way had made is not all met, a call that is none of it
        is refused (NeedsAttention) when it might be one of them changed: a call of the
        same tool with other arguments, or any side effect (the body may make it another
        way now). Other calls run."""
        if body is None:
            return None
        with self._lock:
            found = self._bound.get(body)
            candidates = [found] if found is not None else [
                c for c in self._calls.values() if c.name == self._pending.get(body)]
            for call in candidates:
                match = next((i for i, (line, _) in enumerate(call.made)
                              if line.get("name") == name and line.get("fp") == fp), None)
                if match is not None:
                    bound = None
                    if found is None:  # a plain tool's body, bound by its first match
                        del self._pending[body]
                        self._bound[body] = self._calls.pop(call.id)
                        bound = call.id
                    line, outcome = call.made.pop(match)
                    return line, outcome, bound
            for call in candidates:
                if call.made and (side_effect or any(line.get("name") == name
                                                     for line, _ in call.made)):
                    raise self._not_made_before(call, name)
            return None

    @staticmethod
    def _not_made_before(call: _Call, name: str) -> NeedsAttention:
        made = ", ".join(f"{line.get('name')} (step {line['seq']})" for line, _ in call.made)
        return NeedsAttention(
            f"tool call {call.id} was under way when the run stopped, and had made these "
            f"calls with side effects inside it: {made}. Run again, its body calls {name!r}, "
            "which is not one of them with the same arguments, and that call is not run: "
            "it may be one of them made another way. Check whether those effects were made, "
            "then resume a program that makes the same calls, or record the run afresh",
            reason="unsettled_intent",
            detail={"seq": call.made[0][0]["seq"], "tool": name, "call": call.id})


def mcp_in_flight(observations: Iterable[Mapping[str, Any]]) -> dict[str, list[int]]:
    """The destructive MCP tool calls a log shows sent and never answered: the seq of each
    ``sending`` line, by the call's fingerprint, that no tool line of the same fingerprint
    followed."""
    sent: dict[str, list[int]] = {}
    for obs in observations:
        kind = obs.get("kind")
        if kind == Kind.CONTROL and obs.get("event") == Control.SENDING:
            fp = (obs.get("detail") or {}).get("fp")
            if isinstance(fp, str):
                sent.setdefault(fp, []).append(obs["seq"])
        elif kind == Kind.TOOL and isinstance(obs.get("mcp"), Mapping) \
                and obs.get("fp") in sent and sent[obs["fp"]]:
            sent[obs["fp"]].pop(0)
    return {fp: seqs for fp, seqs in sent.items() if seqs}
