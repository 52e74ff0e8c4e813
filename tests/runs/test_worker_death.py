"""Worker death: a worker killed with SIGKILL anywhere and restarted finishes its run as if
nothing had happened; on Postgres a live peer takes a dead worker's run over.

The reconciliation example (``examples/reconciliation.py``: 61 turns, 20 payments into an
external SQLite ledger keyed by deja's idempotency key) is submitted through the queue
(``deja.runs.service.Runs.submit``) and run by ``python -m deja worker --id w1``, a real
process with its own DEJA_HOME, embedded database and stub model. Each seed
(``random.Random(seed)``) kills the worker with SIGKILL once or twice, each time either
once the run's cassette has k lines (seed 0: the header alone; seed 1: the end line
written, before the worker has recorded how the run ended) or after a delay from the
worker's launch (which may come before it is up, or before it has dispatched the run),
and restarts it at once with the same id. After every kill:

- the killed worker's session empties within a few seconds: its ``deja record`` /
  ``deja resume`` and the agent under it get their parent-death signal and end
  ``interrupted``; no process naming the run lives outside the new worker's session;
- the new worker dispatches the run again (the time from its launch to the run's row
  saying ``working`` is measured);
- every complete line the cassette had at the kill is kept byte for byte (but a trailing
  ``interrupted`` end line, which a resume cuts).

Then the run is ``completed``, the ledger holds exactly an uninterrupted run's payments,
each once, under its intent's key, the transcript means the same as the uninterrupted
run's (``replayer.diff.compare``), and ``deja verify`` passes.

On Postgres two workers (``a`` and ``b``) share the database and the cassette directory;
the one running the run is killed mid-run, and the other takes it over (heartbeats, then
the engine's recovery call) within 15 s and completes it, with the same guarantees.

Without ``DEJA_WORKER_SEEDS`` the seeds are 0, 1, 5 and 7: the two edges (a kill at the
header, then one more later in the run; a kill once the end line is written), two kills
each a delay after a launch (5), and a delayed kill then one on lines (7).
``DEJA_WORKER_SEEDS=N`` runs seeds 0 to N-1 (``make stress`` runs 100: kills drawn all over
the run). Seeds run two at a time in background threads (every step is a subprocess; each
seed has its own home, database, stub model and worker); each seed's test waits for its
own and checks it. The figures (where the kills landed, restart to working, time for
orphans to die, takeover, wall time) are printed at the end of the module.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from pg_server import postgres_server_fixture, postgres_url_fixture  # noqa: F401
from runs_helpers import (
    SCRIPT,
    Reference,
    WorkerProcess,
    base_env,
    check_like_reference,
    complete_lines,
    describe,
    line_count,
    open_runs,
    processes_naming,
    reconciliation,
    record_reference,
    resumed_lines,
    sqlite_url,
    start_worker,
    story,
    submit,
    wait_up,
)

from deja.cli import main as cli_main
from deja.runs import service
from deja.runs.store import ENDED
from recorder.cassette import lock as writer_lock
from recorder.testing.server import StubServer

SEEDS = (range(int(os.environ["DEJA_WORKER_SEEDS"])) if os.environ.get("DEJA_WORKER_SEEDS")
         else (0, 1, 5, 7))
PG_SEEDS = (0, 1)
PARALLEL = 2
TIMEOUT = 120.0  # for a run to end, a kill point to be reached, a run to be dispatched
ORPHAN_GRACE = 15.0  # for the parent-death signal to end a killed worker's agents (under load)
TAKEOVER = 15.0  # the bound for a peer to take a dead worker's run over
MAX_DELAY = 4.5  # seconds after a launch a delayed kill may come
POLL = 0.002
KEY = "test-key-0123456789abcdef"
# A traceback through the runs package: the worker itself failed. (An agent killed while
# it boots may print one of its own: the signal interrupts its start-up imports.)
RUNS_FRAME = re.compile(r'File "[^"]*/runs/\w+\.py"|worker \w+: heartbeat')


# ------------------------------------------------------------------------ one seed


@dataclass(frozen=True)
class Kill:
    """Where a kill comes. ``lines``: the first kill once the cassette has ``at`` lines, a
    later one once it has grown by a share ``at`` (0..1) of what is left of the run;
    ``delay``: ``at`` seconds after the worker's launch."""

    how: str
    at: float


@dataclass
class Plan:
    """What a seed does, fixed before it runs (built in the main thread)."""

    seed: int
    kills: tuple[Kill, ...]
    dir: Path
    env: dict[str, str]
    runs: service.Runs
    run_id: str

    @property
    def cassette(self) -> Path:
        return self.dir / "cassettes" / f"{self.run_id}.jsonl"

    @property
    def ledger(self) -> Path:
        return self.dir / "ledger.sqlite"


