"""The chaos table as markdown: one row per cell, and docs/chaos.md around it (when, on
what machine, the seeds, what each fault and column means, the evidence of every run that
did not hold).
"""

from __future__ import annotations

import collections
import os
import subprocess
from pathlib import Path

from chaos_cells import SETTLE, CellResult, Settings

HEADER = ("| kill point | store | fault | runs | completed w/o human | paid twice | lines lost "
          "| status correct | notes |\n|---|---|---|---|---|---|---|---|---|")


def summary_notes(r: CellResult) -> str:
    if r.cell.na is not None:
        return f"n/a: {r.cell.na}"
    parts = [f"{len(r.faults)} faults landed" + (f", {r.late} came after the runs ended"
                                                 if r.late else "")]
    kinds = collections.Counter(x.api for x in r.runs if not x.completed)
    if kinds:
        parts.append("not completed: " + ", ".join(f"{n} {s}" for s, n in kinds.items()))
    errors = collections.Counter(x.error[:90] for x in r.runs if x.error and not x.completed)
    parts += [f"'{e}' x{n}" for e, n in errors.most_common(2)]
    wrong = collections.Counter(f"{x.api}/{x.listed}/{x.cli}/end {x.end}"
                                for x in r.runs if not x.status_ok)
    if wrong:
        parts.append("status api/runs/status/end: " + ", ".join(
            f"{k} x{n}" for k, n in wrong.most_common(2)))
    unverified = sum(not x.verified for x in r.runs)
    if unverified:
        parts.append(f"verify failed {unverified}")
    parts += r.notes
    return "; ".join(parts).replace("|", "/")


def row(r: CellResult) -> str:
    c = r.cell
    if c.na is not None:
        return f"| {c.kill} | {c.store} | {c.fault} | n/a | n/a | n/a | n/a | n/a | " \
               f"{summary_notes(r)} |"
    n = len(r.runs)
    return (f"| {c.kill} | {c.store} | {c.fault} | {n} | {r.completed}/{n} | {r.paid_twice} "
            f"| {r.lost} | {r.status_ok}/{n} | {summary_notes(r)} |")


def table(results: list[CellResult]) -> str:
    return "\n".join([HEADER, *(row(r) for r in results)])


FAULT_TEXT = """\
- **SIGKILL, agent / launcher**: each run's agent (the program under `deja record`) or its
  launcher (`deja record` / `deja resume`) is killed once its cassette has a seeded number
  of lines; a quarter of the runs are killed a second time, later. Nothing restarts them
  but the worker.
- **SIGKILL, worker / process group / server / database**: `deja worker` alone, its whole
  process group (the worker and every agent under it), `deja serve`, or Postgres (the
  postmaster and its backends) is killed twice, when the cell's runs have written a seeded
  share of their lines (10-45 %, then 50-85 %), and started again after a seeded 0.2-3 s,
  as a supervisor would.
- **disk full**: a small tmpfs is filled to its last byte for a seeded 2-8 s, then freed:
  the cassette directory mid-run (agent), the cassette directory when the runs are
  submitted and launched (launcher), `$DEJA_HOME` with the progress records and locks
  (worker), the database's directory (database: the SQLite file's, Postgres's data
  directory).
- **database restart**: Postgres stopped (`pg_ctl stop -m fast`) for a seeded 3-12 s and
  started again, twice; SQLite has no server: another process holds its write lock as
  long (what a backup or a migration does).

A supervisor thread also starts again a worker, a server or a Postgres that exits on its
own; the notes count those restarts."""

COLUMNS_TEXT = """\
- **runs**: paying runs submitted with `deja submit` (each pays {invoices} invoices through a
  side-effecting tool with a settle function, into a ledger that records every payment with
  its idempotency key and never deduplicates).
- **completed w/o human**: `GET /runs/ID` says `completed` and so does the cassette's end
  line, with no `deja resume` or answer from anyone.
- **paid twice**: ledger lines beyond the first for an invoice of a run (a key paid twice
  is also named in the notes). Must be 0.
- **lines lost**: a complete cassette line on disk at a fault that is gone or changed at the
  end (a trailing end line that is not `completed` excepted: a resume cuts it), plus each
  step of an uninterrupted reference run missing from a completed run's cassette. Must be 0.
  `deja verify` must hold too (notes).
- **status correct**: `deja status ID --json`, `GET /runs/ID` and `deja runs --json` say the
  same, and it is what the end line says (`completed`, `error` as `failed`, ...; no end
  line: `failed`), once the run's status has held for {settle:.0f} s."""


def _revision() -> str:
    """The commit the table ran on, and whether files differed from it."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=30).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                 cwd=root, text=True, capture_output=True,
                                 timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    changed = [line for line in changed if line.strip() and "docs/chaos.md" not in line]
    return f"commit {head or 'unknown'}" + (f" with {len(changed)} files changed" if changed
                                             else "")


def document(results: list[CellResult], settings: Settings, seconds: float,
             load: str) -> str:
    from datetime import UTC, datetime

    ran = [r for r in results if r.cell.na is None]
    runs = [x for r in ran for x in r.runs]
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    held = sum(r.holds for r in ran)
    revision = _revision()
    out = [
        "# The chaos table",
        "",
        "Paying runs of a real `deja serve` and `deja worker` under faults: what became of "
        "them. Generated by `make stress` (`DEJA_CHAOS=full` over "
        "`tests/runs/test_chaos.py`; the engine is `tests/runs/chaos.py`); do not edit by "
        "hand. `make test` runs a slice of it (a few cells, two runs each).",
        "",
        f"- generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC in {seconds / 60:.1f} min on "
        f"{os.cpu_count()} cores ({cpu}; load average {load} at the start)",
        f"- code: {revision}",
        f"- seeds: table seed {settings.seed}; a cell's seed is crc32(cell name) + "
        f"{settings.seed}",
        f"- per cell: {settings.runs} runs, {settings.jobs} at a time on one worker, "
        f"{settings.invoices} payments each, {settings.delay} s between turns; a run not "
        f"ended {settings.limit:.0f} s after the last fault counts as not completed",
        "- regenerate: `make stress` (or `DEJA_CHAOS=full .venv/bin/python -m pytest "
        "tests/runs/test_chaos.py`), as root (a full disk is a tmpfs)",
        "",
        f"**{len(runs)} paying runs in {len(ran)} cells** ({len(results) - len(ran)} n/a): "
        f"{sum(x.completed for x in runs)} completed without a human, "
        f"{sum(x.paid_twice for x in runs)} payments made twice, "
        f"{sum(x.lost for x in runs)} lines lost, {sum(x.status_ok for x in runs)} statuses "
        f"correct; {held} of {len(ran)} cells hold everything.",
        "",
        table(results),
        "",
        "## The faults",
        "",
        FAULT_TEXT,
        "",
        "## The columns",
        "",
        COLUMNS_TEXT.format(invoices=settings.invoices, settle=SETTLE),
    ]
    failing = [r for r in ran if not r.holds]
    if failing:
        out += ["", "## Runs that did not hold", ""]
        for r in failing:
            c = r.cell
            out.append(f"- **{c.kill} x {c.store} x {c.fault}** (seed {r.seed}; faults: "
                       + "; ".join(r.faults[:3]) + (" ..." if len(r.faults) > 3 else "")
                       + ")")
            out += ["  - " + p.replace("`", "'") for p in r.problems()[:4]]
            if len(r.problems()) > 4:
                out.append(f"  - ... and {len(r.problems()) - 4} more")
    return "\n".join(out) + "\n"
