"""Graded verdicts: how closely each replayed call matched its recording, and what kind of
change a divergence is.

Each call a replay answers is graded:

- ``exact``: its request is the recorded one (the stored fingerprint matched);
- ``equivalent``: it matched only once what the policy declares volatile was renamed,
  left out or rewritten (tool-use ids, a user id, today's date in a prompt); the fields
  that differed are kept, as JSON pointers with ``*`` for a list index
  (:func:`changed_fields`);
- ``diverged``: nothing recorded answers it.

A divergence is named by the kind of change (:class:`Change`): ``different_tool``,
``different_arguments``, ``extra_call`` (the recording has no such call left: a call
made again, or beyond its end), ``missing_call`` (the run ended with recorded calls never
asked for), ``reordered`` (the same turns, blocks or tool calls in another order) or
``changed_request``, which says what changed: the ``model``, the ``prompt`` (the system
prompt or the turns) or ``parameters`` (named). A model request is compared with the
nearest recorded one (:func:`replayer.policy.nearest`), both read as conversations by
their provider, ids renamed and declared-volatile fields left out, so that only a change
in meaning counts.

A run's verdict is ``identical`` (every call exact), ``equivalent`` (some equivalent, none
diverged) or ``diverged``.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from recorder import providers
from recorder.capture import mcp
from recorder.cassette import Cassette
from recorder.cassette.schema import Kind
from recorder.errors import DivergenceInfo
from recorder.providers import conversation
from replayer.diff import unified
from replayer.index import Index, tool_key
from replayer.policy import ReplayPolicy, nearest

__all__ = ["DIVERGED", "EQUIVALENT", "EXACT", "GRADES", "Asked", "Change", "Referee", "Tally",
           "changed_fields", "recorded_request", "request_change", "verdict"]

EXACT, EQUIVALENT, DIVERGED = "exact", "equivalent", "diverged"
GRADES = (EXACT, EQUIVALENT, DIVERGED)


class Change(StrEnum):
    """What kind of change a divergence is."""

    DIFFERENT_TOOL = "different_tool"
    DIFFERENT_ARGUMENTS = "different_arguments"
    EXTRA_CALL = "extra_call"
    MISSING_CALL = "missing_call"
    REORDERED = "reordered"
    CHANGED_REQUEST = "changed_request"


def verdict(divergence: object, grades: Mapping[str, int]) -> str:
    """A run's verdict from its divergence (None: none) and its grades."""
    if divergence is not None:
        return DIVERGED
    return EQUIVALENT if grades.get(EQUIVALENT) else "identical"


def recorded_request(cassette: Cassette, obs: Mapping[str, Any]) -> Any:
    """The recorded request of ``obs``, in the form a divergence diff compares."""
    kind = obs["kind"]
    if kind == Kind.MODEL:
        return cassette.request_of(obs["seq"])
    if kind == Kind.HTTP:
        return {"method": obs["method"], "url": obs["url"], "body": obs["request"]["body"]}
    part = obs.get("mcp")
    if isinstance(part, Mapping) and kind in (Kind.MCP, Kind.TOOL):
        shown = {"server": mcp.label(part["server"])}
        return {**shown, "name": obs["name"], "args": obs["args"]} if kind == Kind.TOOL \
            else {**shown, "method": part["method"], "params": obs.get("params", {})}
    if kind in (Kind.TOOL, Kind.INTENT):
        return {"name": obs["name"], "args": obs["args"]}
    if kind == Kind.EFFECT:
        return {"effect": obs["name"], **({"site": obs["site"]} if "site" in obs else {})}
    return {k: v for k, v in obs.items() if k not in ("sig",)}


# ---------------------------------------------------------------------- fields


_ABSENT = object()


