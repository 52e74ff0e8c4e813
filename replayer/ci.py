"""What a CI system reads of replays: one outcome per cassette, the summary of many, a JUnit
XML report, and GitHub Actions workflow commands that point at the diverging line.

``deja replay`` makes one :class:`Outcome` per cassette it replays (or could not replay) and
hands them here. Everything is computed from the outcome and the cassette file, so the same
report comes out whatever ran the program (in process or through the proxy).
"""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recorder.cassette.rows import step_name
from recorder.cassette.schema import Kind
from replayer.result import render

__all__ = ["PASSED", "Case", "Outcome", "annotation", "junit_of", "junit_report", "line_of",
           "step_lines", "summary", "workflow_command", "write_junit", "write_report"]

PASSED = ("identical", "equivalent")  # the verdicts of a replay that passes
SUITE = "deja replay"


@dataclass(frozen=True)
class Outcome:
    """One cassette's replay: its ``result`` (:meth:`replayer.ReplayResult.to_dict`), or the
    ``error`` that kept it from being judged (a bad, torn or refused cassette, a program
    that failed before the replay could report).

    ``cassette`` is the path as the user gave it (or as a directory's listing made it);
    ``run`` the run id (the result's, else the one the header names, if any);
    ``code`` the replayed program's exit status, when known; ``seconds`` the wall-clock
    time of the whole replay, the program's start-up included; ``status`` what ``deja
    replay`` of this cassette alone exits with."""

    cassette: str
    result: Mapping[str, Any] | None = None
    error: str | None = None
    run: str | None = None  # the run id its header names, when there is no result
    code: int | None = None
    seconds: float = 0.0
    status: int = 2

    @property
    def verdict(self) -> str:
        """``identical``, ``equivalent``, ``diverged``, or ``error`` (not judged)."""
        if self.result is None:
            return "error"
        return str(self.result.get("verdict") or
                   ("identical" if self.result.get("identical") else "diverged"))

    @property
    def run_id(self) -> str | None:
        return (self.result or {}).get("run") or self.run

    @property
    def exit_status(self) -> int:
        """0 passed, 1 diverged, 2 not judged."""
        return 2 if self.result is None else 0 if self.verdict in PASSED else 1

    @property
    def divergence(self) -> Mapping[str, Any] | None:
        return (self.result or {}).get("divergence") or None

    def report(self) -> str:
        """The full text report (:func:`replayer.result.render`), or the error."""
        if self.result is None:
            return f"{self.cassette}: could not be replayed: {self.error}"
        return render(self.result, self.code)

    def headline(self) -> str:
        """One line: what happened, and where."""
        if self.result is None:
            return f"{self.cassette}: could not be replayed: {self.error}"
        run = self.result.get("run")
        d = self.divergence
        if self.verdict == "diverged" and d:
            return f"{self.cassette} (run {run}): diverged at {_where(d)} ({_kind(d)}): " \
                   f"{d.get('reason')}"
        if self.verdict == "diverged":
            return f"{self.cassette} (run {run}): diverged"
        if self.verdict == "equivalent":
            steps = ", ".join(f"step {e['step']} ({', '.join(e['fields'])})"
                              for e in self.result.get("equivalent") or ())
            return f"{self.cassette} (run {run}): equivalent, identical but for " \
                   f"declared-volatile fields: {steps}"
        return f"{self.cassette} (run {run}): identical"


def _where(d: Mapping[str, Any]) -> str:
    return "the end" if d.get("step") is None else f"step {d['step']}"


def _kind(d: Mapping[str, Any]) -> str:
    """A divergence's kind of change (``changed_request``, ...), else its step's kind."""
    return str(d.get("category") or d.get("kind") or "unknown")


