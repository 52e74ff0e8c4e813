"""What a sweep found (:mod:`replayer.sweep`): a row per fork, and the report of them all,
as ``deja sweep`` prints it (its table, then which perturbations changed the outcome) and
as JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from recorder.terminal import visible

if TYPE_CHECKING:
    from replayer.sweep import Perturbation

__all__ = ["SweepReport", "SweepRow"]


@dataclass(frozen=True)
class SweepRow:
    """What one fork did: its end ``status`` and ``exit_code``, its final ``answer``, its
    ``live`` totals (model, tool and HTTP calls, tokens, cost of what it ran live),
    ``policy`` (tool calls its tool policy answered without running them), or the
    ``error`` that kept it from running."""

    perturbation: Perturbation
    cassette: str
    exit_code: int | None
    status: str | None = None
    answer: str | None = None
    answer_changed: bool = False
    status_changed: bool = False
    live: Mapping[str, Any] = field(default_factory=dict)
    policy: int = 0
    seconds: float = 0.0
    error: str | None = None
    worker: str | None = None  # the deja worker that ran the fork (None: here)

    @property
    def changed(self) -> bool:
        return self.answer_changed or self.status_changed

    def to_dict(self) -> dict[str, Any]:
        return {**self.perturbation.to_dict(), "cassette": self.cassette,
                "exit_code": self.exit_code, "status": self.status, "answer": self.answer,
                "answer_changed": self.answer_changed, "status_changed": self.status_changed,
                "changed": self.changed, "live": dict(self.live), "policy_calls": self.policy,
                "seconds": round(self.seconds, 3), "error": self.error, "worker": self.worker}


@dataclass(frozen=True)
class SweepReport:
    """A sweep of run ``run`` (``cassette``, which ended ``status`` with final answer
    ``answer``): one row per perturbation, in step order."""

    cassette: str
    run: str
    status: str
    answer: str | None
    rows: tuple[SweepRow, ...]
    out_dir: str

    @property
    def changed(self) -> list[SweepRow]:
        return [row for row in self.rows if row.error is None and row.changed]

    @property
    def errors(self) -> list[SweepRow]:
        return [row for row in self.rows if row.error is not None]

    @property
    def exit_code(self) -> int:
        """What ``deja sweep`` exits with: 2 when a fork could not run, else 1 when a
        perturbation changed the outcome, else 0."""
        return 2 if self.errors else 1 if self.changed else 0

    def to_dict(self) -> dict[str, Any]:
        return {"cassette": self.cassette, "run": self.run, "out_dir": self.out_dir,
                "recorded": {"status": self.status, "answer": self.answer},
                "forks": len(self.rows), "changed": len(self.changed),
                "errors": len(self.errors), "exit_code": self.exit_code,
                "rows": [row.to_dict() for row in self.rows]}

    def render(self) -> str:
        """The table ``deja sweep`` prints, then which perturbations changed the outcome."""
        lines = [f"deja sweep of run {self.run} ({self.cassette}): {len(self.rows)} fork(s), "
                 f"{len(self.changed)} changed the outcome"
                 + (f", {len(self.errors)} could not run" if self.errors else ""),
                 f"recorded: {self.status}; final answer: {_quote(self.answer)}", ""]
        table: list[tuple[str, ...]] = [("step", "target", "perturbation", "end status",
                                         "exit", "final answer", "live calls", "cost",
                                         "cassette")]
        table += [tuple(map(visible, _cells(row))) for row in self.rows]  # before widths
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                  for r in table]
        lines.append("")
        if self.changed:
            lines.append("changed the outcome:")
            lines += [f"  {_what(row)}: {_how(self, row)}" for row in self.changed]
        else:
            lines.append("no perturbation changed the outcome")
        lines += [f"could not run: {_what(row)}: {row.error}" for row in self.errors]
        return visible("\n".join(lines))


def _quote(text: str | None, width: int = 70) -> str:
    if text is None:
        return "(none)"
    flat = " ".join(text.split())
    return json.dumps(flat if len(flat) <= width else flat[: width - 1] + "…",
                      ensure_ascii=False)


def _what(row: SweepRow) -> str:
    p = row.perturbation
    return f"step {p.step} {p.target} {p.label}"


def _how(report: SweepReport, row: SweepRow) -> str:
    said = [f"{row.status} (recorded: {report.status})" if row.status_changed
            else str(row.status)]
    if row.answer_changed:
        said.append(f"final answer {_quote(row.answer)}")
    return "; ".join(said)


def _cells(row: SweepRow) -> tuple[str, ...]:
    p, live = row.perturbation, row.live
    if row.error is not None:
        result = ("error", "" if row.exit_code is None else str(row.exit_code), "-", "", "")
    else:
        calls = (f"{live.get('model_calls', 0)} model, {live.get('tool_calls', 0)} tool"
                 + (f", {live['http_calls']} http" if live.get("http_calls") else "")
                 + (f" ({row.policy} by policy)" if row.policy else ""))
        result = (str(row.status) + (" *" if row.status_changed else ""),
                  str(row.exit_code), "changed" if row.answer_changed else "same", calls,
                  f"${float(live.get('cost_usd') or 0):.6f}")
    return (str(p.step), f"{p.step_kind} {p.target}", p.label, *result, row.cassette)
