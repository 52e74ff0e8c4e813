"""What a replay found: :class:`ReplayResult`, and the report deja prints of it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from recorder.cassette.rows import describe_split, describe_totals
from recorder.errors import DivergenceInfo
from recorder.terminal import visible

__all__ = ["ReplayResult", "render"]


@dataclass(frozen=True)
class ReplayResult:
    """What a replay found.

    ``steps_recorded`` is the cassette's step count (:mod:`recorder.cassette.rows`: every
    observation line but the end line) and ``steps_served`` how many of them the replay
    went through: the calls served from the cassette, the lines made inside a served
    tool, and the control lines the run reached. ``seconds`` is the time spent serving,
    from the first call the program made to the last one answered (the interpreter's
    start-up and the program's imports are not in it). ``totals`` is the recorded run's
    :func:`recorder.cassette.rows.run_totals`.

    ``grades`` counts the calls served ``exact`` or ``equivalent`` and those that
    ``diverged``; ``kinds`` the divergences by kind (:class:`replayer.verdicts.Change`;
    ``missing_call`` counts the recorded calls a run that otherwise matched never asked
    for); ``equivalent`` names each equivalent call's step and the fields it differed in.
    ``verdict`` sums them up: ``identical``, ``equivalent`` or ``diverged``.
    ``identical`` says whether the replay passed (no divergence, every step asked for),
    whether its calls were exact or equivalent.
    """

    path: str
    run: str
    steps_served: int
    steps_recorded: int
    divergence: DivergenceInfo | None
    unused: tuple[int, ...]
    verified: bool
    verify_note: str
    recorded_status: str | None
    seconds: float
    # What was served but deserves a look, e.g. an effect served from another call site.
    notes: tuple[str, ...] = ()
    totals: dict[str, Any] | None = None
    recorded_exit_code: int | None = None  # the recorded program's exit status, if known
    grades: dict[str, int] | None = None
    kinds: dict[str, int] | None = None
    equivalent: tuple[dict[str, Any], ...] = ()

    @property
    def complete(self) -> bool:
        """Every recorded observation was asked for."""
        return not self.unused

    @property
    def identical(self) -> bool:
        return self.divergence is None and self.complete

    @property
    def verdict(self) -> str:
        """``identical`` (every call exact), ``equivalent`` (some only equivalent, none
        diverged) or ``diverged``."""
        if not self.identical:
            return "diverged"
        return "equivalent" if (self.grades or {}).get("equivalent") else "identical"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["unused"] = list(self.unused)
        out["notes"] = list(self.notes)
        out["equivalent"] = list(self.equivalent)
        out["identical"] = self.identical
        out["complete"] = self.complete
        out["verdict"] = self.verdict
        return out

    def report(self, code: int | None = None, *, advice: str | None = None) -> str:
        """The report (:func:`render`); ``code``: the program's exit status, if known."""
        return render(self.to_dict(), code, advice=advice)


def render(result: Mapping[str, Any], code: int | None = None, *,
           advice: str | None = None) -> str:
    """The one report of a replay, from :meth:`ReplayResult.to_dict` (or the JSON a
    replayed program handed its launcher, with its ``program_error``): what ``deja
    replay``, the proxy, ``ReplayResult.report()`` and the pytest plugin print. ``code``:
    the replayed program's exit status, when deja ran it; ``advice``: what to do about a
    divergence, when the caller knows better than the default (the pytest plugin)."""
    d = result.get("divergence")
    failed_early = bool(d) and not result["steps_served"] and code not in (0, None) and \
        bool(result.get("program_error"))
    verdict = "FAILED BEFORE ITS FIRST CALL" if failed_early else _HEADLINES.get(
        result.get("verdict") or ("identical" if result["identical"] else "diverged"),
        "DIVERGED")
    if not result.get("verified"):
        verdict += " (NOT VERIFIED: what was served is unchecked)"
    recorded_exit = result.get("recorded_exit_code")
    lines = [f"replay of {result['run']} ({result['path']}): {verdict}",
             f"  steps:      {result['steps_served']}/{result['steps_recorded']} served "
             f"in {result['seconds']:.3f}s"]
    lines.extend(_calls(result))
    lines += [f"  signature:  {result['verify_note']}",
              f"  recorded:   {result['recorded_status'] or 'no end line'}"
              + (f", exit status {recorded_exit}" if recorded_exit is not None else "")]
    if code is not None:  # the program's, when deja ran it
        lines.append(f"  replayed:   exit status {code}"
                     + (f" ({result['program_error']})" if result.get("program_error")
                        else ""))
    totals = result.get("totals")
    if totals:
        lines.append(f"  totals:     {describe_totals(totals['all'])}")
        lines.extend(f"              {line}" for line in describe_split(totals))
    if failed_early:
        lines.append("  next:       the program stopped before it asked for anything, so "
                     "nothing was compared: fix what its error says (a missing setting, "
                     "file or dependency) and replay again")
    elif d:
        lines.extend(_divergence(d, result["path"], advice))
    lines.extend(f"  note:       {note}" for note in result.get("notes") or ())
    return visible("\n".join(lines))  # a recorded prompt is data, never a terminal's command


_HEADLINES = {"identical": "identical",
              "equivalent": "equivalent: identical but for declared-volatile fields",
              "diverged": "DIVERGED"}
_SHOWN_EQUIVALENT = 5  # equivalent calls listed in the report (all are in the JSON)


def _calls(result: Mapping[str, Any]) -> list[str]:
    """The calls by grade, the divergences by kind, and the fields each equivalent call
    differed in (none for a result from before calls were graded)."""
    grades = result.get("grades")
    if not grades:
        return []
    line = ", ".join(f"{count} {grade}" for grade, count in grades.items() if count) or "none"
    kinds = {kind: count for kind, count in (result.get("kinds") or {}).items() if count}
    if kinds:
        line += " (" + ", ".join(f"{kind}: {count}" for kind, count in kinds.items()) + ")"
    lines = [f"  calls:      {line}"]
    equivalent = result.get("equivalent") or ()
    for call in equivalent[:_SHOWN_EQUIVALENT]:
        lines.append(f"  equivalent: step {call['step']}, differing only in "
                     + ", ".join(call["fields"]))
    if len(equivalent) > _SHOWN_EQUIVALENT:
        lines.append(f"              and {len(equivalent) - _SHOWN_EQUIVALENT} more "
                     "equivalent call(s)")
    return lines


def _divergence(d: Mapping[str, Any], path: str, advice: str | None) -> list[str]:
    """The divergence: where, its kind, the nearest recorded call and how often it was
    played already, the diff, and what to do."""
    step = d["step"] if d["step"] is not None else "end"
    lines = [f"  divergence: step {step} ({d['kind']}): {d['reason']}"]
    if d.get("category"):
        changed = d.get("changed") or ()
        lines.append(f"              kind: {d['category']}"
                     + (f" ({', '.join(changed)})" if changed else ""))
    if d.get("nearest"):
        lines.append(f"              {d['nearest']}")
    if d.get("nearest_step") is not None and d.get("played") is not None:
        times = d["played"]
        lines.append(f"              the nearest recording, step {d['nearest_step']}, was "
                     f"already played {times} time{'' if times == 1 else 's'}")
    lines.extend("    " + line for line in (d.get("diff") or "").splitlines())
    lines.append("  next:       " + (advice or (
        "the agent's code or inputs changed since the run was recorded: fix it, record "
        "the run again" + (f", or fork it at this step (deja fork {path} --at "
                           f"{step} ...) to test the change" if d["step"] is not None
                           else ""))))
    return lines