@dataclass
class Killed:
    """One kill as it happened."""

    kill: Kill
    target: int | None  # the line count waited for (``lines``)
    late: bool  # the run had ended before the kill point came: no kill
    row_status: str  # the run's row at the kill
    lines: int = 0  # complete lines of the cassette at the kill
    kept: bytes = b""  # those lines
    orphans_s: float | None = None  # kill to the killed worker's session being empty
    orphans_left: str = ""  # what still lived ORPHAN_GRACE after the kill
    strays: str = ""  # processes naming the run outside the new worker's session
    restart_s: float | None = None  # the new worker's launch to the run working again


@dataclass
class Outcome:
    plan: Plan
    killed: list[Killed]
    final: dict[str, Any]
    logs: str
    seconds: float


def plan_kills(seed: int, ref_lines: int) -> tuple[Kill, ...]:
    rng = random.Random(seed)
    kills = []
    for i in range(rng.choice((1, 2))):
        if rng.random() < 0.6:
            at: float
            if i == 0:
                at = {0: 1, 1: ref_lines}.get(seed) or rng.randint(1, ref_lines)
            else:
                at = rng.random()
            kills.append(Kill("lines", at))
        else:
            kills.append(Kill("delay", round(rng.uniform(0.2, MAX_DELAY), 3)))
    if seed in (0, 1):  # the edges, first
        kills[0] = Kill("lines", 1 if seed == 0 else ref_lines)
    return tuple(kills)


def _ended(plan: Plan) -> bool:
    row = plan.runs.store.get_run(plan.run_id)
    return row is not None and row["status"] in ENDED


def _wait_kill_point(plan: Plan, worker: WorkerProcess, kill: Kill, target: int | None) -> bool:
    """Until the kill point; False when the run ended first."""
    deadline = time.monotonic() + TIMEOUT
    due = worker.started_mono + kill.at if kill.how == "delay" else None
    checked = 0.0
    while True:
        now = time.monotonic()
        if due is not None and now >= due:
            return not _ended(plan)
        if target is not None and line_count(plan.cassette) >= target:
            return not _ended(plan)
        assert worker.alive(), f"seed {plan.seed}: the worker exited:\n{worker.log()}"
        assert now < deadline, f"seed {plan.seed}: no kill point ({kill}):\n{worker.log()}"
        if now - checked > 0.1:
            checked = now
            if _ended(plan):
                return False
        time.sleep(POLL)


def _kept(data: bytes) -> bytes:
    """Complete lines that must survive: all but a trailing ``interrupted`` end line (a
    killed worker's agent writes one, and a resume cuts it)."""
    lines = data.splitlines(keepends=True)
    if lines and b'"kind":"end"' in lines[-1] and b'"status":"interrupted"' in lines[-1]:
        lines.pop()
    return b"".join(lines)


def _after_restart(plan: Plan, old: WorkerProcess, new: WorkerProcess, killed: Killed,
                   at_kill: float) -> None:
    """Until the old session is empty and the run is working again on the new worker."""
    deadline = time.monotonic() + TIMEOUT
    while killed.orphans_s is None or killed.restart_s is None:
        now = time.monotonic()
        if killed.orphans_s is None:
            left = old.orphans()
            if not left:
                killed.orphans_s = now - at_kill
            elif now - at_kill > ORPHAN_GRACE and not killed.orphans_left:
                killed.orphans_left = describe(left)
        if killed.restart_s is None:
            row = plan.runs.store.get_run(plan.run_id)
            assert row is not None
            if row["updated"] >= new.started and (row["status"] == "working" or
                                                  row["status"] in ENDED):
                killed.restart_s = row["updated"] - new.started
        if killed.orphans_left and killed.restart_s is not None:
            break
        assert new.alive(), f"seed {plan.seed}: the restarted worker exited:\n{new.log()}"
        assert now < deadline, f"seed {plan.seed}: not dispatched again:\n{new.log()}"
        time.sleep(0.02)
    strays = {pid: sid for pid, sid in processes_naming(plan.run_id).items()
              if sid != new.pid}
    killed.strays = describe(sorted(strays))


def _wait_end(plan: Plan, worker: WorkerProcess) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT
    while True:
        record = plan.runs.get(plan.run_id)
        if record["status"] in ENDED:
            return record
        assert worker.alive(), f"seed {plan.seed}: the worker exited:\n{worker.log()}"
        assert time.monotonic() < deadline, f"seed {plan.seed}: {record}\n{worker.log()}"
        time.sleep(0.1)


