"""What a tool call does in the live part of a fork, a replay-then-live or a suite.

A fork replays its parent up to the edited step and then goes live: the model is asked
again and the program's tools run. Asking the model again is the point; running a refund
again is an accident. So in every run that continues another (a fork, a resume of a
fork, a replay that goes live at its first divergence, each run of a suite) a tool call
the recorded prefix does not answer is decided by a **tool policy**, one rule per tool
name (``*`` for the rest):

==============  ===========================================================================
``live``        the body runs, as in a recording
``recorded``    the parent's recorded answer to the same tool with the same arguments is
                served (its value, or its error raised again); with none, the call is
                refused
``static:JSON`` the body does not run; the call returns the JSON value
``refuse``      the body does not run; the call raises :class:`recorder.ToolRefused`,
                which the agent sees as the tool's error
==============  ===========================================================================

Without a rule, a tool declared ``@recorder.tool(side_effect=True)`` is ``recorded``
(never live unless named: ``--live-tool refund`` or ``refund=live``) and any other tool is
``live``. ``*`` sets the rule of every tool without one of its own, except that ``*=live``
does not make a side effect live: only its name does.

A call the policy answers is logged as the tool's line with ``"policy"`` (the rule) and,
for ``recorded``, ``"from"`` (the run and step it was served from): a replay of the new run
serves it like any tool line, and a report lists it. The policy is kept in the new run's
header, so a resume continues under it.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from recorder.cassette import Cassette
from recorder.cassette.schema import Kind
from recorder.errors import ConfigError
from replayer.index import tool_key

__all__ = ["RecordedTools", "Rule", "ToolPolicy", "ToolRule"]

ANY = "*"


class Rule(enum.StrEnum):
    LIVE = "live"
    RECORDED = "recorded"
    STATIC = "static"
    REFUSE = "refuse"


@dataclass(frozen=True)
class ToolRule:
    """One tool's rule; ``value``: what a ``static`` call returns."""

    rule: Rule
    value: Any = None

    def spec(self) -> str:
        """As written on the command line: ``static:JSON`` or the rule's name."""
        if self.rule is Rule.STATIC:
            return f"static:{json.dumps(self.value, ensure_ascii=False)}"
        return self.rule.value

    @classmethod
    def parse(cls, text: str, *, name: str) -> ToolRule:
        head, sep, rest = text.partition(":")
        try:
            rule = Rule(head.strip())
        except ValueError:
            raise ConfigError(
                f"tool policy {name}={text!r}: the rule is one of live, recorded, refuse or "
                "static:JSON") from None
        if rule is not Rule.STATIC:
            if sep:
                raise ConfigError(f"tool policy {name}={text!r}: only static takes a value")
            return cls(rule)
        if not sep:
            raise ConfigError(f"tool policy {name}={text!r}: static needs a JSON value, "
                              f'e.g. {name}=static:{{"ok": true}}')
        try:
            return cls(rule, json.loads(rest))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"tool policy {name}={text!r}: the static value is not JSON "
                              f"({exc.msg})") from None


@dataclass(frozen=True)
class ToolPolicy:
    """Rules by tool name (``*``: the rest); see the module docstring."""

    rules: Mapping[str, ToolRule] = field(default_factory=dict)

    @classmethod
    def parse(cls, specs: Iterable[str] = (), live: Iterable[str] = ()) -> ToolPolicy:
        """From ``NAME=RULE`` specs (``--tool``) and names let run live (``--live-tool``);
        a name given twice is an error, not a silent choice."""
        rules: dict[str, ToolRule] = {}

        def put(name: str, rule: ToolRule, said: str) -> None:
            if not name or any(c.isspace() for c in name):
                raise ConfigError(f"tool policy {said!r}: name a tool (or * for the rest)")
            if name in rules and rules[name] != rule:
                raise ConfigError(f"tool policy: {name} is given two rules "
                                  f"({rules[name].spec()} and {rule.spec()})")
            rules[name] = rule

        for spec in specs:
            name, sep, text = spec.partition("=")
            if not sep:
                raise ConfigError(f"tool policy {spec!r}: write NAME=RULE, e.g. refund=refuse "
                                  "or *=recorded")
            put(name.strip(), ToolRule.parse(text.strip(), name=name.strip()), spec)
        for name in live:
            put(name.strip(), ToolRule(Rule.LIVE), f"--live-tool {name}")
        return cls(rules)

    def rule_for(self, name: str, *, side_effect: bool) -> ToolRule:
        own = self.rules.get(name)
        if own is not None:
            return own
        rest = self.rules.get(ANY)
        if rest is not None and not (side_effect and rest.rule is Rule.LIVE):
            return rest
        return ToolRule(Rule.RECORDED if side_effect else Rule.LIVE)

    def live_names(self) -> list[str]:
        return sorted(n for n, r in self.rules.items() if r.rule is Rule.LIVE and n != ANY)

    def to_header(self) -> dict[str, str]:
        """As a run's header keeps it: ``{name: spec}`` (``{}``: the defaults)."""
        return {name: rule.spec() for name, rule in sorted(self.rules.items())}

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> ToolPolicy | None:
        """The policy a run was made under: its ``tools``; a fork made before runs kept one
        gets the defaults; a run that continues nothing has none (every tool live)."""
        kept = header.get("tools")
        if isinstance(kept, Mapping):
            return cls.parse(f"{name}={spec}" for name, spec in kept.items())
        return cls() if header.get("parent") else None

    def describe(self) -> str:
        """One line for a report: the rules given, and the defaults."""
        given = ", ".join(f"{n}={r.spec()}" for n, r in sorted(self.rules.items()))
        return (f"{given + '; ' if given else ''}side-effecting tools not named live are "
                "served their recorded answer or refused")


class RecordedTools:
    """The tool answers of a recorded run, by tool and arguments (the ``recorded`` rule):
    calls with the same arguments are served in recorded order, then the last again."""

    def __init__(self, cassettes: Sequence[Cassette]) -> None:
        self._answers: dict[tuple[str, str], list[tuple[Cassette, Mapping[str, Any]]]] = {}
        self._served: dict[tuple[str, str], int] = {}
        for cassette in cassettes:
            lines: Sequence[Mapping[str, Any]] = cassette.observations
            outcomes = {o["intent"]: o for o in lines if o.get("kind") == Kind.OUTCOME}
            for obs in lines:
                kind = obs.get("kind")
                if kind not in (Kind.TOOL, Kind.INTENT) or obs.get("observed"):
                    continue
                answer = outcomes.get(obs["seq"]) if kind == Kind.INTENT else obs
                if answer is None:  # a side effect the run ended inside: nothing known
                    continue
                key = tool_key(str(obs["name"]), obs.get("args"))
                self._answers.setdefault(key, []).append((cassette, {**answer,
                                                                     "seq": obs["seq"]}))

    def take(self, name: str, args_key: Any) -> tuple[Cassette, Mapping[str, Any]] | None:
        """The recorded answer to ``name`` called with ``args_key`` (None: none)."""
        key = tool_key(name, args_key)
        answers = self._answers.get(key)
        if not answers:
            return None
        n = self._served.get(key, 0)
        self._served[key] = n + 1
        return answers[min(n, len(answers) - 1)]
