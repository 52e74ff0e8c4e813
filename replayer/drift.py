"""Has the provider drifted? A recorded run compared with the same program run live now.

A replay asks whether the *program* still makes the recorded calls; drift asks the other
question: given the recorded program, does the *provider* still answer the same? The
program is run live again (``deja drift``, or the pytest plugin's ``--deja-dry-run``) and
the two runs are compared step by step with :func:`replayer.diff.compare`, which reduces
each step to its meaning (ids, timestamps, latencies and signatures left out). Each step
of the recorded run is then one of:

- ``same``: it means the same in both runs;
- ``equivalent``: only what differs between any two live runs of the same behaviour
  differs: token counts and cost (``/usage``, ``/cost_usd``, the end line's token and
  cost totals), what the reply says about how it was produced (its ``usage``, the model
  snapshot that served it, a serving tier or a system fingerprint: what each provider
  declares, :func:`recorder.providers.answer_meta_keys`)
  and the values of effects (``recorder.now()``, ``uuid4()``, ``random()`` ...);
- ``changed``: the first step that differs in anything else, with its changed fields as
  JSON pointers (recorded value, live value). What changed first says whose doing it is:
  the provider's answer (a ``/response`` field), the program's request (its code or
  inputs changed, not the provider) or something the program did itself (a tool's result);
- ``after_change``: every step after the first changed one. Once an answer changed, a
  live agent legitimately asks something else, so what differs there is a consequence of
  the first change and not a drift of its own; its fields are listed all the same.

A step only one run has is a difference too (``in``: ``recorded`` or ``live``). The
report also sets the two runs' versions side by side: the SDK and Python versions in
each header, the models each provider named in its responses, and the version headers
of the calls (``anthropic-version``, ``openai-version`` ...).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recorder import providers
from recorder.canonical import decode_body
from recorder.cassette import Cassette, load
from recorder.cassette.rows import step_count
from recorder.cassette.schema import Kind, Line
from recorder.terminal import visible, visible_json
from replayer.diff import FieldChange, StepDiff, _pair, aligned, compare

__all__ = ["DriftReport", "RunVersions", "StepDrift", "drift"]

SAME, EQUIVALENT, CHANGED, AFTER_CHANGE = "same", "equivalent", "changed", "after_change"
VERDICTS = (SAME, EQUIVALENT, CHANGED, AFTER_CHANGE)

# The end line's totals that count tokens or money, not steps.
_VOLATILE_TOTALS = ("input_tokens", "output_tokens", "cache_creation_input_tokens",
                    "cache_read_input_tokens", "cost_usd")

# What the first change says of whose doing it is.
CAUSES = {
    "answer": "the provider answered differently",
    "request": "the program sent another request: its code or inputs changed, not the "
               "provider (deja replay shows how)",
    "program": "the program did something else here (a tool's result, an effect, the "
               "harness): not the provider's answer",
    "ended": "the run ended otherwise",
    "steps": "one run has a step the other has not",
}


def _segments(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def volatile(kind: str | None, path: str) -> bool:
    """Does a change at ``path`` of a step of ``kind`` differ between any two live runs
    of the same behaviour (see the module's docstring)?"""
    parts = _segments(path)
    if not parts:
        return False
    if kind == Kind.MODEL:
        return parts[0] in ("usage", "cost_usd") or (
            parts[:2] == ["response", "message"] and len(parts) > 2
            and parts[2] in providers.answer_meta_keys())
    if kind == Kind.EFFECT:
        return parts[0] == "value"
    if kind == Kind.END:
        return parts[0] == "totals" and len(parts) > 1 and parts[1] in _VOLATILE_TOTALS
    return False


@dataclass(frozen=True)
class StepDrift:
    """One step of the comparison. ``seq`` is the live run's seq (the recorded run's
    when the live run has no such step), ``seq_recorded`` the recorded run's; ``within``
    says which runs have it (``both``, ``recorded`` or ``live``). ``changes`` are the
    fields that count (recorded value ``a``, live value ``b``), ``equivalent`` those that
    differ between any two runs; ``where`` names the message a model step's change is in."""

    seq: int
    seq_recorded: int | None
    kind: str | None
    verdict: str
    within: str = "both"
    changes: tuple[FieldChange, ...] = ()
    equivalent: tuple[FieldChange, ...] = ()
    where: Mapping[str, str] = field(default_factory=dict)

    @property
    def is_end(self) -> bool:
        return self.kind == Kind.END

    @property
    def label(self) -> str:
        if self.is_end:
            return "the end line"
        if self.seq_recorded is None or self.seq_recorded == self.seq:
            return f"step {self.seq}"
        return f"step {self.seq} (recorded {self.seq_recorded})"

    def to_dict(self) -> dict[str, Any]:
        def fields(changes: tuple[FieldChange, ...]) -> list[dict[str, Any]]:
            return [{"path": c.path, "op": c.op, "recorded": c.a, "live": c.b,
                     **({"where": self.where[c.path]} if c.path in self.where else {})}
                    for c in changes]

        return {"seq": self.seq, "seq_recorded": self.seq_recorded, "kind": self.kind,
                "verdict": self.verdict, "in": self.within, "changes": fields(self.changes),
                "equivalent": fields(self.equivalent)}


@dataclass(frozen=True)
class RunVersions:
    """What one run says of the versions it ran with: the header's ``versions`` (Python
    and the SDKs), the providers called, the models they named in their responses, and
    the version headers sent or received (``anthropic-version``, ``openai-version``)."""

    path: str
    run: str
    steps: int
    verified: bool
    versions: dict[str, str]
    providers: tuple[str, ...]
    models: tuple[str, ...]
    api_versions: dict[str, tuple[str, ...]]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "run": self.run, "steps": self.steps,
                "verified": self.verified, "versions": self.versions,
                "providers": list(self.providers), "models": list(self.models),
                "api_versions": {k: list(v) for k, v in self.api_versions.items()}}


