"""The runs rows: how long a submission takes to come back with a run id.

``POST /runs`` to a running ``deja serve`` (``python -m deja serve --port 0 --ready-file F``,
its own process), over one kept-alive HTTP connection as a trigger would hold it, timed
from request start to the parsed ``{"run_id", "status": "queued"}``: with the embedded
SQLite default and with Postgres (a throwaway server, ``tests/pg_server.py``). No worker
runs, so the queue only grows: the figure is the submission alone. Anchor, in the same
run and on the same database: the engine's own enqueue of the same submission from a
connected client (``DBOSClient.enqueue`` through ``deja.runs.engine.Client.submit``), the floor
the API adds its validation, its own row and HTTP to.

``deja submit -- CMD`` is timed as a user runs it: a fresh ``python -m deja submit``
process each time, to the same server; anchor: ``python -c pass`` (the interpreter's own
start).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BODY = {"command": ["python", "agent.py"], "cwd": "/tmp", "labels": {"bench": "submit"},
        "guards": {"max_turns": 60}}


def _stats(xs: list[float]) -> dict[str, Any]:
    xs = sorted(xs)
    return {"n": len(xs), "median_ms": statistics.median(xs) * 1000,
            "p95_ms": xs[min(len(xs) - 1, int(0.95 * len(xs)))] * 1000}


def _wait_file(path: Path, proc: subprocess.Popen[bytes], log: Path, what: str,
               timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            return path.read_text()
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start in {timeout:.0f} s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def _server(env: dict[str, str], work: Path) -> Iterator[str]:
    ready, log = work / "serve.ready", work / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deja", "serve", "--port", "0",
                                 "--ready-file", str(ready)], env=env, cwd=work,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        yield json.loads(_wait_file(ready, proc, log, "deja serve"))["url"]
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()


def _post_times(url: str, n: int, token: str) -> list[float]:
    host, _, port = url.split("//", 1)[1].rstrip("/").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps(BODY).encode()
    times = []
    for i in range(n + 5):
        t0 = time.perf_counter()
        conn.request("POST", "/runs", body=body, headers={
            "content-type": "application/json", "authorization": f"Bearer {token}"})
        response = conn.getresponse()
        data = json.loads(response.read())
        elapsed = time.perf_counter() - t0
        if response.status != 201 or data.get("status") != "queued":
            raise RuntimeError(f"POST /runs answered {response.status}: {data}")
        if i >= 5:  # the first few warm the server's pools
            times.append(elapsed)
    conn.close()
    return times


def _engine_floor(env: dict[str, str], n: int) -> list[float]:
    """The engine's enqueue alone, in a process of its own on the same database."""
    code = (
        "import json, sys, time\n"
        "from deja.runs import engine, config\n"
        "from recorder.launch import new_run_id\n"
        "client = engine.Client(config.database_url())\n"
        f"body = {BODY!r}\n"
        "out = []\n"
        f"for i in range({n} + 5):\n"
        "    spec = dict(body, run_id=new_run_id(), cassette='/tmp/x.jsonl')\n"
        "    t0 = time.perf_counter(); client.submit(spec); t = time.perf_counter() - t0\n"
        "    if i >= 5: out.append(t)\n"
        "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True,
                          capture_output=True, text=True)
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _cli_times(env: dict[str, str], url: str, n: int, work: Path) -> dict[str, Any]:
    env = dict(env, DEJA_SERVER=url)
    submit, bare = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "deja", "submit", "--cwd", str(work), "--",
                        "python", "agent.py"], env=env, cwd=work, check=True,
                       capture_output=True)
        submit.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        bare.append(time.perf_counter() - t0)
    return {"submit": _stats(submit), "python": _stats(bare)}


def _backend(name: str, url: str | None, n: int, cli_n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"deja-bench-runs-{name}-") as tmp:
        work = Path(tmp)
        env = dict(os.environ, DEJA_HOME=str(work / "home"))
        env.pop("DEJA_SERVER", None)
        if url is not None:
            env["DEJA_DATABASE_URL"] = url
        else:
            env.pop("DEJA_DATABASE_URL", None)
        with _server(env, work) as server:
            token = (work / "home" / "serve.token").read_text().strip()  # made by the server
            out: dict[str, Any] = {"post": _stats(_post_times(server, n, token)),
                                   "engine": _stats(_engine_floor(env, n))}
            if cli_n:
                out["cli"] = _cli_times(env, server, cli_n, work)
        return out


def run(n: int = 50, cli_n: int = 10) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from pg_server import PostgresServer

    results: dict[str, Any] = {"n": n, "sqlite": _backend("sqlite", None, n, cli_n)}
    with PostgresServer() as pg:
        results["postgres"] = _backend("postgres", pg.create_database(), n, 0)
    return results


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