def summary(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The totals of many replays, the status ``deja replay`` exits with (2 when one could
    not be judged, else 1 when one diverged, else 0), and a row per cassette."""
    counts = {verdict: sum(o.verdict == verdict for o in outcomes)
              for verdict in ("identical", "equivalent", "diverged", "error")}
    return {"cassettes": len(outcomes), **counts,
            "passed": sum(o.verdict in PASSED for o in outcomes),
            "seconds": round(sum(o.seconds for o in outcomes), 3),
            "exit_status": max((o.exit_status for o in outcomes), default=0),
            "rows": [_row(o) for o in outcomes]}


def _row(outcome: Outcome) -> dict[str, Any]:
    result, d = outcome.result, outcome.divergence
    return {"cassette": outcome.cassette, "run": outcome.run_id, "verdict": outcome.verdict,
            "steps": f"{result['steps_served']}/{result['steps_recorded']}" if result else None,
            "divergence": f"{_where(d)} {_kind(d)}" if d else None,
            "seconds": f"{outcome.seconds:.2f}"}


# --------------------------------------------------------------------------- cassette lines

def step_lines(path: str | Path) -> tuple[list[tuple[int, dict[str, Any]]], int | None, int]:
    """The steps of a cassette file with their 1-based line numbers (the header is line 1;
    a step is an observation line, one with a ``seq``, but the end line), the end line's
    number (None: no end line) and the number of lines. A line that is no JSON object (a
    torn last line) is no step."""
    steps: list[tuple[int, dict[str, Any]]] = []
    end = None
    with open(path, "rb") as lines:
        number = 0
        for number, raw in enumerate(lines, start=1):
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(line, dict) or number == 1 or "seq" not in line:
                continue
            if line.get("kind") == Kind.END:
                end = number
            else:
                steps.append((number, line))
    return steps, end, number


def line_of(path: str | Path, step: int | None) -> int | None:
    """The line a divergence points at: its step's, or (after the last step) the end
    line, else the last line."""
    try:
        steps, end, last = step_lines(path)
    except OSError:
        return None
    if step is not None:
        found = [number for number, line in steps if line.get("seq") == step]
        if found:
            return found[0]
    return end or last or None


# --------------------------------------------------------------------------- GitHub Actions

def _escape_data(text: str) -> str:
    """A workflow command's message, escaped as the runner reads it."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    """A workflow command's property value (file, title), escaped as the runner reads it."""
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(outcome: Outcome, cwd: Path | None = None) -> str | None:
    """The GitHub Actions workflow command for an outcome: ``::error`` for a divergence
    (at the diverging step's line of the cassette) or a cassette that could not be
    replayed, ``::notice`` for an equivalent replay; None for an identical one."""
    if outcome.result is None:
        command, title, line = "error", "deja replay could not run", None
    elif outcome.verdict == "diverged":
        d = outcome.divergence or {}
        command, title = "error", f"deja replay diverged ({_kind(d)})"
        line = line_of(outcome.cassette, d.get("step"))
    elif outcome.verdict == "equivalent":
        first = next(iter(outcome.result.get("equivalent") or ()), None)
        command, title = "notice", "deja replay equivalent"
        line = line_of(outcome.cassette, first["step"]) if first else None
    else:
        return None
    message = outcome.headline() if outcome.result is not None else str(outcome.error)
    return workflow_command(command, outcome.cassette, line, title, message, cwd)


def workflow_command(command: str, cassette: str | Path, line: int | None, title: str,
                     message: str, cwd: Path | None = None) -> str:
    """A GitHub Actions workflow command (``error``, ``warning``, ``notice``) on a line of
    a cassette file (its path relative to ``cwd``, this directory by default), escaped
    as the runner reads it."""
    file = os.path.relpath(Path(cassette).resolve(), cwd or Path.cwd())
    properties = [f"file={_escape_property(file)}"]
    if line is not None:
        properties.append(f"line={line}")
    properties.append(f"title={_escape_property(title)}")
    return f"::{command} {','.join(properties)}::{_escape_data(message)}"


# --------------------------------------------------------------------------- JUnit XML

_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _text(text: str) -> str:
    """Text XML 1.0 can hold: the control characters it cannot are written as \\xNN."""
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _seconds(value: float) -> str:
    return f"{value:.3f}"


def _classname(cassette: str) -> str:
    """A cassette's folder as the test's class: ``cassettes/ci`` (``.`` for this one)."""
    return Path(cassette).parent.as_posix()


@dataclass(frozen=True)
class Case:
    """One JUnit test case: ``outcome`` is None (it passed), ``failure``, ``error`` or
    ``skipped``, with its ``message`` and ``text``; ``kind`` is the failure's or error's
    type (its default: ``Divergence``, ``DejaReplayError``)."""

    classname: str
    name: str
    seconds: float | None = None
    outcome: str | None = None
    message: str = ""
    text: str = ""
    kind: str | None = None


_KINDS = {"error": "DejaReplayError", "failure": "Divergence"}


def _case(suite: ET.Element, classname: str, name: str, seconds: float | None = None,
          outcome: str | None = None, message: str = "", text: str = "") -> None:
    _add(suite, Case(classname, name, seconds, outcome, message, text))


def _add(suite: ET.Element, given: Case) -> None:
    case = ET.SubElement(suite, "testcase", classname=_text(given.classname),
                         name=_text(given.name))
    if given.seconds is not None:
        case.set("time", _seconds(given.seconds))
    if given.outcome is not None:
        child = ET.SubElement(case, given.outcome, message=_text(given.message))
        kind = given.kind or _KINDS.get(given.outcome)
        if kind is not None:
            child.set("type", kind)
        child.text = _text(given.text) if given.text else None


def _by_cassette(suite: ET.Element, outcome: Outcome) -> None:
    name, classname = Path(outcome.cassette).name, _classname(outcome.cassette)
    if outcome.result is None:
        _case(suite, classname, name, outcome.seconds, "error", str(outcome.error),
              outcome.report())
    elif outcome.verdict == "diverged":
        _case(suite, classname, name, outcome.seconds, "failure", outcome.headline(),
              outcome.report())
    else:
        _case(suite, classname, name, outcome.seconds)


def _by_step(suite: ET.Element, outcome: Outcome) -> None:
    """One test case per recorded step: served fine passes, the diverging step fails,
    a step never reached is skipped; a cassette that could not be replayed is one error."""
    classname = Path(outcome.cassette).as_posix()
    if outcome.result is None:
        _case(suite, classname, Path(outcome.cassette).name, outcome.seconds, "error",
              str(outcome.error), outcome.report())
        return
    d = outcome.divergence if outcome.verdict == "diverged" else None
    at = d.get("step") if d else None
    for seq, name in _steps_of(outcome.cassette):
        if d is None or at is None or seq < at:
            _case(suite, classname, name)
        elif seq == at:
            _case(suite, classname, name, None, "failure", outcome.headline(),
                  outcome.report())
        else:
            _case(suite, classname, name, None, "skipped",
                  f"not reached: the run diverged at step {at}")
    if d is not None and at is None:  # beyond the recording: no recorded step to fail
        _case(suite, classname, "after the last step", None, "failure", outcome.headline(),
              outcome.report())
    elif d is None and outcome.verdict == "diverged":
        _case(suite, classname, "replay", None, "failure", outcome.headline(),
              outcome.report())


def _steps_of(path: str) -> list[tuple[int, str]]:
    """Each recorded step's seq and its test case's name (``step 1 model claude-...``),
    read as the replay read them (a model line may hold only what it adds to an earlier
    one); from the raw lines, if the cassette no longer loads."""
    from recorder.cassette import load
    from recorder.errors import DejaError

    steps: list[Mapping[str, Any]]
    try:
        steps = list(load(path, allow_unverified=True, allow_torn=True,
                          allow_incomplete=True).observations)
    except DejaError:
        steps = [line for _, line in step_lines(path)[0]]
    return [(obs["seq"], f"step {obs['seq']} {obs.get('kind')} {step_name(obs)}".rstrip())
            for obs in steps]


def junit_report(outcomes: Iterable[Outcome], cases: str = "cassettes") -> ET.ElementTree:
    """The JUnit XML report: one ``<testsuite name="deja replay">`` with a test case per
    cassette (``cases="cassettes"``) or per recorded step (``cases="steps"``)."""
    outcomes = list(outcomes)
    root = ET.Element("testsuites", name=SUITE)
    suite = ET.SubElement(root, "testsuite", name=SUITE)
    for outcome in outcomes:
        (_by_step if cases == "steps" else _by_cassette)(suite, outcome)
    _count(root, suite, sum(o.seconds for o in outcomes))
    return ET.ElementTree(root)


def junit_of(cases: Iterable[Case], name: str) -> ET.ElementTree:
    """A JUnit XML report of ``cases`` in one ``<testsuite>`` called ``name`` (``deja
    suite`` writes one case per incident)."""
    root = ET.Element("testsuites", name=name)
    suite = ET.SubElement(root, "testsuite", name=name)
    seconds = 0.0
    for case in cases:
        _add(suite, case)
        seconds += case.seconds or 0.0
    _count(root, suite, seconds)
    return ET.ElementTree(root)


def _count(root: ET.Element, suite: ET.Element, seconds: float) -> None:
    """The counts CI reads, on the report and its suite."""
    counts = {what: sum(1 for case in suite for _ in case.iter(what))
              for what in ("failure", "error", "skipped")}
    for element in (root, suite):
        element.set("tests", str(len(suite)))
        element.set("failures", str(counts["failure"]))
        element.set("errors", str(counts["error"]))
        element.set("time", _seconds(seconds))
    suite.set("skipped", str(counts["skipped"]))


def write_junit(path: Path, outcomes: Iterable[Outcome], cases: str = "cassettes") -> None:
    """Write :func:`junit_report` to ``path`` (UTF-8, with its XML declaration)."""
    write_report(path, junit_report(outcomes, cases))


def write_report(path: Path, tree: ET.ElementTree) -> None:
    """Write a JUnit XML report to ``path`` (UTF-8, with its XML declaration)."""
    ET.indent(tree)
    path.parent.mkdir(parents=True, exist_ok=True)
    tree.write(path, encoding="utf-8", xml_declaration=True)
