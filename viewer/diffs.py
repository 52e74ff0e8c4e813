"""Runs compared side by side, for the diff page: :func:`replayer.diff_many.compare_many`
(every run aligned with the first by what its steps mean) laid out as the rows of a table.

The runs are tagged ``a``, ``b``, ``c`` ... in the order given, as the page's address names
them (``?a=R1&a_file=F1&b=R2&b_file=F2&c=...``); the first is the base every other run is
compared with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recorder.cassette.rows import step_count
from replayer.diff import FieldChange, RunDiff, StepDiff, render
from replayer.diff_many import TAGS, Cell, ManyDiff, compare_many
from viewer.step import load_cassette

__all__ = ["CELL_FIELDS", "DiffView", "diff_view"]

CELL_FIELDS = ("seq", "kind", "name", "status")  # a run's side of a row, as ``seq_a`` ...


@dataclass
class DiffView:
    """Runs aligned step by step, for a side-by-side page. ``rows``: one per aligned step,
    with each run's ``seq_<tag>``, ``kind_<tag>``, ``name_<tag>`` and ``status_<tag>``,
    ``same``, ``first`` (some run's first divergence from the base is here),
    ``first_<tag>`` for each run after the base, and ``changed`` (the changed fields'
    paths); ``changed`` maps a row to each differing run's :class:`StepDiff` by tag and
    ``changes`` a row to the second run's changed fields."""

    runs: list[dict[str, Any]]
    many: ManyDiff
    text: str
    rows: list[dict[str, Any]]
    changes: dict[int, tuple[FieldChange, ...]]
    changed: dict[int, dict[str, StepDiff]]

    @property
    def a(self) -> dict[str, Any]:
        return self.runs[0]

    @property
    def b(self) -> dict[str, Any]:
        return self.runs[1]

    @property
    def tags(self) -> list[str]:
        return [run["tag"] for run in self.runs]

    @property
    def result(self) -> RunDiff:
        """The base compared with the second run, aligned as the rows are."""
        return self.many.versus[0]

    @property
    def first_divergence(self) -> int | None:
        return self.result.first_divergence

    @property
    def same_prefix(self) -> int:
        """How many aligned rows come before the first that differs in any run."""
        return self.many.same_prefix


def _cell(tag: str, cell: Cell | None) -> dict[str, Any]:
    return {f"{name}_{tag}": getattr(cell, name) if cell is not None else None
            for name in CELL_FIELDS}


def diff_view(paths: Sequence[Path]) -> DiffView:
    """The cassettes at ``paths`` compared with the first (2 to 26 of them)."""
    cassettes = [load_cassette(path) for path in paths]
    many = compare_many(cassettes)
    tags = [tag.lower() for tag in TAGS[:len(paths)]]
    rows: list[dict[str, Any]] = []
    for n, row in enumerate(many.rows):
        out: dict[str, Any] = {"step": n}
        for tag, cell in zip(tags, row.cells, strict=True):
            out.update(_cell(tag, cell))
        marked = {tag.lower() for tag, at in many.first_divergence.items() if at == n}
        out.update({f"first_{tag}": tag in marked for tag in tags[1:]})
        out.update(same=row.same, first=bool(marked), changed=", ".join(dict.fromkeys(
            change.path or "/" for step in row.changed.values() for change in step.changes)))
        rows.append(out)
    changed = {n: {tag.lower(): step for tag, step in row.changed.items()}
               for n, row in enumerate(many.rows) if row.changed}
    changes = {n: steps["b"].changes for n, steps in changed.items() if "b" in steps}
    runs = [{"tag": tag, "name": c.run, "run": c.run, "path": str(path), "steps": step_count(c)}
            for tag, c, path in zip(tags, cassettes, paths, strict=True)]
    text = render(many.versus[0]) if len(paths) == 2 else many.render()
    return DiffView(runs, many, text, rows, changes, changed)