def _add(seen: dict[str, None], value: Any) -> None:
    if isinstance(value, str) and value:
        seen.setdefault(value)


def _version_headers(obs: Mapping[str, Any]) -> Iterable[tuple[str, str]]:
    response = obs.get("response") or {}
    for pair in [*(obs.get("request_headers") or ()), *(response.get("headers") or ())]:
        if len(pair) == 2 and str(pair[0]).lower().endswith("version"):
            yield str(pair[0]).lower(), str(pair[1])


def run_versions(cassette: Cassette) -> RunVersions:
    """The versions ``cassette``'s run ran with (see :class:`RunVersions`)."""
    names: dict[str, None] = {}
    models: dict[str, None] = {}
    headers: dict[str, dict[str, None]] = {}
    for obs in cassette.observations:
        if obs.get("kind") != Kind.MODEL:
            continue
        provider = providers.for_line(obs)
        _add(names, provider.name)
        response: Any = obs.get("response")
        if isinstance(response, dict) and response.get("status", 0) < 400:
            body = decode_body(response["body"], response.get("encoding"))
            _add(models, provider.summarize(response["status"], response.get("headers", []),
                                            body).get("model"))
        for name, value in _version_headers(obs):
            _add(headers.setdefault(name, {}), value)
    versions = cassette.header.get("versions")
    return RunVersions(
        str(cassette.path), cassette.run, step_count(cassette), cassette.verified,
        {str(k): str(v) for k, v in versions.items()} if isinstance(versions, dict) else {},
        tuple(names), tuple(models), {k: tuple(v) for k, v in sorted(headers.items())})


