"""What a replay found: :class:`ReplayResult`, and the report deja prints of it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from recorder.cassette.rows import describe_split, describe_totals
from recorder.errors import DivergenceInfo

__all__ = ["ReplayResult"]


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

    @property
    def complete(self) -> bool:
        """Every recorded observation was asked for."""
        return not self.unused

    @property
    def identical(self) -> bool:
        return self.divergence is None and self.complete

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["unused"] = list(self.unused)
        out["notes"] = list(self.notes)
        out["identical"] = self.identical
        out["complete"] = self.complete
        return out

    def report(self) -> str:
        verdict = "identical" if self.identical else "DIVERGED"
        if not self.verified:
            verdict += " (NOT VERIFIED: what was served is unchecked)"
        lines = [f"replay of {self.run} ({self.path}): {verdict}",
                 f"  steps served: {self.steps_served}/{self.steps_recorded}"
                 f" in {self.seconds:.3f}s",
                 f"  signature: {self.verify_note}",
                 f"  recorded end status: {self.recorded_status or 'none (no end line)'}"]
        if self.totals is not None:
            lines.append(f"  recorded: {describe_totals(self.totals['all'])}")
            lines.extend(f"    {line}" for line in describe_split(self.totals))
        if self.divergence is not None:
            d = self.divergence
            step = d.step if d.step is not None else "end"
            lines.append(f"  first divergence at step {step} ({d.kind}): {d.reason}")
            if d.nearest:
                lines.append(f"  {d.nearest}")
            if d.diff:
                lines.extend("    " + line for line in d.diff.splitlines())
        elif self.unused:
            lines.append(f"  recorded steps never requested: {list(self.unused)[:20]}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)