def run_seed(plan: Plan, ref_lines: int) -> Outcome:
    started = time.monotonic()
    server = StubServer(SCRIPT).start()
    env = {**plan.env, "ANTHROPIC_BASE_URL": server.url}
    workers: list[WorkerProcess] = []
    killed: list[Killed] = []
    try:
        worker = start_worker("w1", env, plan.dir / "logs")
        workers.append(worker)
        for kill in plan.kills:
            target = None
            if kill.how == "lines":
                if not killed:
                    target = int(kill.at)
                else:  # a share of what is left: at most the end line (after a resume)
                    now = line_count(plan.cassette)
                    target = now + 1 + int(kill.at * max(0, ref_lines - now))
            if not _wait_kill_point(plan, worker, kill, target):
                killed.append(Killed(kill, target, True, "ended"))
                break
            row = plan.runs.store.get_run(plan.run_id)
            worker.kill()
            at_kill = time.monotonic()
            kept = complete_lines(plan.cassette)
            one = Killed(kill, target, False, row["status"] if row else "none",
                         kept.count(b"\n"), _kept(kept))
            killed.append(one)
            old, worker = worker, start_worker("w1", env, plan.dir / "logs")
            workers.append(worker)
            _after_restart(plan, old, worker, one, at_kill)
        final = _wait_end(plan, worker)
        worker.stop()
        logs = "\n".join(f"--- {w.log_path.name}\n{w.log()}" for w in workers)
        return Outcome(plan, killed, final, logs, time.monotonic() - started)
    finally:
        for w in workers:
            w.reap()
        server.stop()


# ------------------------------------------------------------------------ the world


@dataclass
class Figures:
    """What the module measured, printed at its end."""

    lines: list[str] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    takeovers: list[float] = field(default_factory=list)
    pool_started: float | None = None
    pool_ended: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def summary(self) -> list[str]:
        out = []
        if self.outcomes:
            kills = [k for o in self.outcomes for k in o.killed]
            real = [k for k in kills if not k.late]
            restart = [k.restart_s for k in real if k.restart_s is not None]
            orphans = [k.orphans_s for k in real if k.orphans_s is not None]
            wall = (self.pool_ended or time.monotonic()) - (self.pool_started or 0.0)
            per_seed = collections.Counter(sum(not k.late for k in o.killed)
                                           for o in self.outcomes)
            out.append(
                f"worker death: {len(self.outcomes)} seeds in {wall:.1f} s ({PARALLEL} at a "
                f"time; a seed {statistics.median(o.seconds for o in self.outcomes):.1f} s "
                f"median); SIGKILLs {len(real)} (seeds by kills {dict(sorted(per_seed.items()))}"
                f"; by how {dict(collections.Counter(k.kill.how for k in real))}; run ended "
                f"before a kill point {len(kills) - len(real)}); run's row at the kill "
                f"{dict(collections.Counter(k.row_status for k in real))}; cassette lines at "
                f"the kills {sorted(k.lines for k in real)}")
            if restart:
                out.append(f"worker death: restart to working again: median "
                           f"{statistics.median(restart):.2f} s, max {max(restart):.2f} s; "
                           f"killed worker's agents gone after: median "
                           f"{statistics.median(orphans):.2f} s, max {max(orphans):.2f} s")
        if self.takeovers:
            out.append("worker death, Postgres: peer took the run over "
                       f"{', '.join(f'{t:.1f} s' for t in self.takeovers)} after the kill")
        return out + self.lines


@pytest.fixture(scope="module")
def figures(request: pytest.FixtureRequest) -> Any:
    f = Figures()
    yield f
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin(
        "capturemanager")
    if reporter is not None and capture is not None and f.summary():
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            for line in f.summary():
                reporter.write_line(line)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    with StubServer(SCRIPT) as server:
        return record_reference(tmp_path_factory.mktemp("worker-death-ref"), server.url)