@dataclass(frozen=True)
class DriftReport:
    """The recorded run against the live one: each step's verdict (:class:`StepDrift`,
    the end line last), the first changed step and whose doing it is, and both runs'
    versions. ``live_kept``: whether the live cassette was kept (``deja drift -o``)."""

    recorded: RunVersions
    live: RunVersions
    steps: tuple[StepDrift, ...]
    first_change: int | None = None
    cause: str | None = None
    live_kept: bool = True

    @property
    def changed(self) -> bool:
        return self.first_change is not None

    @property
    def verdict(self) -> str:
        """``changed``, else ``equivalent`` when some step is, else ``same``."""
        if self.changed:
            return CHANGED
        return EQUIVALENT if any(s.verdict == EQUIVALENT for s in self.steps) else SAME

    def counts(self) -> dict[str, int]:
        """Steps (the end line is none) by verdict, and those only one run has."""
        steps = [s for s in self.steps if not s.is_end]
        out = {v: sum(1 for s in steps if s.verdict == v) for v in VERDICTS}
        out["only_recorded"] = sum(1 for s in steps if s.within == "recorded")
        out["only_live"] = sum(1 for s in steps if s.within == "live")
        return out

    def version_changes(self) -> dict[str, tuple[Any, Any]]:
        """What differs between the two runs' versions: each SDK (or Python) whose version
        differs, ``models`` and each version header, as (recorded, live)."""
        out: dict[str, tuple[Any, Any]] = {}
        a, b = self.recorded, self.live
        for name in sorted(set(a.versions) | set(b.versions)):
            if a.versions.get(name) != b.versions.get(name):
                out[name] = (a.versions.get(name), b.versions.get(name))
        if a.models != b.models:
            out["models"] = (list(a.models), list(b.models))
        for name in sorted(set(a.api_versions) | set(b.api_versions)):
            if a.api_versions.get(name) != b.api_versions.get(name):
                out[name] = (list(a.api_versions.get(name, ())),
                             list(b.api_versions.get(name, ())))
        return out

    def summary(self) -> str:
        """The verdict in one line: the first changed step, whose doing it is and its
        first changed field (recorded -> live), and how many steps came after it."""
        if not self.changed:
            equivalent = [s for s in self.steps if s.verdict == EQUIVALENT]
            if not equivalent:
                return SAME
            return (f"{EQUIVALENT} (differs only in what differs between any two runs, at "
                    f"{', '.join(s.label for s in equivalent[:6])}"
                    f"{' …' if len(equivalent) > 6 else ''})")
        first = next(s for s in self.steps if s.verdict == CHANGED)
        out = f"{CHANGED} at {first.label}: {CAUSES.get(self.cause or '', '')}"
        shown = [c for c in first.changes if c.op not in ("missing", "added")]
        if shown:
            a, b = _pair(shown[0].a, shown[0].b, width=50)
            out += f"; {shown[0].path}: {a} -> {b}"
            if len(shown) > 1:
                out += f" (and {len(shown) - 1} more field{'s' if len(shown) > 2 else ''})"
        after = self.counts()[AFTER_CHANGE]
        return out + (f"; {after} step{'s' if after != 1 else ''} after it" if after else "")

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "changed": self.changed,
                "first_change": self.first_change, "cause": self.cause,
                "cause_text": CAUSES.get(self.cause or ""), "counts": self.counts(),
                "recorded": self.recorded.to_dict(),
                "live": {**self.live.to_dict(), "kept": self.live_kept},
                "version_changes": {k: {"recorded": a, "live": b}
                                    for k, (a, b) in self.version_changes().items()},
                "steps": [s.to_dict() for s in self.steps]}

    def render(self, *, max_changes: int = 12) -> str:
        """The report ``deja drift`` prints: the verdict, both runs' versions, then the
        steps, a stretch of same steps on one line."""
        lines = [_headline(self), *_version_lines(self), _count_line(self)]
        for group in _stretches(self.steps):
            lines.extend(_step_lines(self, group, max_changes))
        return visible("\n".join(lines))


def _load(source: str | Path | Cassette, allow_unverified: bool | None) -> Cassette:
    if isinstance(source, Cassette):
        return source
    return load(source, allow_unverified=allow_unverified, allow_incomplete=True)


def _cause(step: StepDrift) -> str:
    """Whose doing the first changed step is (a key of :data:`CAUSES`)."""
    if step.within != "both":
        return "steps"
    if step.is_end:
        return "ended"
    top = {(_segments(c.path) or [""])[0] for c in step.changes}
    if step.kind in (Kind.MODEL, Kind.HTTP) and "kind" not in top:
        return "request" if top & {"request", "model", "method", "url"} else "answer"
    return "program"


