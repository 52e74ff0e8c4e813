"""``deja serve`` and ``deja worker`` started at the same moment on a fresh ``$DEJA_HOME``:
both come up, whoever creates the runs database's tables first.

SQLite says ``OperationalError: table ... already exists`` to the process that loses the
race to create a table (not ``IntegrityError``); the loser must look again and find it
made. First the race itself, sharpened: several processes that open the database (deja's
tables, then the engine's) at one instant, on fresh files, round after round; then the
real thing, ``deja serve`` and ``deja worker`` launched together, a few times.
``DEJA_STARTUP_ROUNDS`` sets the rounds of each (default 10 and 3).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runs_helpers import base_env

ROUNDS = int(os.environ.get("DEJA_STARTUP_ROUNDS", 10))
LAUNCHES = max(1, ROUNDS // 3)
RACERS = 4
UP_TIMEOUT = 120.0  # two interpreters and the engine on two busy cores

# Each racer imports what it needs, says so, and waits for the go (a file) to open the
# database as serve and a worker do.
RACER = """\
import os, sys, time
from deja.runs import engine
from deja.runs.store import Store
url, go = sys.argv[1], sys.argv[2]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.0005)
Store(url).close()
engine.prepare(url)
print("ok", flush=True)
"""


def test_processes_creating_the_tables_at_one_instant_all_succeed(tmp_path: Path) -> None:
    failures = []
    for round_ in range(ROUNDS):
        url = f"sqlite:///{tmp_path / f'round{round_}.sqlite'}"
        go = tmp_path / f"go{round_}"
        racers = [subprocess.Popen([sys.executable, "-c", RACER, url, str(go)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for _ in range(RACERS)]
        for racer in racers:
            assert racer.stdout is not None
            assert racer.stdout.readline().strip() == "ready", racer.communicate()
        go.touch()
        for racer in racers:
            out, err = racer.communicate(timeout=120)
            if racer.returncode != 0 or out.strip() != "ok":
                failures.append(f"round {round_}: exit {racer.returncode}: "
                                f"{err.strip().splitlines()[-12:] or out}")
    assert not failures, "\n".join(failures)


def test_serve_and_worker_started_together_on_a_fresh_home_both_come_up(
        tmp_path: Path) -> None:
    for round_ in range(LAUNCHES):
        home = tmp_path / f"home{round_}"
        ready = tmp_path / f"serve{round_}.json"
        logs = tmp_path / f"round{round_}"
        logs.mkdir()
        env = base_env(home, DEJA_CASSETTE_DIR=str(home / "cassettes"))
        started = []
        try:
            with (logs / "serve.log").open("wb") as serve_log, \
                    (logs / "worker.log").open("wb") as worker_log:
                started.append(subprocess.Popen(
                    [sys.executable, "-m", "deja", "serve", "--port", "0", "--quiet",
                     "--ready-file", str(ready)], env=env, stdin=subprocess.DEVNULL,
                    stdout=serve_log, stderr=subprocess.STDOUT, start_new_session=True))
                started.append(subprocess.Popen(
                    [sys.executable, "-m", "deja", "worker", "--id", "w1"], env=env,
                    stdin=subprocess.DEVNULL, stdout=worker_log, stderr=subprocess.STDOUT,
                    start_new_session=True))

            def output(logs: Path = logs) -> str:
                return "\n".join(f"--- {name}\n{(logs / name).read_text(errors='replace')}"
                                 for name in ("serve.log", "worker.log"))

            deadline = time.monotonic() + UP_TIMEOUT
            while not (ready.exists() and "worker w1 is up" in (logs / "worker.log").read_text(
                    errors="replace")):
                for proc in started:
                    assert proc.poll() is None, f"round {round_}: exited:\n{output()}"
                assert time.monotonic() < deadline, f"round {round_}: not up:\n{output()}"
                time.sleep(0.05)
            assert json.loads(ready.read_text())["pid"] == started[0].pid
            assert all(proc.poll() is None for proc in started), output()
            assert "Traceback" not in output() and "DatabaseUnavailable" not in output()
        finally:
            for proc in started:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in started:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
