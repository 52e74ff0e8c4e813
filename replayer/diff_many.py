"""Compare many runs at once: the incident, its fork, a replay-then-live of the fixed code...

The first run is the base. Every other run is aligned with it by what its steps mean
(:func:`replayer.diff.alignment`: the longest common subsequence of the steps' meanings,
then of their kind, name and arguments, then of their kind and name; what none of these
matches is paired in place, as a changed step), and the alignments are merged into rows:
one row per aligned step, a cell per run (its step, or none). Steps that runs have and
the base has not sit between the base's steps where each run has them, aligned with one
another the same way. So one inserted step is one row, and the steps after it stay
aligned.

Each cell is compared with the base's step of its row (:class:`replayer.diff.StepDiff`:
the changed fields, as ``deja diff A B`` lists them); a run's first divergence from the
base is the first row where its step differs or only one of the two has one. For two
runs, the rows are those of ``compare(a, b, align="meaning")``.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recorder.cassette import Cassette
from recorder.cassette.rows import step_count, step_name, step_status
from recorder.cassette.schema import Kind, Line
from recorder.terminal import visible, visible_json
from replayer.diff import (
    Pair,
    Prepared,
    RunDiff,
    StepDiff,
    _pair,
    align_keys,
    alignment,
    prepare,
    run_diff,
    step_diff,
)

__all__ = ["Cell", "ManyDiff", "ManyRow", "RunInfo", "compare_many"]

TAGS = string.ascii_uppercase  # the runs' names in a comparison: A (the base), B, C ...
ABSENT = "—"  # a cell of a run that has no such step


@dataclass(frozen=True)
class Cell:
    """One run's step in a row: its ``seq`` (as ``deja show`` numbers it), kind, name and
    status (an end line's: how the run ended)."""

    seq: int
    kind: str
    name: str
    status: str

    @classmethod
    def of(cls, line: Line) -> Cell:
        return cls(line["seq"], str(line.get("kind")), step_name(line), step_status(line))

    @property
    def text(self) -> str:
        if self.kind == Kind.END:
            return f"end {self.status}"
        return f"{self.seq} {self.kind} {self.name}".rstrip()


@dataclass(frozen=True)
class RunInfo:
    tag: str
    run: str
    path: str
    steps: int


@dataclass(frozen=True)
class ManyRow:
    """One aligned step: a cell per run (None: the run has no such step) and, by run tag,
    how each run's step differs from the base's (runs that mean the same are left out)."""

    cells: tuple[Cell | None, ...]
    changed: Mapping[str, StepDiff] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        return not self.changed


@dataclass(frozen=True)
class ManyDiff:
    """Runs compared with the first (the base), row by row; ``first_divergence`` is, by
    tag, the row of each other run's first divergence (None: it means the same as the
    base); ``versus`` the two-run diff of the base with each other run, aligned as the
    rows are."""

    runs: tuple[RunInfo, ...]
    rows: tuple[ManyRow, ...]
    first_divergence: Mapping[str, int | None]
    versus: tuple[RunDiff, ...]

    @property
    def same(self) -> bool:
        return all(row is None for row in self.first_divergence.values())

    @property
    def same_prefix(self) -> int:
        """How many rows come before the first that differs in any run."""
        return next((i for i, row in enumerate(self.rows) if not row.same), len(self.rows))

    def to_dict(self) -> dict[str, Any]:
        """``{"runs", "rows": [{"cells", "same", "changed"}], "first_divergence", "same"}``:
        a cell is ``{"seq", "kind", "name", "status"}`` or null; ``changed`` maps a run's
        tag to its changed fields (``{"path", "op", "a", "b"}``, ``a`` the base's side)."""
        rows = [{"cells": [asdict(c) if c else None for c in row.cells], "same": row.same,
                 "changed": {tag: [asdict(c) for c in step.changes]
                             for tag, step in row.changed.items()}} for row in self.rows]
        first = {tag: None if at is None else {
            "row": at, "seq": _seq(self.rows[at], TAGS.index(tag)),
            "base_seq": _seq(self.rows[at], 0)} for tag, at in self.first_divergence.items()}
        return {"runs": [asdict(r) for r in self.runs], "rows": rows,
                "first_divergence": first, "same": self.same}

    def render(self, *, max_changes: int = 8, width: int = 28) -> str:
        """The comparison as text: a line per run, then a column per run and a row per
        aligned step (see :func:`render`)."""
        return render(self, max_changes=max_changes, width=width)


def _seq(row: ManyRow, index: int) -> int | None:
    cell = row.cells[index]
    return cell.seq if cell is not None else None


# ---------------------------------------------------------------------- alignment


Grid = list[list[int | None]]
"""Rows of line indexes, one per run (None: the run has no line in that row)."""


def _grid(prepared: Sequence[Prepared], pairings: Sequence[Sequence[Pair]]) -> Grid:
    """Each run's alignment with the base merged into rows: the base's lines in order,
    and before each, the lines other runs have there and the base has not."""
    width, count = len(prepared), len(prepared[0].steps)
    based: Grid = [[k] + [None] * (width - 1) for k in range(count)]
    slots: list[Grid] = [[] for _ in range(count + 1)]  # slot k: before the base's line k
    for j, pairs in enumerate(pairings, 1):
        slot, inserted = 0, []
        for i, x in pairs:
            if i is None:
                inserted.append(x)
                continue
            _place(slots[slot], [y for y in inserted if y is not None], j, prepared)
            inserted = []
            based[i][j], slot = x, i + 1
        _place(slots[slot], [y for y in inserted if y is not None], j, prepared)
    rows: Grid = []
    for k in range(count + 1):
        rows += slots[k]
        if k < count:
            rows.append(based[k])
    return rows


def _place(rows: Grid, inserted: list[int], j: int, prepared: Sequence[Prepared]) -> None:
    """Put run ``j``'s lines ``inserted`` (none of them in the base) into the rows of one
    place between two of the base's lines, aligned with the lines other runs put there."""
    if not inserted:
        return
    firsts = [next((r, x) for r, x in enumerate(row) if x is not None) for row in rows]
    levels = range(len(prepared[j].keys))
    theirs = [[prepared[r].keys[level][x] for r, x in firsts] for level in levels]
    mine = [[prepared[j].keys[level][x] for x in inserted] for level in levels]
    merged: Grid = []
    for r, k in align_keys(theirs, mine):
        row: list[int | None] = rows[r] if r is not None else [None] * len(prepared)
        if k is not None:
            row[j] = inserted[k]
        merged.append(row)
    rows[:] = merged


def compare_many(cassettes: Sequence[Cassette]) -> ManyDiff:
    """Runs compared with the first, aligned by what their steps mean (see the module)."""
    if not 2 <= len(cassettes) <= len(TAGS):
        raise ValueError(f"compare 2 to {len(TAGS)} runs, not {len(cassettes)}")
    prepared = [prepare(c) for c in cassettes]
    base = prepared[0]
    grid = _grid(prepared, [alignment(base, other) for other in prepared[1:]])
    changed: list[dict[str, StepDiff]] = [{} for _ in grid]
    versus = []
    for j, other in enumerate(prepared[1:], 1):
        mine = [(n, (row[0], row[j])) for n, row in enumerate(grid)
                if row[0] is not None or row[j] is not None]
        steps = [step_diff(base, other, pair) for _, pair in mine]
        for (n, _), step in zip(mine, steps, strict=True):
            if step is not None:
                changed[n][TAGS[j]] = step
        versus.append(run_diff(base, other, [pair for _, pair in mine], steps))
    rows = tuple(ManyRow(tuple(Cell.of(p.steps[x]) if x is not None else None
                               for p, x in zip(prepared, row, strict=True)), changed[n])
                 for n, row in enumerate(grid))
    first = {TAGS[j]: next((n for n, row in enumerate(rows) if TAGS[j] in row.changed), None)
             for j in range(1, len(prepared))}
    runs = tuple(RunInfo(TAGS[j], p.cassette.run, str(p.cassette.path),
                         step_count(p.cassette)) for j, p in enumerate(prepared))
    return ManyDiff(runs, rows, first, tuple(versus))


# ---------------------------------------------------------------------- text


LEGEND = (f"* a row where a run differs from A; > a run's first divergence from A; "
          f"{ABSENT} no such step")


def where(diff: ManyDiff, tag: str) -> str:
    """What a run's first divergence from the base is, in words."""
    at = diff.first_divergence.get(tag)
    if at is None:
        return "the same as A"
    index = TAGS.index(tag)
    mine, base = diff.rows[at].cells[index], diff.rows[at].cells[0]
    if mine is None:
        assert base is not None
        return f"first divergence at row {at}: A's {_name(base)}, which {tag} has not"
    if base is None:
        return f"first divergence at row {at}: its {_name(mine)}, which A has not"
    if mine.kind == base.kind == Kind.END or mine.seq == base.seq:
        return f"first divergence at row {at}: {_name(mine)}"
    return f"first divergence at row {at}: {_name(mine)} (A's {_name(base)})"


def _name(cell: Cell) -> str:
    return "end line" if cell.kind == Kind.END else f"step {cell.seq}"


def _fit(text: str, width: int) -> str:
    text = visible(text)  # as wide as it is shown
    return text if len(text) <= width else text[:width - 1] + "…"


def render(diff: ManyDiff, *, max_changes: int = 8, width: int = 28) -> str:
    """The runs (one line each, with where each first parts from A), then a column per run
    and a row per aligned step: the same leading rows collapsed into one line, and so is
    any later stretch of more than five; the changed fields of each run listed under its
    row (``tag /path: base's value -> its value``)."""
    lines = [f"{r.tag} {r.run} ({r.steps} steps) {r.path}: "
             + ("the base" if r.tag == "A" else where(diff, r.tag)) for r in diff.runs]
    if diff.same:
        lines.append("same: every step means the same in every run")
        return visible("\n".join(lines))
    lines.append(LEGEND)
    cols = _columns(diff, width)
    lines += [_line("row", [_fit(f"{r.tag} {r.run}", cols) for r in diff.runs], cols),
              _line("", [_fit(Path(r.path).name, cols) for r in diff.runs], cols)]
    firsts = {at: tag for tag, at in diff.first_divergence.items() if at is not None}
    for start, stop, same in _stretches(diff):
        if same:
            lines.append(f"rows {start}-{stop - 1}: the same in every run ({stop - start} rows)"
                         if stop - start > 1 else f"row {start}: the same in every run")
            continue
        for n in range(start, stop):
            lines += _row_lines(diff, n, cols, firsts, max_changes)
    return visible("\n".join(lines))


def _columns(diff: ManyDiff, width: int) -> int:
    """The width of a run's column: its widest cell or header, up to ``width``."""
    texts = [len(c.text) + 1 for row in diff.rows for c in row.cells if c is not None]
    return min(width, max([*texts, *(len(r.run) + 2 for r in diff.runs), len(ABSENT)]))


def _line(head: str, cells: list[str], cols: int) -> str:
    return (f"{head:>4}  " + "  ".join(cell.ljust(cols) for cell in cells)).rstrip()


def _stretches(diff: ManyDiff) -> list[tuple[int, int, bool]]:
    """The rows as (start, stop, collapsed): the same leading rows collapsed, and any
    later stretch of more than five rows the same in every run."""
    out: list[tuple[int, int, bool]] = []
    start = 0
    for n in range(1, len(diff.rows) + 1):
        if n < len(diff.rows) and diff.rows[n].same == diff.rows[start].same:
            continue
        fold = diff.rows[start].same and (start == 0 or n - start > 5)
        out.append((start, n, fold))
        start = n
    return out


def _row_lines(diff: ManyDiff, n: int, cols: int, firsts: Mapping[int, str],
               max_changes: int) -> list[str]:
    row = diff.rows[n]
    marks = {TAGS.index(tag) for at, tag in firsts.items() if at == n}
    cells = [(">" if i in marks else " ") + (cell.text if cell is not None else ABSENT)
             for i, cell in enumerate(row.cells)]
    lines = [_line(f"{n}{'*' if not row.same else ' '}", [_fit(c, cols) for c in cells],
                   cols)]
    for tag, step in row.changed.items():
        shown = [c for c in step.changes if c.op not in ("added", "missing")]
        for change in shown[:max_changes]:
            a, b = _pair(change.a, change.b, width=60)
            a = "(absent)" if change.op == "add" else a
            b = "(absent)" if change.op == "remove" else b
            message = step.messages.get(change.path)
            lines.append(f"        {tag} {change.path or '/'}: {a} -> {b}"
                         + (f"  [{message}]" if message else ""))
        if len(shown) > max_changes:
            lines.append(f"        {tag} … {len(shown) - max_changes} more changes")
    return lines


def dumps(diff: ManyDiff, **extra: Any) -> str:
    """The comparison as JSON (:meth:`ManyDiff.to_dict`, with ``extra`` keys)."""
    return visible_json(json.dumps({**diff.to_dict(), **extra}, indent=2, default=str,
                                   ensure_ascii=False))