@dataclass
class World:
    base: Path
    ref: Reference
    pool: ThreadPoolExecutor
    stack: contextlib.ExitStack
    figures: Figures
    futures: dict[int, Future[Outcome]] = field(default_factory=dict)

    def plan(self, seed: int) -> Plan:
        folder = self.base / f"seed{seed:03d}"
        home = folder / "home"
        home.mkdir(parents=True)
        env = base_env(home, DEJA_CASSETTE_DIR=str(folder / "cassettes"),
                       RECON_LEDGER=str(folder / "ledger.sqlite"))
        runs = self.stack.enter_context(open_runs(sqlite_url(home)))
        run_id = submit(runs, folder / "cassettes", reconciliation())
        return Plan(seed, plan_kills(seed, self.ref.lines), folder, env, runs, run_id)

    def submit(self, seed: int) -> Future[Outcome]:
        """Start a seed in the background (call from the main thread only)."""
        if seed not in self.futures:
            if self.figures.pool_started is None:
                self.figures.pool_started = time.monotonic()
            future = self.pool.submit(run_seed, self.plan(seed), self.ref.lines)
            future.add_done_callback(self._done)
            self.futures[seed] = future
        return self.futures[seed]

    def _done(self, future: Future[Outcome]) -> None:
        with self.figures.lock:
            self.figures.pool_ended = time.monotonic()


@pytest.fixture(scope="module")
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          reference: Reference, figures: Figures) -> Any:
    base = tmp_path_factory.mktemp("worker-death")
    pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="worker-death-seed")
    with contextlib.ExitStack() as stack:
        w = World(base, reference, pool, stack, figures)
        try:
            # Start every seed this session runs, in order, so that they overlap.
            for item in request.session.items:
                if isinstance(item, pytest.Function) and \
                        item.originalname == "test_worker_killed_then_restarted":
                    seed = item.callspec.params["seed"]
                    assert isinstance(seed, int)
                    w.submit(seed)
            yield w
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _verify(cassette: Path) -> None:
    verified = CliRunner().invoke(cli_main, ["verify", str(cassette)], env={"DEJA_KEY": KEY})
    assert verified.exit_code == 0, verified.output
    assert "end: completed" in verified.output


@pytest.mark.parametrize("seed", SEEDS)
def test_worker_killed_then_restarted(world: World, seed: int) -> None:
    out = world.submit(seed).result(timeout=900)
    world.figures.outcomes.append(out)
    plan = out.plan
    real = [k for k in out.killed if not k.late]
    where = (f"seed {seed}: run {plan.run_id}; kills "
             + "; ".join(f"{k.kill.how} {k.kill.at} (target {k.target}): "
                         + ("late" if k.late else f"{k.lines} lines, row {k.row_status}")
                         for k in out.killed))
    assert out.final["status"] == "completed", \
        f"{where}\n{out.final}\n{story(plan.cassette)}\n{out.logs}"
    assert out.final["worker"] == "w1", where
    for k in real:
        assert not k.orphans_left, f"{where}: alive {ORPHAN_GRACE} s after the kill: " \
                                   f"{k.orphans_left}"
        assert not k.strays, f"{where}: outside the live worker: {k.strays}"
        assert k.restart_s is not None, where

    final = plan.cassette.read_bytes()
    for k in real:  # nothing written before a kill is lost
        assert final.startswith(k.kept), where
    run = check_like_reference(world.ref, plan.cassette, plan.ledger,
                               f"{where}\n{story(plan.cassette)}")
    assert run.run == plan.run_id, where
    assert len(resumed_lines(run)) <= len(real), where
    assert not RUNS_FRAME.search(out.logs), f"{where}: the worker failed:\n{out.logs}"
    _verify(plan.cassette)


# ------------------------------------------------------------------------ Postgres


def _wait(what: str, check: Any, timeout: float, logs: Any, every: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout:.0f} s:\n" \
                                            f"{logs()}"
        time.sleep(every)


