"""The incident-suite rows: ``deja suite`` over a folder of recorded incidents when nothing
changed, inline and on a ``deja worker``.

Two example agents are recorded once against the stub server with ``deja record``
(``examples/streaming_agent.py``, which completes, and ``examples/retry_spiral.py``,
which the loop guard stops: a failed run), and copied into a folder of ``n`` incidents
under other names (a copy keeps its signature: its bytes are unchanged). Then, in a
throwaway DEJA_HOME:

- ``python -m deja suite incidents --inline`` (one job per CPU), timed from the command's
  start to its exit, every incident checked ``identical``: incidents start warm (forks of
  one process that imported deja and the SDKs once), and again with ``--cold`` (a fresh
  interpreter per incident and per program);
- the same with one ``deja worker -j <CPUs>`` up on the embedded SQLite database (no
  flag: the suite finds it), each incident a workflow on the suite's queue;
- anchors: one ``python -m deja replay`` of one incident, as a fresh process (the cost of
  one incident: the program starts under deja's bootstrap, the SDKs imported), and
  ``python -c pass``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
AGENTS = (("lyon", "streaming_agent"), ("spiral", "retry_spiral"))


def _deja(*args: str, cwd: Path, env: dict[str, str],
          timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


def _incidents(project: Path, env: dict[str, str], n: int) -> int:
    """Each example agent recorded once, against the stub serving its script, into the
    incidents folder (a recorded command runs where it was recorded, which a copy in the
    same folder finds again), then copied there up to ``n`` incidents; how many were
    recorded."""
    from recorder.testing.script import load_script
    from recorder.testing.server import StubServer

    folder = project / "incidents"
    made = []
    for i, (name, example) in enumerate(AGENTS):
        target = folder / f"{i:03d}-{name}.jsonl"
        script = load_script(ROOT / "examples" / f"{example}.stub.json")
        with StubServer(script) as server:
            done = _deja("record", "-o", str(target.relative_to(project)), "--", "python",
                         str(ROOT / "examples" / f"{example}.py"), cwd=project,
                         env={**env, "ANTHROPIC_BASE_URL": server.url})
        if not target.exists():
            raise RuntimeError(f"recording {example} failed: {done.stderr[-2000:]}")
        made.append((name, target))
    for i in range(len(made), n):
        name, source = made[i % len(made)]
        shutil.copyfile(source, folder / f"{i:03d}-{name}.jsonl")
    return len(made)


def _timed_suite(project: Path, env: dict[str, str], *args: str) -> dict[str, Any]:
    """One ``deja suite`` of the folder, timed; its summary, checked: all identical."""
    began = time.perf_counter()
    done = _deja("suite", "incidents", "--json", *args, cwd=project, env=env)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"deja suite {' '.join(args)} exited {done.returncode}: "
                           f"{done.stderr[-2000:]}")
    document = json.loads(done.stdout)
    summary = document["summary"]
    if summary["identical"] != summary["incidents"]:
        raise RuntimeError(f"not every incident replayed identically: {summary}")
    per = [float(r["seconds"]) for r in document["incidents"]]
    return {"seconds": seconds, "where": document["where"], "incidents": summary["incidents"],
            "identical": summary["identical"], "incident_median_s": statistics.median(per)}


@contextlib.contextmanager
def _worker(project: Path, env: dict[str, str], jobs: int) -> Iterator[None]:
    """One ``deja worker`` on the embedded database, up; stopped with SIGTERM after."""
    log = project / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deja", "worker", "--id", "bench-w1",
                                 "-j", str(jobs)], cwd=project, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "is up" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _anchors(project: Path, env: dict[str, str], repeats: int) -> dict[str, float]:
    """One incident replayed alone by a fresh ``deja replay``, and a bare interpreter."""
    one = sorted((project / "incidents").glob("*.jsonl"))[0]
    replay, bare = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        done = _deja("replay", str(one), cwd=project, env=env)
        replay.append(time.perf_counter() - began)
        if done.returncode != 0:
            raise RuntimeError(f"deja replay {one} exited {done.returncode}")
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare.append(time.perf_counter() - began)
    return {"replay_s": statistics.median(replay), "python_s": statistics.median(bare)}


def run(n: int = 100, repeats: int = 3) -> dict[str, Any]:
    """``n`` incidents: the suite inline and on a worker, and the anchors."""
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="deja-bench-suite-") as tmp:
        project = Path(tmp)
        env = {k: v for k, v in os.environ.items()
               if k not in ("DEJA_DATABASE_URL", "DEJA_CASSETTE_DIR", "GITHUB_ACTIONS")}
        env.update(DEJA_HOME=str(project / "home"), ANTHROPIC_API_KEY="sk-stub")
        distinct = _incidents(project, env, n)
        anchors = _anchors(project, env, repeats)
        inline = _timed_suite(project, env, "--inline")
        cold = _timed_suite(project, env, "--inline", "--cold")
        with _worker(project, env, cpus):
            workers = _timed_suite(project, env)
    return {"n": n, "cpus": cpus, "distinct": distinct, "inline": inline, "cold": cold,
            "workers": workers, **anchors}
