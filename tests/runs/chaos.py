"""The chaos table: paying runs of a real ``deja serve`` and ``deja worker`` under faults,
and what became of them.

A cell is a kill point (agent, launcher, worker, process group, server, database) x a
store (SQLite, Postgres) x a fault (SIGKILL, disk full, database restart). Each cell gets
a fresh world (:mod:`chaos_world`): its own ``DEJA_HOME``, database, cassette directory,
payments ledger, ``deja serve`` on a fixed port and one ``deja worker --jobs J``; runs of
the paying agent (:mod:`chaos_agent`, against the stub model) are submitted with ``deja
submit`` and the fault lands at seeded random points:

- SIGKILL of an agent or of a launcher: each run's own, once its cassette has a seeded
  number of lines (a quarter of the runs a second time, later); the worker alone
  restarts them (or not).
- SIGKILL of the worker, of the worker's process group, of ``deja serve``, of the
  database (Postgres: postmaster and backends): twice, when the cell's runs have written
  a seeded share of their lines; the harness starts what was killed again after a seeded
  delay, as an operator's supervisor would.
- Disk full: the disk the kill point writes to is a small tmpfs filled to the last byte
  for a few seconds, then freed: the cassette directory (agent: mid-run; launcher: when
  the runs are launched), ``$DEJA_HOME`` (worker: progress records, locks), the
  database's directory (database).
- Database restart: Postgres stopped (``pg_ctl stop -m fast``) for a few seconds and
  started; SQLite, which has no server, is locked by another process for as long (a
  backup or a migration holding it).

A supervisor thread starts again a worker, a server or a Postgres that exits on its own
(counted in the notes). Then every run is awaited until it ends (its status settled for
3 s) or the cell's time limit, and measured: completed without a human (the API says
``completed`` and so does the cassette's end line), payments made twice (the ledger
records every payment with its idempotency key and never deduplicates), lines lost (a
line on disk at a fault that is gone or changed at the end, and each step of an
uninterrupted reference run missing from a completed run's cassette), whether ``deja
verify`` holds, and status correct (``deja status RUN --json``, ``GET /runs/RUN`` and
``deja runs --json`` say the same, and it matches the cassette's end line).
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
import subprocess
import time
import zlib
from pathlib import Path
from typing import Any

from chaos_agent import ledger_lines
from chaos_cells import (
    END_TO_STATUS,
    ENDED,
    SETTLE,
    Cell,
    CellResult,
    Reference,
    RunResult,
    Settings,
)
from chaos_faults import Faults
from chaos_table import row
from chaos_world import AGENT, PYTHON, World
from runs_helpers import base_env, complete_lines, line_count, load_run

from recorder.errors import DejaError
from replayer.diff import aligned, compare, meaning


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def steps_of(cassette: Any) -> list[str]:
    return [canonical(meaning(cassette, o)) for o in aligned(cassette)]


def record_reference(folder: Path, stub_url: str, settings: Settings) -> Reference:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "reference.jsonl"
    env = base_env(folder / "home", ANTHROPIC_BASE_URL=stub_url,
                   CHAOS_LEDGER=str(folder / "ledger.jsonl"),
                   CHAOS_INVOICES=str(settings.invoices))
    done = subprocess.run([PYTHON, "-m", "deja", "record", "-o", str(path), "--", PYTHON,
                           str(AGENT)], env=env, cwd=folder, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    ref = load_run(path)
    assert ref.end is not None and ref.end["status"] == "completed"
    assert len(ledger_lines(folder / "ledger.jsonl")) == settings.invoices
    return Reference(tuple(steps_of(ref)), ref, line_count(path), path.stat().st_size)


# ------------------------------------------------------------------------ measuring


def _missing(ref: Reference, path: Path) -> tuple[int, str]:
    """Steps of the reference missing from a completed run's cassette (in order), and a
    note when the transcripts differ otherwise."""
    try:
        run = load_run(path)
    except DejaError as exc:  # the cassette does not load: every step is missing
        return len(ref.steps), f"cassette does not load ({type(exc).__name__}: {exc})"
    got = steps_of(run)
    i = missing = 0
    for step in ref.steps:
        j = next((k for k in range(i, len(got)) if got[k] == step), None)
        if j is None:
            missing += 1
        else:
            i = j + 1
    diff = compare(ref.cassette, run)
    return missing, "" if diff.same else f"transcript differs from step {diff.first_divergence}"


def _lost_since(snapshots: list[bytes], final: bytes) -> int:
    """Lines on disk at a fault (but a trailing end line that is not ``completed``, which
    a resume cuts) that are not where they were at the end."""
    worst = 0
    now = final.splitlines(keepends=True)
    for snap in snapshots:
        lines = snap.splitlines(keepends=True)
        if lines and b'"kind":"end"' in lines[-1] and b'"status":"completed"' not in lines[-1]:
            lines.pop()
        same = 0
        while same < min(len(lines), len(now)) and lines[same] == now[same]:
            same += 1
        worst = max(worst, len(lines) - same)
    return worst


def _end_line(path: Path) -> dict[str, Any] | None:
    lines = complete_lines(path).splitlines()
    if not lines:
        return None
    with contextlib.suppress(ValueError):
        last = json.loads(lines[-1])
        if last.get("kind") == "end":
            return dict(last)
    return None


def measure(world: World, runs: list[str], ref: Reference, faults: Faults,
            settled: bool) -> list[RunResult]:
    listed_done = world.cli("runs", "--json", "--label", f"chaos={world.cell.name}", "--limit",
                            "1000")
    listed = {}
    if listed_done.exit_code == 0:
        listed = {r["run_id"]: r["status"] for r in json.loads(listed_done.stdout)["runs"]}
    ledger = collections.defaultdict(list)
    for payment in ledger_lines(world.ledger):
        ledger[payment.get("run")].append(payment)
    out = []
    for run in runs:
        notes: list[str] = []
        code, record = world.api(f"/runs/{run}")
        api = record.get("status", "?") if code == 200 and isinstance(record, dict) \
            else f"HTTP {code}"
        error = str(record.get("error") or "") if isinstance(record, dict) else str(record)
        shown = world.cli("status", run, "--json")
        try:
            cli = json.loads(shown.stdout)["status"] if shown.exit_code == 0 else \
                f"exit {shown.exit_code}"
        except (ValueError, KeyError):
            cli = "unreadable"
        path = world.cassette(run)
        end = _end_line(path)
        end_status = None if end is None else str(end.get("status"))
        if end is not None and end_status != "completed":
            reason = end.get("reason") or (end.get("error") or {}).get("message")
            if reason:
                notes.append(f"end line reason: {str(reason)[:160]}")
        completed = api == "completed" and end_status == "completed"
        verified = True
        if path.exists():
            flags = [] if end_status == "completed" else ["--allow-incomplete", "--allow-torn"]
            verify = world.cli("verify", *flags, str(path))
            verified = verify.exit_code == 0
            if not verified:
                notes.append(f"verify: {verify.output.strip()[-200:]}")
        rows = ledger.get(run, [])
        by_invoice = collections.Counter(r["invoice"] for r in rows)
        paid_twice = sum(n - 1 for n in by_invoice.values())
        keys = collections.Counter(r["key"] for r in rows)
        if any(n > 1 for n in keys.values()):
            notes.append("an idempotency key paid twice")
        if completed and len(by_invoice) != world.settings.invoices:
            notes.append(f"{len(by_invoice)} invoices paid of {world.settings.invoices}")
        lost = _lost_since(faults.snapshots.get(run, []), complete_lines(path))
        if completed:
            missing, note = _missing(ref, path)
            lost += missing
            if note:
                notes.append(note)
        agree = api == listed.get(run) == cli
        expected = "failed" if end_status is None else END_TO_STATUS.get(end_status, end_status)
        status_ok = settled and agree and api == expected
        out.append(RunResult(run, api, listed.get(run, "absent"), cli, end_status, error,
                             completed, paid_twice, len(rows), lost, verified, status_ok,
                             notes))
    return out


# ------------------------------------------------------------------------ a cell, the table


def cell_seed(cell: Cell, seed: int) -> int:
    return zlib.crc32(cell.name.encode()) + seed


def run_cell(cell: Cell, base: Path, settings: Settings, ref: Reference,
             stub_url: str) -> CellResult:
    seed = cell_seed(cell, settings.seed)
    result = CellResult(cell, seed)
    if cell.na is not None:
        return result
    started = time.monotonic()
    rng = random.Random(seed)
    world = World(cell, base / cell.name, settings, stub_url)
    try:
        world.setup()
        deadline = time.monotonic() + settings.limit
        faults = Faults(world, rng, [], ref, deadline)
        if cell.kill == "launcher" and cell.fault == "disk full":
            runs = faults.launch_on_full_disk(lambda: world.submit(settings.runs))
            faults.runs = runs
        else:
            runs = world.submit(settings.runs)
            faults.runs = runs
            if cell.per_run:
                faults.per_run()
            else:
                faults.events()
        settled = wait_final(world, runs, time.monotonic() + settings.limit)
        result.runs = measure(world, runs, ref, faults, settled)
        result.faults, result.late = faults.landed, faults.late
        if not settled:
            result.notes.append(f"not all runs ended within {settings.limit:.0f} s of the "
                                "last fault")
        result.notes += [f"{what} x{n}" for what, n in sorted(world.restarts.items())]
        log = world.services["worker"].log()
        if log.count("Traceback"):
            result.notes.append(f"{log.count('Traceback')} tracebacks in the worker's log")
        if log.count(": heartbeat"):
            result.notes.append(f"{log.count(': heartbeat')} failed heartbeats in the "
                                "worker's log")
    finally:
        world.teardown()
        result.seconds = time.monotonic() - started
        (world.folder / "result.txt").write_text(
            "\n".join([row(result), *result.faults, *result.problems()]) + "\n")
    return result


def wait_final(world: World, runs: list[str], deadline: float) -> bool:
    """Until every run has ended and its status held for SETTLE seconds; False at the
    deadline. ``interrupted`` is not an end here: nobody in a cell interrupts a run on
    purpose, and the service resumes every interrupted run by itself (a worker's SIGTERM,
    a full disk once it has room again, after the next reconciliation)."""
    since: float | None = None
    seen: dict[str, str] | None = None
    final = ENDED - {"interrupted"}
    while time.monotonic() < deadline:
        found = world.statuses()
        if found is not None and all(found.get(r) in final for r in runs):
            if since is None or found != seen:
                since, seen = time.monotonic(), found
            elif time.monotonic() - since >= SETTLE:
                return True
        else:
            since = None
        time.sleep(0.5)
    return False