def _graded(diff: StepDiff | None, seq: int, seq_a: int | None, kind: str | None,
            within: str, after: bool) -> StepDrift:
    """One step's verdict from its diff (None: it means the same in both runs); every
    step ``after`` the first changed one is ``after_change``, its fields listed all the
    same."""
    if diff is None:
        return StepDrift(seq, seq_a, kind, AFTER_CHANGE if after else SAME, within)
    counted = tuple(c for c in diff.changes if not volatile(kind, c.path)) \
        if within == "both" and diff.kind_a == diff.kind_b else diff.changes
    loose = tuple(c for c in diff.changes if c not in counted)
    verdict = AFTER_CHANGE if after else CHANGED if counted else EQUIVALENT
    return StepDrift(seq, seq_a, kind, verdict, within, counted, loose, diff.messages)


def _steps(recorded: list[Line], live: list[Line],
           diffs: Mapping[tuple[int, int | None], StepDiff]) -> list[StepDrift]:
    out: list[StepDrift] = []
    changed = False
    for i in range(max(len(recorded), len(live))):
        a = recorded[i] if i < len(recorded) else None
        b = live[i] if i < len(live) else None
        either = b if b is not None else a
        assert either is not None
        seq, seq_a = either["seq"], a["seq"] if a is not None else None
        within = "both" if a is not None and b is not None else \
            "recorded" if a is not None else "live"
        kind = str(either.get("kind"))
        step = _graded(diffs.get((seq, seq_a)), seq, seq_a, kind, within, changed)
        changed = changed or step.verdict == CHANGED
        out.append(step)
    return out


def drift(recorded_path: str | Path | Cassette, live_path: str | Path | Cassette, *,
          allow_unverified: bool | None = None) -> DriftReport:
    """Compare a recorded run with the same program run live (see the module's
    docstring). Both cassettes are loaded with their signatures checked (a crashed run,
    without its end line, is compared as far as it goes); ``allow_unverified`` as for
    :func:`recorder.cassette.load`. Either may be given loaded."""
    a = _load(recorded_path, allow_unverified)
    b = _load(live_path, allow_unverified)
    diff = compare(a, b)
    by_position = {(d.seq, d.seq_a): d for d in diff.steps}
    steps = _steps(aligned(a), aligned(b), by_position)
    first = next((s for s in steps if s.verdict == CHANGED), None)
    return DriftReport(run_versions(a), run_versions(b), tuple(steps),
                       first.seq if first is not None else None,
                       _cause(first) if first is not None else None)


def dumps(report: DriftReport) -> str:
    """The report as JSON, as ``deja drift --json`` prints it."""
    return visible_json(json.dumps(report.to_dict(), indent=2, default=str, ensure_ascii=False))


# ---------------------------------------------------------------------- the report


def _headline(report: DriftReport) -> str:
    live = f"a live run {report.live.run}" + (
        f" ({report.live.path})" if report.live_kept else " (not kept)")
    verdict = {CHANGED: "CHANGED", EQUIVALENT: "equivalent: the same but for what differs "
               "between any two runs", SAME: "same"}[report.verdict]
    return f"drift of {report.recorded.run} ({report.recorded.path}) against {live}: {verdict}"


def _listed(values: Iterable[str]) -> str:
    return ", ".join(values) or "(none)"


def _side_by_side(name: str, recorded: str, live: str) -> list[str]:
    """One line when both runs say the same, else the two."""
    label = f"  {name}:".ljust(13) + " "
    if recorded == live:
        return [f"{label}{recorded} (both runs)"]
    return [f"{label}recorded {recorded}", f"{'':<{len(label)}}live     {live}"]


