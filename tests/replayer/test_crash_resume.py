"""Kill a recording anywhere with SIGKILL, resume it: nothing lost, nothing paid twice.

The seed-001 story. ``examples/reconciliation.py`` is a 61-turn agent (60 tool turns and
a summary) that looks invoices up and pays 20 of them into an external SQLite ledger,
keyed by deja's idempotency key. For every seed the recording process is killed at a
point the seed picks, then ``deja resume`` finishes the run, and:

- the resume exits 0 and the run ends ``completed``, with one ``resumed`` line per resume;
- the ledger holds exactly the payments of an uninterrupted run: every invoice once, each
  under the key of the intent the final cassette records for it;
- the final transcript means the same as the uninterrupted run's (``replayer.diff``);
- every complete line of the crashed file is a byte prefix of the final file (a torn last
  line is cut, and the resume says so);
- the final cassette verifies; a few of them are also replayed offline.

How a seed kills the run (``seed % 5``): 0 and 1 run ``deja record`` with
``RECON_CRASH=<n>:before_ledger`` / ``after_ledger``, so that the agent kills itself with
SIGKILL inside the n-th ``pay``, between its intent and its outcome; 2, 3 and 4 run the
program the way ``deja record`` does (``deja.boot.child_env``) and the harness sends
SIGKILL to it once the cassette has k lines, k anywhere from the header to the last line.
For 4 the harness then tears the last line, cutting the file inside it: a single
``write(2)`` of a line is in practice never torn by SIGKILL, so the torn tail is made by
hand, and only where a crash can leave one (not inside an intent line, since the tool body
starts only once its intent is on disk). When ``seed % 6 == 5`` the first resume is killed
too, inside its first live ``pay`` (before or after the ledger write), and a second resume
finishes the run (one ``resumed`` line per resume).

Without ``DEJA_CRASH_SEEDS`` the seeds are 0-5 and 11: each way of crashing once (2 and 3
at the two edges, the first line and the last), and both double kills (the resume killed
before, then after, its ledger write). ``DEJA_CRASH_SEEDS=N`` runs seeds 0 to N-1 (``make
stress`` runs 200: kill points drawn all over the run). Seeds run two at a time in
background threads (every step is a subprocess); each seed's test waits for its own and
checks it.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from deja.boot import child_env
from deja.cli import main as cli_main
from recorder.cassette import Cassette, load
from recorder.cassette.keys import Keyring
from recorder.launch import new_run_id
from recorder.testing.server import StubServer
from replayer.diff import compare, render

ROOT = Path(__file__).resolve().parents[2]
AGENT = "examples/reconciliation.py"
SCRIPT = ROOT / "examples" / "reconciliation.stub.json"
TINY = "tests/intent_agent.py"
KEY = "test-key-0123456789abcdef"  # conftest's DEJA_KEY, given explicitly to subprocesses
SEEDS = (range(int(os.environ["DEJA_CRASH_SEEDS"])) if os.environ.get("DEJA_CRASH_SEEDS")
         else (0, 1, 2, 3, 4, 5, 11))
WORKERS = 2
KILLS = ("before_ledger", "after_ledger", "harness", "harness", "harness_torn")
PAYS = 20
TIMEOUT = 120
REPLAYED_SEEDS = (0, 1, 2, 4)  # one of each way of crashing


def deja(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deja", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT)


def ledger_rows(path: Path) -> list[tuple[str, str, int, str]]:
    if not path.exists():
        return []
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT key, invoice, amount, confirmation FROM payments").fetchall()
    finally:
        db.close()


def kind_of(line: bytes) -> str:
    doc = json.loads(line)
    return "header" if "format" in doc else doc["kind"]


def resumed_lines(c: Cassette) -> list[dict[str, Any]]:
    return [o for o in c.observations if o["kind"] == "control" and o["event"] == "resumed"]


# ------------------------------------------------------------------------ one seed


@dataclass
class Plan:
    """What a seed does, fixed before it runs (built in the main thread)."""

    seed: int
    kill: str  # one of KILLS
    at: int  # the n-th pay (RECON_CRASH), or the line count k to kill at (harness)
    dir: Path
    record_env: dict[str, str]
    resume_env: dict[str, str]
    tear: random.Random
    again: str | None  # the first resume is killed too, inside its first live pay, here

    @property
    def cassette(self) -> Path:
        return self.dir / "run.jsonl"

    @property
    def ledger(self) -> Path:
        return self.dir / "ledger.sqlite"


@dataclass
class Crashed:
    """What happened to a seed: the crash, then the resume(s)."""

    plan: Plan
    record_rc: int
    complete: bytes  # the crashed file up to its last complete line
    torn: bool
    exited_first: bool  # the harness was too late: the program had already exited
    last_kind: str  # kind of the last complete line
    lines: int  # complete lines, header included
    paid_before_resume: bool | None  # for an open intent: was its ledger row there
    torn_kind: str | None  # kind of the line torn by hand
    resumes: list[subprocess.CompletedProcess] = field(default_factory=list)
    unfinished: list[bytes] = field(default_factory=list)  # after each resume that died


def _kill_at(proc: subprocess.Popen, path: Path, k: int) -> bool:
    """SIGKILL ``proc`` once ``path`` has ``k`` lines; False if it exited before."""
    seen, fh = 0, None
    deadline = time.monotonic() + TIMEOUT
    try:
        while proc.poll() is None:
            if fh is None and path.exists():
                fh = path.open("rb")
            if fh is not None:
                seen += fh.read().count(b"\n")
                if seen >= k:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return True
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"the program did not reach {k} lines")
            time.sleep(0.0005)
    finally:
        if fh is not None:
            fh.close()
    return False


def _tear(plan: Plan) -> str | None:
    """Cut the file inside its last line, if a crash could have left it so; its kind."""
    data = plan.cassette.read_bytes()
    lines = data.splitlines(keepends=True)
    if len(lines) < 2 or not data.endswith(b"\n") or kind_of(lines[-1]) == "intent":
        return None
    last = lines[-1]
    start = len(data) - len(last)
    os.truncate(plan.cassette, start + plan.tear.randint(1, len(last) - 1))
    return kind_of(last)


def crash_and_resume(plan: Plan) -> Crashed:
    plan.dir.mkdir(parents=True)
    exited_first, torn_kind = False, None
    if plan.kill in ("before_ledger", "after_ledger"):
        proc = deja("record", "-o", str(plan.cassette), "--", "python", AGENT,
                    env=plan.record_env)
        assert "can be resumed" in proc.stderr, proc.stderr
        rc = proc.returncode
    else:
        with (plan.dir / "stderr.txt").open("wb") as err:
            child = subprocess.Popen([sys.executable, AGENT], env=plan.record_env, cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=err)
            exited_first = not _kill_at(child, plan.cassette, plan.at)
            rc = child.returncode
        if plan.kill == "harness_torn":
            torn_kind = _tear(plan)
    data = plan.cassette.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    lines = complete.splitlines()
    last_kind = kind_of(lines[-1])
    paid: bool | None = None
    if last_kind == "intent":
        run = json.loads(lines[0])["run"]
        key = f"{run}:{json.loads(lines[-1])['seq']}"
        paid = any(row[0] == key for row in ledger_rows(plan.ledger))
    out = Crashed(plan, rc, complete, len(data) > len(complete), exited_first, last_kind,
                  len(lines), paid, torn_kind)
    for attempt in range(3):  # until it ends: normally once
        env = plan.resume_env
        if attempt == 0 and plan.again:
            env = {**env, "RECON_CRASH": f"1:{plan.again}"}
        out.resumes.append(deja("resume", str(plan.cassette), env=env))
        data = plan.cassette.read_bytes()
        if b'"kind":"end"' in data.splitlines()[-1]:
            break
        out.unfinished.append(data)
    return out


# ------------------------------------------------------------------------ the world


@dataclass
class World:
    base: Path
    env: dict[str, str]
    server: StubServer
    ref: Cassette
    ref_payments: set[tuple[str, int, str]]
    lines: int  # header + observations of the uninterrupted run
    pool: ThreadPoolExecutor
    futures: dict[int, Future] = field(default_factory=dict)
    server_stopped: bool = False
    env_dropped = ("ANTHROPIC_API_KEY", "DEJA_OLD_KEYS", "RECON_CRASH", "RECON_LEDGER")
    env_set = ("DEJA_HOME", "DEJA_KEY", "ANTHROPIC_BASE_URL")
    stats: list[Crashed] = field(default_factory=list)

    def plan(self, seed: int) -> Plan:
        rng = random.Random(seed)
        kill = KILLS[seed % len(KILLS)]
        folder = self.base / f"seed{seed:03d}"
        ledger = {"RECON_LEDGER": str(folder / "ledger.sqlite")}
        resume_env = {**self.env, **ledger}
        if kill in ("before_ledger", "after_ledger"):
            at = rng.randint(1, PAYS)
            record_env = {**resume_env, "RECON_CRASH": f"{at}:{kill}"}
        else:
            # Killed once the file has k lines: the edges first (the header alone; every
            # observation written), then anywhere.
            at = {2: 1, 3: self.lines}.get(seed) or rng.randint(1, self.lines)
            launch = child_env("record", report=str(folder / "report.json"),
                               cassette=str(folder / "run.jsonl"), run_id=new_run_id(),
                               argv=["python", AGENT], fsync="turn", labels={})
            record_env = {**{k: v for k, v in launch.items() if k not in self.env_dropped},
                          **{k: self.env[k] for k in self.env_set}, **ledger}
        again = None
        if seed % 6 == 5:  # and the resume crashes too
            again = ("before_ledger", "after_ledger")[seed // 6 % 2]
        return Plan(seed, kill, at, folder, record_env, resume_env, rng, again)

    def submit(self, seed: int) -> Future:
        """Start a seed in the background (call from the main thread only)."""
        if seed not in self.futures:
            assert not self.server_stopped, "the stub model is stopped: no seed can run now"
            self.futures[seed] = self.pool.submit(crash_and_resume, self.plan(seed))
        return self.futures[seed]


def _summary(stats: list[Crashed]) -> str:
    by_kill = collections.Counter(s.plan.kill for s in stats)
    open_intent = [s for s in stats if s.last_kind == "intent"]
    kinds = collections.Counter(s.last_kind for s in stats)
    return (f"crash/resume: {len(stats)} seeds; kills {dict(by_kill)}; "
            f"between intent and outcome {len(open_intent)} "
            f"(ledger already written {sum(bool(s.paid_before_resume) for s in open_intent)}, "
            f"inside the tool by RECON_CRASH "
            f"{sum(s.plan.kill.endswith('_ledger') for s in stats)}); "
            f"mid-line (torn) {sum(s.torn for s in stats)} "
            f"{dict(collections.Counter(s.torn_kind for s in stats if s.torn))}; "
            f"program exited before the harness kill {sum(s.exited_first for s in stats)}; "
            f"resume killed too {sum(len(s.resumes) > 1 for s in stats)}; "
            f"last complete line {dict(kinds)}; "
            f"crash points (lines) {sorted(s.lines for s in stats)}")


@pytest.fixture(scope="module")
def world(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("crash-resume")
    server = StubServer(SCRIPT).start()
    env = {k: v for k, v in os.environ.items() if k not in World.env_dropped}
    env.update(DEJA_HOME=str(base / "home"), DEJA_KEY=KEY, ANTHROPIC_BASE_URL=server.url)
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="crash-seed")
    try:
        ref_path = base / "reference.jsonl"
        ledger = base / "reference.sqlite"
        proc = deja("record", "-o", str(ref_path), "--", "python", AGENT,
                    env={**env, "RECON_LEDGER": str(ledger)})
        assert proc.returncode == 0, proc.stderr
        ref = load(ref_path, keyring=Keyring.of(KEY), require_signature=True,
                   allow_incomplete=False)
        assert ref.end is not None and ref.end["status"] == "completed"
        rows = ledger_rows(ledger)
        payments = {row[1:] for row in rows}
        assert len(rows) == len(payments) == PAYS
        w = World(base, env, server, ref, payments, len(ref.observations) + 1, pool)
        # Start every seed this session runs, in order, so that they overlap.
        for item in request.session.items:
            if getattr(item, "originalname", None) == "test_crash_anywhere_then_resume":
                w.submit(item.callspec.params["seed"])
        yield w
        plugins = request.config.pluginmanager
        reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin(
            "capturemanager")
        if w.stats and reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line("")
                reporter.write_line(_summary(w.stats))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        server.stop()


@pytest.mark.parametrize("seed", SEEDS)
def test_crash_anywhere_then_resume(world: World, seed: int) -> None:
    out: Crashed = world.submit(seed).result(timeout=600)
    world.stats.append(out)
    plan = out.plan
    where = (f"seed {seed}: {plan.kill} at {plan.at}; crashed after {out.lines} lines "
             f"(last {out.last_kind}{', torn' if out.torn else ''})")
    if plan.kill.endswith("_ledger"):
        assert out.last_kind == "intent", where  # killed inside pay, after its intent
        assert out.paid_before_resume is (plan.kill == "after_ledger"), where
    else:
        assert out.record_rc == -signal.SIGKILL or out.exited_first, where

    # One resume finishes the run (two when the first is killed inside a live pay); a torn
    # tail is reported and cut.
    lines = out.complete.splitlines()
    settled_done = out.last_kind == "intent" and out.paid_before_resume
    live_pays = PAYS - sum(kind_of(line) == "outcome" for line in lines) - settled_done
    assert len(out.resumes) == (2 if plan.again and live_pays else 1), where
    for died in out.resumes[:-1]:
        assert died.returncode != 0 and "it can be resumed" in died.stderr, died.stderr
        assert "end status none (still unfinished)" in died.stderr, died.stderr
    proc = out.resumes[-1]
    assert proc.returncode == 0, f"{where}\n{proc.stderr}"
    torn_note = "the last line is torn" in out.resumes[0].stderr
    assert torn_note is out.torn, f"{where}\n{out.resumes[0].stderr}"
    assert "end status completed" in proc.stderr, f"{where}\n{proc.stderr}"
    assert "turn 61: end_turn: Reconciliation done" in proc.stdout, where

    # Nothing acknowledged is lost: the crashed file's complete lines are kept byte for byte.
    final = plan.cassette.read_bytes()
    assert final.startswith(out.complete), where
    for data in out.unfinished:
        assert final.startswith(data), where
    run = load(plan.cassette, keyring=Keyring.of(KEY), require_signature=True,
               allow_incomplete=False)
    assert run.end is not None, where
    assert (run.end["status"], run.end["exit_code"]) == ("completed", 0), where
    resumed = resumed_lines(run)
    assert len(resumed) == len(out.resumes), where
    assert resumed[0]["seq"] == out.lines - 1, where  # right after the kept lines
    assert resumed[0]["detail"]["torn_cut_at"] == (len(out.complete) if out.torn else None)

    # The same run as one that was never interrupted.
    diff = compare(world.ref, run)
    assert diff.same, f"{where}\n{render(diff)}"

    # Exactly the payments of an uninterrupted run, each once, under its intent's key.
    rows = ledger_rows(plan.ledger)
    by_invoice = collections.Counter(row[1] for row in rows)
    assert max(by_invoice.values()) == 1, f"{where}: paid twice: {by_invoice}"
    assert len({row[0] for row in rows}) == len(rows), where
    assert {row[1:] for row in rows} == world.ref_payments, where
    intents = {o["args"]["invoice"]: o["seq"] for o in run.observations
               if o["kind"] == "intent"}
    assert sorted(row[0] for row in rows) == sorted(f"{run.run}:{intents[row[1]]}"
                                                    for row in rows), where

    verified = CliRunner().invoke(cli_main, ["verify", str(plan.cassette)],
                                  env={"DEJA_KEY": KEY})
    assert verified.exit_code == 0, verified.output
    assert "end: completed" in verified.output


def test_resumed_runs_replay_offline(world: World) -> None:
    """A few resumed cassettes replay identically with the model server stopped."""
    seeds = [s for s in REPLAYED_SEEDS if s in SEEDS]
    for seed in seeds:
        world.submit(seed)
    wait(list(world.futures.values()))  # nothing else needs the model any more
    outs = [world.futures[s].result() for s in seeds]
    world.server.stop()
    world.server_stopped = True
    for out in outs:
        proc = deja("replay", str(out.plan.cassette), env=out.plan.resume_env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "identical" in proc.stdout
        assert "turn 61: end_turn: Reconciliation done" in proc.stdout


# ------------------------------------------------------------------------ resume, case by case


def tiny(tmp_path: Path, *, crash: bool = True, settle: str = "none",
         name: str = "tiny.jsonl") -> Path:
    """Record tests/intent_agent.py, killed inside its side effect unless ``crash`` is off."""
    path = tmp_path / name
    env = {**os.environ, "INTENT_SETTLE": settle, "INTENT_CRASH": "1" if crash else "0"}
    proc = deja("record", "-o", str(path), "--", "python", TINY, env=env)
    assert (proc.returncode == 0) is not crash, proc.stderr
    return path


def resume_tiny(path: Path, settle: str = "none", *more: str) -> subprocess.CompletedProcess:
    return deja("resume", *more, str(path), env={**os.environ, "INTENT_SETTLE": settle})


def load_run(path: Path) -> Cassette:
    return load(path, keyring=Keyring.of(KEY), require_signature=True, allow_incomplete=False)


def test_resume_cuts_a_torn_last_line_and_says_so(tmp_path: Path) -> None:
    path = tiny(tmp_path)
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    assert [kind_of(line) for line in lines] == ["header", "tool", "tool", "tool", "intent"]
    # The process died writing seq 2: its line is half there, nothing after it.
    offset = len(b"".join(lines[:3]))
    path.write_bytes(data[:offset + len(lines[3]) // 2])
    proc = resume_tiny(path)
    assert proc.returncode == 0, proc.stderr
    assert f"the last line is torn (byte {offset}); it is cut before resuming" in proc.stderr
    assert "replayed 2 steps; end status completed" in proc.stderr
    final = path.read_bytes()
    assert final.startswith(data[:offset])
    run = load_run(path)
    assert run.end is not None and run.end["status"] == "completed"
    resumed = resumed_lines(run)
    assert len(resumed) == 1
    assert resumed[0]["seq"] == 2
    assert resumed[0]["detail"] == {"replayed": 2, "torn_cut_at": offset}
    assert [o["kind"] for o in run.observations] == ["tool", "tool", "control", "tool",
                                                     "intent", "outcome", "tool"]


def test_resume_refuses_a_tampered_cassette_and_writes_nothing(tmp_path: Path) -> None:
    path = tiny(tmp_path)
    data = path.read_bytes()
    assert data.count(b'"square":1}') == 1
    tampered = data.replace(b'"square":1}', b'"square":7}')
    path.write_bytes(tampered)
    proc = resume_tiny(path)
    assert proc.returncode == 2, proc.stderr
    assert "signature check failed at seq 1" in proc.stderr
    assert path.read_bytes() == tampered


def test_resume_refuses_a_completed_run(tmp_path: Path) -> None:
    path = tiny(tmp_path, crash=False)
    data = path.read_bytes()
    proc = resume_tiny(path)
    assert proc.returncode == 2, proc.stderr
    assert "already ended with status 'completed'" in proc.stderr
    assert path.read_bytes() == data


@pytest.mark.parametrize("settle, why", [
    ("none", "has no settle function"),
    ("unknown", "the bank's status API timed out"),
])
def test_an_unsettled_intent_needs_attention(tmp_path: Path, settle: str, why: str) -> None:
    path = tiny(tmp_path, settle=settle)
    crashed = path.read_bytes()
    proc = resume_tiny(path, settle=settle)
    assert proc.returncode == 1, proc.stderr
    assert "NeedsAttention" in proc.stderr
    assert "end status needs_attention" in proc.stderr
    assert path.read_bytes().startswith(crashed)
    run = load_run(path)
    assert run.end is not None
    assert (run.end["status"], run.end["reason"]) == ("needs_attention", "unsettled_intent")
    assert why in run.end["error"]["message"]
    assert run.end["error"]["type"] == "NeedsAttention"
    assert [o["kind"] for o in run.observations] == ["tool", "tool", "tool", "intent",
                                                     "control"]  # charge never ran again
    assert len(resumed_lines(run)) == 1
    # A run stopped for a person resumes; as it was, it stops the same way again
    again = resume_tiny(path, settle=settle)
    assert again.returncode == 1, again.stderr
    assert "the run ended needs_attention; its end line is cut" in again.stderr
    run = load_run(path)
    assert run.end is not None and run.end["status"] == "needs_attention"
    assert [o["kind"] for o in run.observations].count("intent") == 1  # charge never ran
    if settle == "none":  # once a person has checked: run again with the intent's key
        resent = resume_tiny(path, settle, "--resend", "charge")
        assert resent.returncode == 0, resent.stderr
        run = load_run(path)
        assert run.end is not None and run.end["status"] == "completed"
        outcome = next(o for o in run.observations if o["kind"] == "outcome")
        assert (outcome["intent"], outcome["key"]) == (3, f"{run.run}:3")


@pytest.mark.parametrize("settle", ["done", "not_done"])
def test_a_settled_intent_is_recorded_or_run_with_the_same_key(tmp_path: Path,
                                                                settle: str) -> None:
    path = tiny(tmp_path, settle=settle)
    proc = resume_tiny(path, settle=settle)
    assert proc.returncode == 0, proc.stderr
    run = load_run(path)
    assert run.end is not None and run.end["status"] == "completed"
    kinds = [o["kind"] for o in run.observations]
    assert kinds == ["tool", "tool", "tool", "intent", "control", "outcome", "tool"]
    outcome = run.observations[5]
    key = f"{run.run}:3"
    assert (outcome["intent"], outcome["key"]) == (3, key)
    assert outcome["result"] == {"charged": 5, "key": key}  # settle's answer, or a re-run
    assert len(resumed_lines(run)) == 1
