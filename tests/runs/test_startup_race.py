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
import select
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

# The racers of every round are forked from one process that has imported what serve and a
# worker import (the engine takes seconds to import; forty fresh interpreters would spend
# most of the test importing it). For each round it reads "URL GO DIR" on stdin and forks
# RACERS processes, which share nothing yet but the imported modules: each says it is
# ready (DIR/N.ready), waits for the go (a file) and opens the database as serve and a
# worker do; its outcome goes to DIR/N.out. The forker answers "done" once all have exited.
FORKER = """\
import os, sys, time, traceback
from deja.runs import engine
from deja.runs.store import Store

def race(url, go, out):
    open(out + ".ready", "w").close()
    while not os.path.exists(go):
        time.sleep(0.0005)
    try:
        Store(url).close()
        engine.prepare(url)
    except BaseException:
        with open(out + ".out", "w") as f:
            f.write(traceback.format_exc())
        return 1
    with open(out + ".out", "w") as f:
        f.write("ok")
    return 0

for line in sys.stdin:
    url, go, folder = line.split()
    pids = []
    for n in range(int(sys.argv[1])):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = race(url, go, os.path.join(folder, str(n)))
            finally:
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print("done", *codes, flush=True)
"""


def test_processes_creating_the_tables_at_one_instant_all_succeed(tmp_path: Path) -> None:
    failures = []
    forker = subprocess.Popen([sys.executable, "-c", FORKER, str(RACERS)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    assert forker.stdin is not None and forker.stdout is not None
    try:
        for round_ in range(ROUNDS):
            url = f"sqlite:///{tmp_path / f'round{round_}.sqlite'}"
            go, folder = tmp_path / f"go{round_}", tmp_path / f"racers{round_}"
            folder.mkdir()
            forker.stdin.write(f"{url} {go} {folder}\n")
            forker.stdin.flush()
            ready = [folder / f"{n}.ready" for n in range(RACERS)]
            deadline = time.monotonic() + UP_TIMEOUT
            while not all(r.exists() for r in ready):  # every racer waits for the go
                assert forker.poll() is None, forker.communicate()
                assert time.monotonic() < deadline, f"round {round_}: racers not ready"
                time.sleep(0.005)
            go.touch()
            answered, _, _ = select.select([forker.stdout], [], [], UP_TIMEOUT)
            assert answered, f"round {round_}: the racers did not finish"
            codes = forker.stdout.readline().split()
            assert codes[:1] == ["done"], (codes, forker.poll())
            for n, code in enumerate(codes[1:]):
                out = (folder / f"{n}.out").read_text()
                if code != "0" or out != "ok":
                    failures.append(f"round {round_}: exit {code}: "
                                    f"{out.strip().splitlines()[-12:]}")
    finally:
        forker.communicate(timeout=60)  # closes its stdin: it exits
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