def _version_lines(report: DriftReport) -> list[str]:
    """Both runs' versions, SDKs first, then the models and the version headers."""
    a, b = report.recorded, report.live
    lines = _side_by_side("versions", _listed(f"{k} {v}" for k, v in a.versions.items()),
                          _listed(f"{k} {v}" for k, v in b.versions.items()))
    lines += _side_by_side("models", _listed(a.models), _listed(b.models))
    for name in sorted(set(a.api_versions) | set(b.api_versions)):
        lines += _side_by_side(name, _listed(a.api_versions.get(name, ())),
                               _listed(b.api_versions.get(name, ())))
    changes = report.version_changes()
    if changes:
        lines.append("  changed:    " + "; ".join(
            f"{k} {_listed(map(str, x)) if isinstance(x, list) else x} -> "
            f"{_listed(map(str, y)) if isinstance(y, list) else y}"
            for k, (x, y) in changes.items()))
    for run, name in ((a, "recorded"), (b, "live")):
        if not run.verified:
            lines.append(f"  signature:  the {name} run is NOT VERIFIED")
    return lines


def _count_line(report: DriftReport) -> str:
    counts = report.counts()
    parts = [f"{counts[SAME]} same", f"{counts[EQUIVALENT]} equivalent",
             f"{counts[CHANGED]} changed"]
    if counts[AFTER_CHANGE]:
        parts.append(f"{counts[AFTER_CHANGE]} after the change")
    for key, name in (("only_recorded", "only recorded"), ("only_live", "only live")):
        if counts[key]:
            parts.append(f"{counts[key]} {name}")
    return (f"  steps:      {report.recorded.steps} recorded, {report.live.steps} live: "
            + ", ".join(parts))


def _stretches(steps: Iterable[StepDrift]) -> list[list[StepDrift]]:
    """The steps, a run of consecutive same steps, or the steps after the change (the
    end line with them), as one."""
    out: list[list[StepDrift]] = []
    for step in steps:
        last = out[-1][-1] if out else None
        if last is not None and step.verdict == last.verdict and (
                step.verdict == AFTER_CHANGE or (step.verdict == SAME and not step.is_end)):
            out[-1].append(step)
        else:
            out.append([step])
    return out


def _step_lines(report: DriftReport, group: list[StepDrift], max_changes: int) -> list[str]:
    first = group[0]
    if first.verdict == AFTER_CHANGE:
        return [_after_line(group)]
    if len(group) > 1:
        return [f"  steps {first.seq}-{group[-1].seq}: same"]
    head = f"  {first.label}" + (f" ({first.kind})" if first.kind and not first.is_end else "")
    only = {"recorded": ", only in the recorded run", "live": ", only in the live run"}
    said = {SAME: "same", EQUIVALENT: "equivalent",
            CHANGED: f"CHANGED: {CAUSES.get(report.cause or '', '')}"}[first.verdict]
    lines = [f"{head}: {said}{only.get(first.within, '')}"]
    if first.verdict == CHANGED:
        lines.extend(_change_lines(first, first.changes, max_changes))
    elif first.verdict == EQUIVALENT:
        lines.append("    differs only in " + ", ".join(c.path for c in first.equivalent))
    return lines


def _after_line(group: list[StepDrift]) -> str:
    """The steps after the first change, on one line: which of them differ."""
    steps = [s for s in group if not s.is_end]
    named = (f"step {steps[0].seq}" if len(steps) == 1 else
             f"steps {steps[0].seq}-{steps[-1].seq}" if steps else "")
    if group[-1].is_end:
        named = f"{named} and the end line" if named else "the end line"
    differ = [s.label for s in group if s.changes]
    return (f"  after the change: {named} (not drifts of their own; "
            + (f"{len(differ)} differ{'s' if len(differ) == 1 else ''}: "
               f"{', '.join(differ[:8])}{' …' if len(differ) > 8 else ''})"
               if differ else "none differs)"))


def _change_lines(step: StepDrift, changes: tuple[FieldChange, ...],
                  max_changes: int) -> list[str]:
    lines = []
    for change in changes[:max_changes]:
        if change.op in ("missing", "added"):
            continue
        a, b = _pair(change.a, change.b)
        a = "(absent)" if change.op == "add" else a
        b = "(absent)" if change.op == "remove" else b
        where = step.where.get(change.path)
        lines.append(f"    {change.path or '/'}: {a} -> {b}" + (f"  [{where}]" if where else ""))
    if len(changes) > max_changes:
        lines.append(f"    … {len(changes) - max_changes} more changes")
    return lines
