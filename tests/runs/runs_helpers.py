"""Durable runs driven from the runs tests: workers as real processes, the reconciliation
example submitted through the queue, and what an uninterrupted run of it looks like.

- :func:`start_worker` launches ``python -m deja worker --id NAME`` in a session of its own
  (its agents, started with a parent-death signal, stay in that session), with the
  environment the agent needs; a submission stores only its command, cwd, labels and
  guards, so the stub model's address and the ledger's path reach the agent through the
  worker. :meth:`WorkerProcess.reap` kills whatever is left of the session: every test
  calls it in a ``finally``.
- :func:`session_processes` and :func:`processes_naming` find the processes a killed
  worker may have left behind: those of its session, and any that names the run.
- :func:`open_runs` / :func:`submit` are the submitting side, as ``deja serve`` does it
  (``deja.runs.service.Runs``): the cassette path a submission stores comes from the
  submitting process's ``DEJA_CASSETTE_DIR``, which :func:`submit` sets for the call.
- :func:`record_reference` records the reconciliation once, uninterrupted, with
  ``deja record``; :func:`check_like_reference` asserts a finished run against it: the run
  completed, its transcript means the same (``replayer.diff.compare``), the ledger holds
  exactly the reference's payments, each once under its intent's key.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deja.runs import engine, service
from deja.runs.store import Store
from recorder.cassette import Cassette, load
from recorder.cassette.keys import Keyring
from replayer.diff import compare, render

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "examples" / "reconciliation.py"
SCRIPT = ROOT / "examples" / "reconciliation.stub.json"
KEY = "test-key-0123456789abcdef"  # conftest's DEJA_KEY, given explicitly to subprocesses
PAYS = 20
DROPPED = ("ANTHROPIC_API_KEY", "DEJA_OLD_KEYS", "RECON_CRASH", "RECON_LEDGER",
           "RECON_DELAY", "DEJA_DATABASE_URL", "DEJA_CASSETTE_DIR")


def base_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a subprocess: its own key home, the test key."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    env.update(DEJA_HOME=str(home), DEJA_KEY=KEY, **extra)
    return env


def sqlite_url(home: Path) -> str:
    """The embedded default database of a worker whose ``DEJA_HOME`` is ``home``."""
    return f"sqlite:///{(home / 'runs.sqlite').resolve()}"


# ------------------------------------------------------------------------ workers


@dataclass
class WorkerProcess:
    """One ``deja worker`` process, the leader of its own session."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    started: float  # time.time() when it was launched
    started_mono: float

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the worker alone: its agents are left to their parent-death signal."""
        self.process.kill()  # a no-op once it is waited for: never another process
        self.process.wait()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, as a service manager stops it; its exit status."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.reap()
            raise AssertionError(f"worker {self.name} did not stop {timeout:.0f} s after "
                                 f"SIGTERM:\n{self.log()}") from None

    def reap(self) -> None:
        """Kill everything left of the worker's session (cleanup, also after a failure).

        The group is signalled only while the worker is not yet waited for: until then its
        pid (the group's id) cannot be another process's. Afterwards what is left of its
        session is found in /proc (its orphans keep the session id in use)."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.process.wait()
        for pid in self.orphans():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def orphans(self) -> list[int]:
        """The live processes of the worker's session but the worker: once it is dead,
        its agents that outlived it."""
        return [pid for pid in session_processes(self.pid) if pid != self.pid]


def start_worker(name: str, env: dict[str, str], folder: Path) -> WorkerProcess:
    """``python -m deja worker --id NAME`` with ``env``; its output goes to a log in
    ``folder`` (one file per launch)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(list(folder.glob(f"worker-{name}-*.log")))
    log_path = folder / f"worker-{name}-{n}.log"
    with log_path.open("wb") as log:
        started, mono = time.time(), time.monotonic()
        process = subprocess.Popen([sys.executable, "-m", "deja", "worker", "--id", name],
                                   env=env, cwd=folder, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    return WorkerProcess(name, process, log_path, started, mono)


def wait_up(worker: WorkerProcess, timeout: float = 60.0) -> None:
    """Until the worker says it is up."""
    deadline = time.monotonic() + timeout
    while f"worker {worker.name} is up" not in worker.log():
        assert worker.alive(), f"worker {worker.name} exited:\n{worker.log()}"
        assert time.monotonic() < deadline, f"worker {worker.name} not up:\n{worker.log()}"
        time.sleep(0.05)


# ------------------------------------------------------------------------ processes


def _stat(pid: str) -> tuple[str, int] | None:
    """(state, session id) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[3])


