"""A database outage mid-run: Postgres stopped for 8 s while a worker runs a paying agent,
then started again. The run's status comes from its cassette's end line, and the worker's
bookkeeping (its row, its heartbeat) waits for the database instead of failing the run.

The reconciliation example (20 payments) runs under ``python -m deja worker`` on a
Postgres server of its own (``tests/pg_server.py``), stopped at once (``pg_ctl stop -m
immediate``, as a crash would) once the run is under way and started again on the same
port and data 8 s later. The run ends ``completed``, with every payment once and the
transcript of an uninterrupted run; the worker's output says the database was away and
came back, in one line each, with no traceback.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pg_server import PostgresServer
from runs_helpers import (
    SCRIPT,
    Reference,
    base_env,
    check_like_reference,
    line_count,
    open_runs,
    reconciliation,
    record_reference,
    start_worker,
    story,
    submit,
    wait_up,
)

from deja.runs.store import ENDED
from recorder.errors import DejaError
from recorder.testing.server import StubServer

OUTAGE = 8.0  # seconds the database is down: the fault itself, not a wait for a state
TIMEOUT = 300.0  # for the run to end on two busy cores
# A traceback through the worker or the engine (an agent's own, on the output the worker
# passes on, is the agent's business).
TRACEBACK = re.compile(r'File "[^"]*/(runs|dbos)/_?\w+\.py"|heartbeat: ')


class RestartablePostgres(PostgresServer):
    """A server that can be stopped as a crash stops it and started again on its port."""

    def crash(self) -> None:
        done = self._run(["pg_ctl", "stop", "-D", str(self.data_dir), "-m", "immediate",
                          "-w"], cwd=self._root())
        assert done.returncode == 0, done.stdout + done.stderr

    def restart(self) -> None:
        done = self._run(["pg_ctl", "start", "-D", str(self.data_dir), "-l",
                          str(self.log_file), "-p", str(self.bin_dir / "postgres"), "-o",
                          f"-p {self.port}", "-w", "-t", "60"], cwd=self._root())
        assert done.returncode == 0, done.stdout + done.stderr
        self._wait_ready()


@pytest.fixture
def postgres() -> Iterator[RestartablePostgres]:
    with RestartablePostgres() as server:
        yield server


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    with StubServer(SCRIPT) as server:
        return record_reference(tmp_path_factory.mktemp("db-outage-ref"), server.url)


def test_postgres_stopped_mid_run_and_started_again_the_run_completes(
        postgres: RestartablePostgres, tmp_path: Path, reference: Reference) -> None:
    url = postgres.url
    cassettes, ledger = tmp_path / "cassettes", tmp_path / "ledger.sqlite"
    with StubServer(SCRIPT) as model, open_runs(url) as runs:
        env = base_env(tmp_path / "home", DEJA_DATABASE_URL=url,
                       DEJA_CASSETTE_DIR=str(cassettes), RECON_LEDGER=str(ledger),
                       ANTHROPIC_BASE_URL=model.url, RECON_DELAY="0.05")
        worker = start_worker("w1", env, tmp_path / "logs")
        try:
            wait_up(worker)
            run_id = submit(runs, cassettes, reconciliation())
            cassette = cassettes / f"{run_id}.jsonl"
            deadline = time.monotonic() + TIMEOUT
            while line_count(cassette) < 12:  # a few turns in: a progress record written
                assert worker.alive() and time.monotonic() < deadline, worker.log()
                time.sleep(0.01)
            assert runs.get(run_id)["status"] == "working"
            postgres.crash()
            down = time.monotonic()
            time.sleep(OUTAGE)
            assert worker.alive(), worker.log()
            lines_during = line_count(cassette)
            postgres.restart()
            back = time.monotonic()

            def final() -> dict[str, Any] | None:
                try:
                    record = runs.get(run_id)
                    row = runs.store.get_run(run_id)
                except DejaError:  # the test's own connections find their way back
                    return None
                return record if record["status"] in ENDED and row is not None and \
                    row["status"] in ENDED else None

            ended = None
            while ended is None:
                assert worker.alive(), worker.log()
                assert time.monotonic() < deadline, f"{runs.get(run_id)}\n{worker.log()}"
                time.sleep(0.2)
                ended = final()
            where = (f"run {run_id}; database down {back - down:.1f} s at "
                     f"{lines_during} lines\n{story(cassette)}\n{worker.log()}")
            assert ended["status"] == "completed", f"{ended}\n{where}"
            assert runs.store.get_run(run_id)["status"] == "completed", where  # type: ignore[index]
            check_like_reference(reference, cassette, ledger, where)
            worker.stop()
            log = worker.log()
            assert not TRACEBACK.search(log), where
            assert log.count("cannot be reached") == 1, where
            assert log.count("is back after") == 1, where
            assert f"run {run_id} failed" not in log, where
        finally:
            worker.reap()