def changed_fields(recorded: Any, actual: Any) -> tuple[str, ...]:
    """Where two requests differ, as JSON pointers with ``*`` for any list index (each
    once, in order): ``/metadata/user_id``, ``/messages/*/content/*/tool_use_id``."""
    found: dict[str, None] = {}

    def walk(a: Any, b: Any, path: tuple[str, ...]) -> None:
        if a is b or a == b:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in dict.fromkeys([*a, *b]):
                name = str(key).replace("~", "~0").replace("/", "~1")
                walk(a.get(key, _ABSENT), b.get(key, _ABSENT), (*path, name))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for x, y in zip(a, b, strict=True):
                walk(x, y, (*path, "*"))
        else:
            found["/" + "/".join(path)] = None

    walk(recorded, actual, ())
    return tuple(found)


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _permuted(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """The same items in another order."""
    return len(a) == len(b) and list(a) != list(b) and \
        sorted(map(_dump, a)) == sorted(map(_dump, b))


def _tools_change(recorded: Any, actual: Any) -> Change | None:
    """How the tool calls and results of two turns differ (None: they do not)."""
    calls = [conversation.tool_calls(turn) for turn in (recorded, actual)]
    names = [[str(call.name) for call in turn] for turn in calls]
    inputs = [[(str(call.name), call.input) for call in turn] for turn in calls]
    if names[0] != names[1]:
        return Change.REORDERED if _permuted(*inputs) else Change.DIFFERENT_TOOL
    if inputs[0] != inputs[1]:
        return Change.DIFFERENT_ARGUMENTS
    results = [[str(r.name) for r in conversation.tool_results(turn) if r.name is not None]
               for turn in (recorded, actual)]
    return Change.DIFFERENT_TOOL if results[0] != results[1] else None


def _turns_change(recorded: Sequence[Any], actual: Sequence[Any]) -> Change | None:
    """A reordering or a tool change among two conversations' turns (None: neither)."""
    if _permuted(recorded, actual):
        return Change.REORDERED
    for theirs, mine in zip(recorded, actual, strict=False):
        if theirs == mine:
            continue
        if _permuted(conversation.blocks(theirs), conversation.blocks(mine)):
            return Change.REORDERED
        found = _tools_change(theirs, mine)
        if found is not None:
            return found
    return None


def request_change(provider: providers.Provider, recorded: Any, actual: Any,
                   urls: tuple[str, str] = ("", "")) -> tuple[Change, tuple[str, ...]]:
    """How model request ``actual`` differs from ``recorded`` (both read as the match reads
    them), and for a changed request what changed: ``model``, ``prompt``, ``parameters:
    <names>``, ``endpoint``. ``urls``: where each was sent."""
    convs = [provider.conversation(recorded), provider.conversation(actual)]
    turns = [conversation.turns(conv) for conv in convs]
    found = _turns_change(*turns)
    if found is not None:
        return found, ()
    changed = []
    models = [provider.request_model(body, url) for body, url in zip((recorded, actual), urls,
                                                                    strict=True)]
    if models[0] != models[1]:
        changed.append("model")
    if turns[0] != turns[1] or conversation.system(convs[0]) != conversation.system(convs[1]):
        changed.append("prompt")
    settings = [conversation.settings(conv) for conv in convs]
    names = [name for name in dict.fromkeys([*settings[0], *settings[1]]) if name != "model"
             and settings[0].get(name, _ABSENT) != settings[1].get(name, _ABSENT)]
    if names:
        changed.append("parameters: " + ", ".join(names))
    if not changed and urls[0] != urls[1]:
        changed.append("endpoint")
    return Change.CHANGED_REQUEST, tuple(changed)


# ---------------------------------------------------------------------- the tally


class Tally:
    """A replay's counts: its calls by grade, its divergences by kind, and the fields each
    equivalent call differed in. Calls may come from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.grades: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.equivalent: list[dict[str, Any]] = []

    def exact(self) -> None:
        with self._lock:
            self.grades[EXACT] += 1

    def equivalent_call(self, seq: int, fields: Sequence[str]) -> None:
        with self._lock:
            self.grades[EQUIVALENT] += 1
            self.equivalent.append({"step": seq, "fields": list(fields)})

    def diverged(self, change: Change, calls: int = 1) -> None:
        """``calls`` more divergences of kind ``change`` (missing calls are not replayed
        calls: they count among the kinds only)."""
        with self._lock:
            if change is not Change.MISSING_CALL:
                self.grades[DIVERGED] += calls
            self.kinds[change] += calls

    def summary(self) -> tuple[dict[str, int], dict[str, int], tuple[dict[str, Any], ...]]:
        """(grades, kinds, equivalent calls): every grade and kind named, zero or not."""
        with self._lock:
            return ({grade: self.grades[grade] for grade in GRADES},
                    {str(change): self.kinds[change] for change in Change},
                    tuple(sorted(self.equivalent, key=lambda e: e["step"])))


# ---------------------------------------------------------------------- judging a miss


@dataclass(frozen=True)
class Asked:
    """A call nothing recorded answers: its family (``net``, ``tool``, ``effect``), the
    request as the diff shows it, and for a model or HTTP call how the match reads it
    (its provider, URL, method and key under the policy)."""

    family: str
    actual: Any
    kind: str = ""
    provider: str | None = None
    method: str = "POST"
    url: str = ""
    key: str | None = None


@dataclass(frozen=True)
class _Judgement:
    change: Change
    changed: tuple[str, ...] = ()
    nearest: Mapping[str, Any] | None = None
    fields: tuple[str, ...] = ()
    sentence: str | None = None


class Referee:
    """Grades a replay's calls and names its divergences, for one cassette, its index and
    its policy."""

    def __init__(self, cassette: Cassette, index: Index, policy: ReplayPolicy) -> None:
        self.cassette, self.index, self.policy = cassette, index, policy
        self.line_key: Callable[[Mapping[str, Any]], str] = policy.line_key(cassette.requests)
        # what the nearest request is ranked on: the policy's own rules and the ids, not the
        # fields the providers declare, which the report still names when they differ
        self._shown = replace(policy, providers=False)

    def equivalent_fields(self, obs: Mapping[str, Any], actual: Any) -> tuple[str, ...]:
        """The fields in which the request ``actual`` differs from the recorded ``obs`` it
        matched once the policy read both."""
        return changed_fields(recorded_request(self.cassette, obs), actual)

    def divergence(self, asked: Asked, what: str) -> DivergenceInfo:
        """The facts of the miss ``asked`` (``what``: what the agent did, in words)."""
        expected = self.index.expected(asked.family)
        judged = self._judge(asked)
        near = judged.nearest
        facts: dict[str, Any] = {
            "category": judged.change.value, "changed": judged.changed,
            "nearest": judged.sentence, "fields": judged.fields,
            "nearest_step": near["seq"] if near is not None else None,
            "played": self.index.played(near["seq"]) if near is not None else None}
        if expected is None:
            family = asked.family if asked.family != "net" else "model/HTTP"
            return DivergenceInfo(step=None, kind=asked.kind,
                                  reason=f"{what}, but the recording has no more {family} "
                                         "calls", expected=None, actual=asked.actual,
                                  diff=unified(None, asked.actual), **facts)
        shown = recorded_request(self.cassette, expected)
        return DivergenceInfo(step=expected["seq"], kind=expected["kind"],
                              reason=f"{what} that does not match the recording",
                              expected=shown, actual=asked.actual,
                              diff=unified(shown, asked.actual), **facts)

    def missing(self, unused: Sequence[int]) -> DivergenceInfo:
        """The divergence of a run that ended before recorded steps ``unused``."""
        first = next(o for o in self.cassette.observations if o["seq"] == unused[0])
        return DivergenceInfo(
            step=first["seq"], kind=first["kind"],
            reason=f"the run ended before step {first['seq']}: {len(unused)} recorded "
                   "step(s) were never requested",
            expected=recorded_request(self.cassette, first), actual=None, diff="",
            category=Change.MISSING_CALL.value)

    def _judge(self, asked: Asked) -> _Judgement:
        if asked.family == "net":
            return self._judge_request(asked)
        if asked.family == "tool":
            return self._judge_tool(asked.actual)
        if asked.family == "mcp":
            return self._judge_mcp(asked.actual)
        recorded = [o for o in self.index.family("effect")
                    if o["name"] == asked.actual.get("effect")]
        return _Judgement(Change.EXTRA_CALL, nearest=recorded[-1] if recorded else None)

    def _judge_tool(self, actual: Mapping[str, Any]) -> _Judgement:
        name = actual["name"]
        again = self.index.recorded(tool_key(name, actual["args"]))
        if again:
            return _Judgement(Change.EXTRA_CALL, nearest=again[-1])
        unserved = self.index.unserved("tool")
        same = [o for o in unserved if o["name"] == name]
        if same:
            return _Judgement(Change.DIFFERENT_ARGUMENTS, nearest=same[0], fields=("args",))
        if unserved:
            return _Judgement(Change.DIFFERENT_TOOL, nearest=unserved[0], fields=("name",))
        return _Judgement(Change.EXTRA_CALL)

    def _judge_mcp(self, actual: Mapping[str, Any]) -> _Judgement:
        """An MCP request other than a tool call: made again, or another request than the
        next one recorded for that server (its method, or its params, differ)."""
        recorded = [o for o in self.index.family("mcp")
                    if mcp.label(o["mcp"]["server"]) == actual["server"]]
        unserved = [o for o in recorded if o["seq"] not in self.index.used]
        same = [o for o in recorded if o["mcp"]["method"] == actual["method"]]
        if same and not any(o in unserved for o in same):
            return _Judgement(Change.EXTRA_CALL, nearest=same[-1])
        if not unserved:
            return _Judgement(Change.EXTRA_CALL)
        near = next((o for o in unserved if o["mcp"]["method"] == actual["method"]), unserved[0])
        fields = ("params",) if near["mcp"]["method"] == actual["method"] else ("method",)
        return _Judgement(Change.CHANGED_REQUEST, (fields[0],), near, fields)

    def _judge_request(self, asked: Asked) -> _Judgement:
        """A model or HTTP request: sent again (all its recordings played), or compared
        with the nearest recorded request, served or not."""
        if asked.key is not None:
            again = self.index.loose_group(asked.key, self.line_key)
            if again:
                return self._named(asked, Change.EXTRA_CALL, (), again[-1], ())
        mine = asked.provider and providers.get(asked.provider)
        found = nearest(self._shown.read(mine or None, asked.actual), (
            (obs["seq"], self._shown.read(
                providers.for_line(obs) if obs["kind"] == Kind.MODEL else None,
                recorded_request(self.cassette, obs)))
            for obs in self.index.family("net")))
        if found is None:
            return _Judgement(Change.EXTRA_CALL)
        seq, differ = found
        near = next(o for o in self.index.family("net") if o["seq"] == seq)
        if self.index.played(seq):
            return self._named(asked, Change.EXTRA_CALL, (), near, differ)
        change, changed = self._compare(asked, near, differ)
        return self._named(asked, change, changed, near, differ)

    def _compare(self, asked: Asked, near: Mapping[str, Any],
                 differ: Sequence[str]) -> tuple[Change, tuple[str, ...]]:
        if near["kind"] == Kind.MODEL and asked.provider is not None:
            provider = providers.get(asked.provider)
            theirs = self.policy.read(providers.for_line(near),
                                      recorded_request(self.cassette, near))
            return request_change(provider, theirs, self.policy.read(provider, asked.actual),
                                  (near["url"], asked.url))
        return Change.CHANGED_REQUEST, tuple(differ)

    @staticmethod
    def _named(asked: Asked, change: Change, changed: tuple[str, ...],
               near: Mapping[str, Any], differ: Iterable[str]) -> _Judgement:
        fields = tuple(differ)
        shown = ", ".join(fields[:8]) + (f" and {len(fields) - 8} more" if len(fields) > 8
                                         else "")
        return _Judgement(change, changed, near, fields,
                          f"nearest recorded request: step {near['seq']}, which differs in "
                          f"{shown or 'nothing the policy reads'}")