def session_processes(sid: int) -> list[int]:
    """The live processes (zombies left out) of session ``sid``."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            stat = _stat(pid)
            if stat is not None and stat[1] == sid and stat[0] != "Z":
                out.append(int(pid))
    return out


def processes_naming(text: str) -> dict[int, int]:
    """Live processes whose command line or environment holds ``text``: pid -> session."""
    needle = text.encode()
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        stat = _stat(pid)
        if stat is None or stat[0] == "Z":
            continue
        for name in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as fh:
                    found = needle in fh.read()
            except OSError:
                found = False
            if found:
                out[int(pid)] = stat[1]
                break
    return out


def describe(pids: list[int]) -> str:
    parts = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
            parts.append(f"{pid}: {cmdline[:160]}")
        except OSError:
            parts.append(f"{pid}: (gone)")
    return "; ".join(parts)


# ------------------------------------------------------------------------ submitting

_env_guard = threading.Lock()


@contextlib.contextmanager
def open_runs(url: str) -> Iterator[service.Runs]:
    """``deja.runs.service.Runs`` on the database at ``url`` (what ``deja serve`` holds)."""
    store = Store(url)
    client = engine.Client(url)
    try:
        yield service.Runs(store, client)
    finally:
        client.close()
        store.close()


def submit(runs: service.Runs, cassettes: Path, payload: dict[str, Any]) -> str:
    """Submit ``payload``; its cassette goes under ``cassettes``. The run id."""
    with _env_guard:
        before = os.environ.get("DEJA_CASSETTE_DIR")
        os.environ["DEJA_CASSETTE_DIR"] = str(cassettes)
        try:
            answer = runs.submit(payload)
        finally:
            if before is None:
                del os.environ["DEJA_CASSETTE_DIR"]
            else:
                os.environ["DEJA_CASSETTE_DIR"] = before
    assert answer["status"] == "queued", answer
    return str(answer["run_id"])


def reconciliation() -> dict[str, Any]:
    """The submission of the reconciliation example."""
    return {"command": [sys.executable, str(AGENT)], "cwd": str(ROOT),
            "labels": {"example": "reconciliation"}}


# ------------------------------------------------------------------------ files


def ledger_rows(path: Path) -> list[tuple[str, str, int, str]]:
    if not path.exists():
        return []
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute("SELECT key, invoice, amount, confirmation FROM payments").fetchall()


def complete_lines(path: Path) -> bytes:
    """The file up to its last newline (b"" when there is none)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return b""
    return data[:data.rfind(b"\n") + 1]


def line_count(path: Path) -> int:
    return complete_lines(path).count(b"\n")


def load_run(path: Path) -> Cassette:
    return load(path, keyring=Keyring.of(KEY), require_signature=True, allow_incomplete=False)


# ------------------------------------------------------------------------ the reference


@dataclass(frozen=True)
class Reference:
    """The reconciliation recorded once, never interrupted."""

    cassette: Cassette
    payments: frozenset[tuple[str, int, str]]  # (invoice, amount, confirmation)
    lines: int  # of its cassette, header and end line included


def record_reference(folder: Path, model_url: str) -> Reference:
    folder.mkdir(parents=True, exist_ok=True)
    path, ledger = folder / "reference.jsonl", folder / "reference.sqlite"
    env = base_env(folder / "home", ANTHROPIC_BASE_URL=model_url, RECON_LEDGER=str(ledger))
    proc = subprocess.run([sys.executable, "-m", "deja", "record", "-o", str(path), "--",
                           sys.executable, str(AGENT)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ref = load_run(path)
    assert ref.end is not None and ref.end["status"] == "completed"
    rows = ledger_rows(ledger)
    payments = frozenset(row[1:] for row in rows)
    assert len(rows) == len(payments) == PAYS
    return Reference(ref, payments, line_count(path))


def check_like_reference(ref: Reference, cassette: Path, ledger: Path, where: str) -> Cassette:
    """The finished run at ``cassette`` is the reference run: completed, the same
    transcript, exactly its payments, each once, under the key of its intent."""
    run = load_run(cassette)
    assert run.end is not None, where
    assert (run.end["status"], run.end["exit_code"]) == ("completed", 0), where
    diff = compare(ref.cassette, run)
    assert diff.same, f"{where}\n{render(diff)}"
    rows = ledger_rows(ledger)
    by_invoice = collections.Counter(row[1] for row in rows)
    assert max(by_invoice.values()) == 1, f"{where}: paid twice: {by_invoice}"
    assert len({row[0] for row in rows}) == len(rows), where
    assert {row[1:] for row in rows} == ref.payments, where
    intents = {o["args"]["invoice"]: o["seq"] for o in run.observations
               if o["kind"] == "intent"}
    assert sorted(row[0] for row in rows) == sorted(f"{run.run}:{intents[row[1]]}"
                                                    for row in rows), where
    return run


def resumed_lines(run: Cassette) -> list[Mapping[str, Any]]:
    return [o for o in run.observations if o["kind"] == "control" and o["event"] == "resumed"]


def story(path: Path) -> str:
    """The cassette's bookkeeping in short, for a failure's message: line count, control
    and end lines, and the steps that recorded an error."""
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return f"{path}: no cassette"
    out = [f"{path}: {len(lines)} lines"]
    for i, line in enumerate(lines[1:], 1):
        try:
            doc = json.loads(line)
        except ValueError:
            out.append(f"  line {i}: torn")
            continue
        if doc.get("kind") in ("control", "end") or doc.get("error"):
            shown = {k: doc.get(k) for k in ("seq", "kind", "event", "status", "reason",
                                             "exit_code", "error") if doc.get(k) is not None}
            out.append(f"  line {i}: {json.dumps(shown)[:300]}")
    return "\n".join(out)
