"""The faults of one chaos cell, at seeded points (see :mod:`chaos` for what each cell
does), with a snapshot of the runs' cassettes at each fault: the lines that must survive.
"""

from __future__ import annotations

import collections
import contextlib
import random
import sqlite3
import time
from collections.abc import Callable

from chaos_cells import ENDED, POLL, Reference
from chaos_world import World, run_processes, sigkill
from runs_helpers import complete_lines, line_count


class Faults:
    """The faults of one cell, at seeded points; a snapshot of the cassettes at each."""

    def __init__(self, world: World, rng: random.Random, runs: list[str], ref: Reference,
                 deadline: float) -> None:
        self.world, self.rng, self.runs, self.ref = world, rng, runs, ref
        self.deadline = deadline
        self.snapshots: dict[str, list[bytes]] = collections.defaultdict(list)
        self.landed: list[str] = []
        self.late = 0

    def snapshot(self, runs: list[str]) -> None:
        for run in runs:
            self.snapshots[run].append(complete_lines(self.world.cassette(run)))

    def ended(self) -> set[str]:
        found = self.world.statuses() or {}
        return {r for r, s in found.items() if s in ENDED}

    def per_run(self) -> None:
        """SIGKILL each run's agent (or launcher) at its own seeded line counts."""
        cell, lines = self.world.cell, self.ref.lines
        plan = {run: [self.rng.randint(1, lines - 1)] for run in self.runs}
        again = {run: self.rng.randint(1, lines // 2) for run in self.runs
                 if self.rng.random() < 0.25}
        checked = 0.0
        while plan and time.monotonic() < self.deadline:
            for run in list(plan):
                path = self.world.cassette(run)
                n = line_count(path)
                if n < plan[run][0]:
                    continue
                launcher, children = run_processes(path)
                pid = launcher if cell.kill == "launcher" else next(iter(children), None)
                if pid is None or not sigkill(pid):
                    continue  # between processes: the next look
                self.snapshot([run])
                self.landed.append(f"{run} {cell.kill} at line {n}")
                plan[run].pop(0)
                if run in again:
                    plan[run].append(n + again.pop(run))
                if not plan[run]:
                    del plan[run]
            if time.monotonic() - checked > 1.0:
                checked = time.monotonic()
                for run in self.ended() & set(plan):
                    self.late += len(plan.pop(run))
            time.sleep(POLL)
        self.late += sum(len(v) for v in plan.values())

    def progress(self) -> float:
        total = sum(self.world.cassette(r).stat().st_size if self.world.cassette(r).exists()
                    else 0 for r in self.runs)
        return total / (self.ref.size * len(self.runs))

    def events(self) -> None:
        """Two faults of the cell's service, at seeded shares of the runs' progress."""
        for share in (self.rng.uniform(0.1, 0.45), self.rng.uniform(0.5, 0.85)):
            if self._reached(share):
                self.inject()
            else:
                self.late += 1

    def _reached(self, share: float) -> bool:
        """Until the runs have written ``share`` of their lines; False when they all
        ended first (or the deadline came)."""
        checked = 0.0
        while self.progress() < share:
            if time.monotonic() - checked > 1.0:
                checked = time.monotonic()
                if self.ended() >= set(self.runs):
                    return False
            if time.monotonic() > self.deadline:
                return False
            time.sleep(POLL)
        return True

    def inject(self) -> None:
        w, cell, rng = self.world, self.world.cell, self.rng
        target = {"worker": "worker", "process group": "worker", "server": "server",
                  "database": "database"}.get(cell.kill, cell.kill)
        at = f"at {self.progress():.0%} of the lines"
        if cell.fault == "SIGKILL":
            with w.lock:
                w.down.add(target)
                if cell.kill == "worker":
                    w.services["worker"].kill()
                elif cell.kill == "process group":
                    w.services["worker"].kill_group()
                elif cell.kill == "server":
                    w.services["server"].kill()
                else:
                    assert w.pg is not None
                    w.pg.kill()
            self.snapshot(self.runs)
            pause = rng.uniform(0.2, 3.0)
            time.sleep(pause)
            with w.lock:
                if target == "database":
                    assert w.pg is not None
                    w.pg.start()
                else:
                    w.services[target].start(wait=False)
                w.down.discard(target)
            self.landed.append(f"SIGKILL {cell.kill} {at}, restarted after {pause:.1f} s")
        elif cell.fault == "database restart":
            pause = rng.uniform(3.0, 12.0)
            if w.pg is not None:
                with w.lock:
                    w.down.add("database")
                    w.pg.stop("fast")
                self.snapshot(self.runs)
                time.sleep(pause)
                with w.lock:
                    w.pg.start()
                    w.down.discard("database")
                self.landed.append(f"Postgres stopped {at} for {pause:.1f} s")
            else:
                self.snapshot(self.runs)
                held = self.lock_sqlite(pause)
                self.landed.append(f"SQLite locked {at} for {held:.1f} s")
        else:
            assert w.disk is not None
            filled = w.disk.fill()
            self.snapshot(self.runs)
            pause = rng.uniform(2.0, 8.0)
            time.sleep(pause)
            w.disk.free()
            self.landed.append(f"{cell.disk} full ({filled >> 10} KiB filler) {at} for "
                               f"{pause:.1f} s")

    def lock_sqlite(self, seconds: float) -> float:
        """Hold the SQLite database's write lock for ``seconds`` (from when it is got)."""
        path = self.world.db_url.split("sqlite:///", 1)[1]
        with contextlib.closing(sqlite3.connect(path, timeout=30, isolation_level=None)) as db:
            db.execute("BEGIN EXCLUSIVE")
            got = time.monotonic()
            time.sleep(seconds)
            db.execute("ROLLBACK")
        return time.monotonic() - got

    def launch_on_full_disk(self, submit: Callable[[], list[str]]) -> list[str]:
        """The launcher cell of a full disk: the cassette directory is full when the runs
        are submitted and launched, and freed a few seconds later."""
        w = self.world
        assert w.disk is not None
        filled = w.disk.fill()
        runs = submit()
        pause = self.rng.uniform(2.0, 8.0)
        time.sleep(pause)
        working = sum(s != "queued" for s in (w.statuses() or {}).values())
        self.snapshot(runs)
        w.disk.free()
        self.landed.append(f"cassettes full ({filled >> 10} KiB filler) at submission, "
                           f"freed after {pause:.1f} s ({working} runs dispatched by then)")
        return runs

