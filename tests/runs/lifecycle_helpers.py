"""Shared helpers of the lifecycle and schedule tests: a DEJA_HOME per test, the runs
service on its database, real ``deja worker`` processes, small agents, polling.

Import the fixtures into a test module (pytest finds them there)::

    from lifecycle_helpers import home_fixture, runs_fixture, workers_fixture  # noqa: F401

Every worker is started in a process group of its own and stopped when the test ends,
whatever happened: SIGTERM first (its agents end ``interrupted``), SIGKILL to the group
if it does not exit in time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest

from deja.runs import config, engine, service
from deja.runs.store import Store

T = TypeVar("T")

POLL = 0.2  # seconds between looks
UP_TIMEOUT = 30.0  # a worker prints that it is up within this (interpreter + engine launch)
PYTHON = sys.executable

# An agent that asks a person, then writes what it was told and declares the file.
ASKING_AGENT = """\
import recorder

started = recorder.now()
answer = recorder.ask("Pay invoice INV-7 twice?")
with open("decision.txt", "w") as f:
    f.write(f"answer: {answer}\\n")
recorder.artefact("decision.txt")
print(f"answer: {answer}")
"""

# An agent that ends at once.
QUICK_AGENT = """\
import recorder

recorder.now()
"""

# An agent that works slowly: a tool call (a turn boundary) every 0.2 s, 100 of them.
SLOW_AGENT = """\
import time

import recorder


@recorder.tool
def tick(i):
    return i


for i in range(100):
    recorder.now()
    tick(i)
    time.sleep(0.2)
"""

FAILING_AGENT = """\
import recorder

recorder.now()
raise RuntimeError("the ledger is locked")
"""

# A scheduled report: one file per run (named by the run id), declared as the artefact;
# the ledger line is a tool call, so it happens once per run even when a run resumes.
REPORT_AGENT = """\
import recorder

run = recorder.active().run_id


@recorder.tool
def write_report(name, text):
    with open(name, "w") as f:
        f.write(text)
    return name


@recorder.tool
def ledger(run):
    with open("ledger.txt", "a") as f:
        f.write(run + "\\n")
    return True


started = recorder.now()
name = write_report(f"report-{run}.txt", f"{run} at {started}\\n")
recorder.artefact(name)
ledger(run)
"""


def write_agent(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(source)
    return path


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 30.0,
             show: Callable[[], Any] | None = None) -> T:
    """Poll ``probe`` until it returns something truthy; fail saying ``what`` was awaited
    and what was seen last (``show()``, else the probe's last answer)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            seen = show() if show is not None else last
            raise AssertionError(f"waited {timeout:.0f} s for {what}; last seen: {seen!r}")
        time.sleep(POLL)


def isolate(monkeypatch: pytest.MonkeyPatch, home: Path) -> Path:
    """Point deja at ``home`` alone: its SQLite database and its cassette directory."""
    home.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("DEJA_HOME", str(home))
    for name in ("DEJA_DATABASE_URL", "DEJA_CASSETTE_DIR", "DEJA_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture(name="home")
def home_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's DEJA_HOME, under its tmp_path (workers inherit it)."""
    return isolate(monkeypatch, tmp_path / "home")


@pytest.fixture(name="runs")
def runs_fixture(home: Path) -> Iterator[service.Runs]:
    """The runs service on this test's embedded database."""
    url = config.database_url()
    store = Store(url)
    client = engine.Client(url)
    try:
        yield service.Runs(store, client)
    finally:
        client.close()
        store.close()


class Worker:
    """One ``deja worker`` process; its standard error goes to a file."""

    def __init__(self, worker_id: str, log: Path, args: list[str],
                 env: dict[str, str]) -> None:
        self.id = worker_id
        self.log = log
        with log.open("ab") as err:
            self.proc = subprocess.Popen(
                [PYTHON, "-m", "deja", "worker", "--id", worker_id, *args],
                stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env,
                start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_up(self) -> Worker:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.id} exited {self.proc.returncode}:\n"
                                     f"{self.output()}")
            return f"worker {self.id} is up" in self.output()

        wait_for(f"worker {self.id} to be up", up, UP_TIMEOUT)
        return self

    def wait_exit(self, timeout: float = 20.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {self.id} still running after {timeout:.0f} s:\n"
                                 f"{self.output()}") from None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its process group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


class Workers:
    """The workers of one test, each stopped at its end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[Worker] = []

    def start(self, worker_id: str = "w1", *args: str, env: dict[str, str] | None = None,
              wait: bool = True) -> Worker:
        """A worker with ``worker_id`` and the test's environment (plus ``env``)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{worker_id}-{len(self.started)}.log"
        worker = Worker(worker_id, log, list(args), {**os.environ, **(env or {})})
        self.started.append(worker)
        return worker.wait_up() if wait else worker

    def stop_all(self) -> None:
        for worker in self.started:
            worker.stop()


@pytest.fixture(name="workers")
def workers_fixture(home: Path, tmp_path: Path) -> Iterator[Workers]:
    started = Workers(tmp_path / "worker-logs")
    try:
        yield started
    finally:
        started.stop_all()


def status_of(runs: service.Runs, run_id: str, *statuses: str) -> dict[str, Any] | None:
    """The run's record when its status is one of ``statuses``, else None (for wait_for)."""
    record = runs.get(run_id)
    return record if record["status"] in statuses else None


def status_of_row(runs: service.Runs, run_id: str, status: str) -> dict[str, Any] | None:
    """The run's row when it says ``status``, else None (for wait_for)."""
    row = runs.store.get_run(run_id)
    return row if row is not None and row["status"] == status else None


def cassette_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ended(path: Path) -> dict[str, Any] | None:
    """The cassette's end line once it has one."""
    if not path.exists():
        return None
    lines = cassette_lines(path)
    return lines[-1] if lines and lines[-1].get("kind") == "end" else None


class AlertSink:
    """A tiny HTTP server on 127.0.0.1 (a free port) that records the JSON it is POSTed."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                sink.received.append(json.loads(body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture(name="alert_sink")
def alert_sink_fixture() -> Iterator[AlertSink]:
    sink = AlertSink()
    try:
        yield sink
    finally:
        sink.close()