@pytest.mark.parametrize("seed", PG_SEEDS)
def test_a_live_peer_takes_over_a_killed_workers_run(postgres_url: str, tmp_path: Path,
                                                      reference: Reference,
                                                      figures: Figures, seed: int) -> None:
    rng = random.Random(seed)
    k = rng.randint(2, reference.lines - 20)  # mid-run: many turns still to go
    cassettes, ledger = tmp_path / "cassettes", tmp_path / "ledger.sqlite"
    workers: dict[str, WorkerProcess] = {}

    def logs() -> str:
        return "\n".join(f"--- {w.log_path.name}\n{w.log()}" for w in workers.values())

    with StubServer(SCRIPT) as server, open_runs(postgres_url) as runs:
        env = base_env(tmp_path / "home", DEJA_DATABASE_URL=postgres_url,
                       DEJA_CASSETTE_DIR=str(cassettes), RECON_LEDGER=str(ledger),
                       ANTHROPIC_BASE_URL=server.url)
        try:
            for name in ("a", "b"):
                workers[name] = start_worker(name, env, tmp_path / "logs")
            for w in workers.values():
                wait_up(w)
            run_id = submit(runs, cassettes, reconciliation())
            cassette = cassettes / f"{run_id}.jsonl"

            def holder() -> str | None:
                row = runs.store.get_run(run_id)
                assert row is not None and row["status"] not in ENDED, row
                return row["worker"] if row["status"] == "working" else None

            name = _wait("dispatch", holder, TIMEOUT, logs)
            _wait(f"{k} cassette lines", lambda: line_count(cassette) >= k, TIMEOUT, logs,
                  every=0.002)
            victim = workers[name]
            other = workers["b" if name == "a" else "a"]
            assert runs.get(run_id)["status"] == "working"
            victim.kill()
            killed_at = time.monotonic()
            kept = _kept(complete_lines(cassette))
            _wait("the killed worker's agents ending", lambda: not victim.orphans(),
                  ORPHAN_GRACE, lambda: describe(victim.orphans()))

            def taken_over() -> bool:
                record = runs.get(run_id)
                return record["worker"] == other.name and record["status"] == "working"

            _wait(f"worker {other.name} taking the run over", taken_over, TIMEOUT, logs)
            takeover = time.monotonic() - killed_at
            figures.takeovers.append(takeover)
            assert takeover <= TAKEOVER, f"taken over {takeover:.1f} s after the kill"

            def ended() -> dict[str, Any] | None:
                record = runs.get(run_id)
                return record if record["status"] in ENDED else None

            final = _wait("the run's end", ended, TIMEOUT, logs, every=0.1)
            where = f"seed {seed}: killed {name} at {k} lines; {other.name} took over"
            assert final["status"] == "completed", f"{where}\n{final}\n{logs()}"
            assert final["worker"] == other.name, where
            assert cassette.read_bytes().startswith(kept), where
            run = check_like_reference(reference, cassette, ledger, where)
            assert len(resumed_lines(run)) == 1, where
            assert "took over 1 run(s): " + run_id in other.log(), logs()
            other.stop()
            assert not RUNS_FRAME.search(logs()), logs()
            _verify(cassette)
        finally:
            for w in workers.values():
                w.reap()


# ------------------------------------------------------------------------ a slow last writer


def test_a_restarted_worker_waits_for_the_cassettes_last_writer(tmp_path: Path,
                                                                 reference: Reference) -> None:
    """A killed worker's agent may outlive it for a while (a tool stuck in a C call does
    not see its parent-death signal until the call returns), holding the cassette's writer
    lock. The restarted worker waits for it, then resumes: the run completes instead of
    its resume being refused. Here the test process is that last writer."""
    home = tmp_path / "home"
    home.mkdir()
    cassettes, ledger = tmp_path / "cassettes", tmp_path / "ledger.sqlite"
    workers: list[WorkerProcess] = []

    def logs() -> str:
        return "\n".join(f"--- {w.log_path.name}\n{w.log()}" for w in workers)

    with StubServer(SCRIPT) as server, open_runs(sqlite_url(home)) as runs:
        env = base_env(home, DEJA_CASSETTE_DIR=str(cassettes), RECON_LEDGER=str(ledger),
                       ANTHROPIC_BASE_URL=server.url)
        try:
            workers.append(start_worker("w1", env, tmp_path / "logs"))
            run_id = submit(runs, cassettes, reconciliation())
            cassette = cassettes / f"{run_id}.jsonl"
            _wait("40 cassette lines", lambda: line_count(cassette) >= 40, TIMEOUT, logs,
                  every=POLL)
            workers[0].kill()
            _wait("the killed worker's agents ending", lambda: not workers[0].orphans(),
                  ORPHAN_GRACE, logs)
            held = writer_lock.acquire(cassette, run=run_id, what="a slow-dying agent")
            try:
                workers.append(start_worker("w1", env, tmp_path / "logs"))

                def dispatched() -> bool:
                    row = runs.store.get_run(run_id)
                    return row is not None and row["updated"] >= workers[1].started
                _wait("the run dispatched again", dispatched, TIMEOUT, logs)
                time.sleep(2.0)  # the resume would have been refused by now
                assert runs.get(run_id)["status"] == "working", logs()
            finally:
                held.release()

            def ended() -> dict[str, Any] | None:
                record = runs.get(run_id)
                return record if record["status"] in ENDED else None

            final = _wait("the run's end", ended, TIMEOUT, logs, every=0.1)
            assert final["status"] == "completed", f"{final}\n{logs()}"
            run = check_like_reference(reference, cassette, ledger, f"run {run_id}")
            assert len(resumed_lines(run)) == 1
            assert "CassetteLocked" not in logs(), logs()
            workers[1].stop()
        finally:
            for w in workers:
                w.reap()
