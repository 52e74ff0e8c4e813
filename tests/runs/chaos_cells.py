"""The cells of the chaos table and what a cell measured (data only; :mod:`chaos` runs
them).

A cell is a kill point x a store x a fault; :attr:`Cell.na` says why a combination cannot
exist. :class:`RunResult` is one paying run as measured, :class:`CellResult` a cell's runs
and faults, :class:`Settings` the sizes of a table (runs per cell, concurrency, limits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KILL_POINTS = ("agent", "launcher", "worker", "process group", "server", "database")
STORES = ("SQLite", "Postgres")
FAULTS = ("SIGKILL", "disk full", "database restart")
ENDED = frozenset({"completed", "failed", "cancelled", "exhausted", "stopped", "interrupted",
                   "needs_attention"})
END_TO_STATUS = {"error": "failed"}  # the end line's word for a status the API names so
SETTLE = 3.0  # seconds every run's status must hold before it is final
POLL = 0.02


@dataclass(frozen=True)
class Cell:
    kill: str
    store: str
    fault: str

    @property
    def name(self) -> str:
        return "-".join(p.lower().replace(" ", "_") for p in (self.kill, self.store, self.fault))

    @property
    def na(self) -> str | None:
        """Why the cell cannot exist, or None."""
        if self.fault == "SIGKILL" and self.kill == "database" and self.store == "SQLite":
            return ("the embedded database has no process of its own: it lives in the "
                    "worker and the server (their rows)")
        if self.fault == "disk full" and self.kill == "process group":
            return ("a disk fills for every process at once: the agent, launcher, worker "
                    "and database rows fill the disk each writes")
        if self.fault == "disk full" and self.kill == "server":
            return "deja serve writes only to the database: the database row fills its disk"
        if self.fault == "database restart" and self.kill != "database":
            return "a restart has one target, the database (its row)"
        return None

    @property
    def disk(self) -> str | None:
        """The directory a disk-full cell fills."""
        if self.fault != "disk full":
            return None
        return {"agent": "cassettes", "launcher": "cassettes", "worker": "home",
                "database": "db" if self.store == "SQLite" else "pg"}[self.kill]

    @property
    def per_run(self) -> bool:
        return self.fault == "SIGKILL" and self.kill in ("agent", "launcher")


CELLS = tuple(Cell(k, s, f) for f in FAULTS for k in KILL_POINTS for s in STORES)


@dataclass(frozen=True)
class Settings:
    runs: int = 10  # paying runs per cell
    jobs: int = 5  # runs at a time on the worker
    invoices: int = 6  # payments per run
    delay: float = 0.1  # seconds the agent waits after each turn
    limit: float = 240.0  # seconds for a cell's runs to end after its last fault
    seed: int = 1


@dataclass
class RunResult:
    run_id: str
    api: str
    listed: str
    cli: str
    end: str | None
    error: str
    completed: bool
    paid_twice: int
    payments: int
    lost: int
    verified: bool
    status_ok: bool
    notes: list[str] = field(default_factory=list)


@dataclass
class CellResult:
    cell: Cell
    seed: int
    runs: list[RunResult] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    late: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def completed(self) -> int:
        return sum(r.completed for r in self.runs)

    @property
    def paid_twice(self) -> int:
        return sum(r.paid_twice for r in self.runs)

    @property
    def lost(self) -> int:
        return sum(r.lost for r in self.runs)

    @property
    def status_ok(self) -> int:
        return sum(r.status_ok for r in self.runs)

    @property
    def holds(self) -> bool:
        return bool(self.runs) and self.completed == len(self.runs) and not self.paid_twice \
            and not self.lost and self.status_ok == len(self.runs) and \
            all(r.verified for r in self.runs)

    def problems(self) -> list[str]:
        """Each run that did not hold, with its evidence."""
        return [f"{r.run_id}: status {r.api} (runs {r.listed}, status {r.cli}, end line "
                f"{r.end}){': ' + r.error if r.error else ''}; paid twice {r.paid_twice}; "
                f"payments {r.payments}; lines lost {r.lost}; verify "
                f"{'ok' if r.verified else 'FAILED'}" + "".join(f"; {n}" for n in r.notes)
                for r in self.runs if not (r.completed and r.status_ok and r.verified and
                                           not r.paid_twice and not r.lost)]

@dataclass(frozen=True)
class Reference:
    """The paying agent recorded once, uninterrupted."""

    steps: tuple[str, ...]  # each step's meaning, canonical JSON
    cassette: Any
    lines: int
    size: int
