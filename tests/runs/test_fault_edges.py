"""Fault edges of the runs service, through real processes:

- a cassette directory that fills up mid-run (a small tmpfs, filled by the test): the run
  ends ``interrupted`` with the reason, ``CassetteWriteError``, and once there is room
  again the worker dispatches it again on its own; it resumes and completes, each payment
  once; a run launched while the directory is already full waits for room the same way;
- a submission the engine's queue cannot take (its database refuses the write) is
  answered 503 and leaves no row behind: no run waits ``queued`` for ever, and no worker
  runs a command its caller was told failed;
- a ``queued`` row that never reached the queue (a crash between the two writes) is
  removed by the next worker that starts.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runs_helpers import (
    SCRIPT,
    Reference,
    base_env,
    check_like_reference,
    line_count,
    open_runs,
    reconciliation,
    record_reference,
    resumed_lines,
    sqlite_url,
    start_worker,
    story,
    submit,
    wait_up,
)

from deja.runs.store import ENDED, Store
from recorder.testing.server import StubServer

TIMEOUT = 300.0  # for a run to end on two busy cores
# A traceback through the worker or the engine (an agent's own, on the output the worker
# passes on, is the agent's business).
TRACEBACK = re.compile(r'File "[^"]*/(runs|dbos)/_?\w+\.py"|heartbeat: ')


def _wait(what: str, probe: Any, logs: Any, timeout: float = TIMEOUT,
          every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} did not happen:\n{logs()}"
        time.sleep(every)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    with StubServer(SCRIPT) as server:
        return record_reference(tmp_path_factory.mktemp("fault-edges-ref"), server.url)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of its own (mounting needs root, which these tests run as)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs",
                           str(mount)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"mounting a tmpfs needs root: {done.stderr}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _ended(runs: Any, run_id: str) -> dict[str, Any] | None:
    """The run's record once it has ended (interrupted included), else None."""
    record = runs.get(run_id)
    return record if record["status"] in ENDED else None


def _completed(runs: Any, run_id: str) -> dict[str, Any] | None:
    """The run's record once it and its row say completed, else None."""
    record = runs.get(run_id)
    row = runs.store.get_run(run_id)
    return record if record["status"] == "completed" and row and \
        row["status"] == "completed" else None


def _fill(path: Path) -> None:
    """Write ``path`` until its file system has no room left."""
    with path.open("wb", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1):
            while True:
                try:
                    f.write(b"\0" * size)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break


def test_a_full_cassette_directory_names_the_error_and_the_run_resumes_once_there_is_room(
        small_disk: Path, tmp_path: Path, reference: Reference) -> None:
    cassettes, ledger = small_disk / "cassettes", tmp_path / "ledger.sqlite"
    home = tmp_path / "home"
    with StubServer(SCRIPT) as model, open_runs(sqlite_url(home)) as runs:
        env = base_env(home, DEJA_CASSETTE_DIR=str(cassettes), RECON_LEDGER=str(ledger),
                       ANTHROPIC_BASE_URL=model.url)
        worker = start_worker("w1", env, tmp_path / "logs")
        try:
            wait_up(worker)
            run_id = submit(runs, cassettes, reconciliation())
            cassette = cassettes / f"{run_id}.jsonl"
            _wait("the run to be under way", lambda: line_count(cassette) >= 20, worker.log,
                  every=0.005)
            filler = small_disk / "filler"
            _fill(filler)

            record = _wait("the run to stop", lambda: _ended(runs, run_id), worker.log)
            where = f"run {run_id}\n{story(cassette)}\n{worker.log()}"
            assert record["status"] == "interrupted", f"{record}\n{where}"
            assert record["error"].startswith("CassetteWriteError: "), where
            assert record["error"].endswith(f"; the run is dispatched again once {cassettes} "
                                            "is writable"), where
            assert "No space left on device" in record["error"], where
            assert f"run {run_id} interrupted: CassetteWriteError: " in worker.log(), where

            filler.unlink()  # room again: the worker dispatches it again by itself


            final = _wait("the run to complete", lambda: _completed(runs, run_id),
                          lambda: f"{runs.get(run_id)}\n{story(cassette)}\n{worker.log()}")
            where = f"run {run_id}\n{story(cassette)}\n{worker.log()}"
            assert "error" not in final, where
            run = check_like_reference(reference, cassette, ledger, where)
            assert len(resumed_lines(run)) == 1, where
            assert f"run {run_id}: its cassette directory is writable again; dispatched " \
                   "again" in worker.log(), where
            worker.stop()
            assert not TRACEBACK.search(worker.log()), where
            # the agent's CassetteWriteError is deja's one line, not the agent's traceback
            assert "Traceback" not in worker.log(), where
            assert "deja: CassetteWriteError: " in worker.log(), where
        finally:
            worker.reap()


def test_a_run_launched_on_a_full_cassette_directory_waits_for_room(
        small_disk: Path, tmp_path: Path) -> None:
    """Not even the cassette's header fits: ``deja record`` says so (exit 74), the run is
    interrupted, not failed, whatever the directory holds by the time the worker looks,
    and runs once there is room."""
    cassettes, ledger = small_disk / "cassettes", tmp_path / "ledger.sqlite"
    cassettes.mkdir()
    home = tmp_path / "home"
    filler = small_disk / "filler"
    with StubServer(SCRIPT) as model, open_runs(sqlite_url(home)) as runs:
        env = base_env(home, DEJA_CASSETTE_DIR=str(cassettes), RECON_LEDGER=str(ledger),
                       ANTHROPIC_BASE_URL=model.url)
        worker = start_worker("w1", env, tmp_path / "logs")
        try:
            wait_up(worker)  # its marker written: the directory fills up afterwards
            _fill(filler)
            run_id = submit(runs, cassettes, reconciliation())
            cassette = cassettes / f"{run_id}.jsonl"

            record = _wait("the run to stop", lambda: _ended(runs, run_id), worker.log)
            where = f"run {run_id}\n{worker.log()}"
            assert record["status"] == "interrupted", f"{record}\n{where}"
            assert record["error"].startswith(f"CassetteWriteError: {cassette} could not be "
                                              "written as the run started (deja exited 74)"), \
                where
            assert "writing its header failed: No space left on device. Nothing was " \
                   "recorded" in worker.log(), where
            assert not cassette.exists(), where  # no empty file left for a resume to refuse

            filler.unlink()


            _wait("the run to complete", lambda: _completed(runs, run_id),
                  lambda: f"{runs.get(run_id)}\n{story(cassette)}\n{worker.log()}")
            worker.stop()
            assert not TRACEBACK.search(worker.log()), worker.log()
        finally:
            worker.reap()


def test_a_first_worker_on_a_full_cassette_directory_says_so(small_disk: Path,
                                                              tmp_path: Path) -> None:
    cassettes, home = small_disk / "cassettes", tmp_path / "home"
    cassettes.mkdir()
    _fill(small_disk / "filler")
    with open_runs(sqlite_url(home)):
        worker = start_worker("w1", base_env(home, DEJA_CASSETTE_DIR=str(cassettes)),
                              tmp_path / "logs")
        try:
            assert worker.process.wait(timeout=TIMEOUT) != 0, worker.log()
        finally:
            worker.reap()
    assert f"the cassette directory {cassettes} cannot be written (No space left on " \
           "device)" in worker.log(), worker.log()
    assert "Traceback" not in worker.log(), worker.log()


# ------------------------------------------------------------------------ submissions

# The engine's queue is a table of the database; a trigger that calls a function nobody
# defined makes SQLite refuse every write to it with an OperationalError, as a full disk
# or a broken file does, while deja's own table still takes rows.
REFUSE = ("CREATE TRIGGER deja_test_refuse BEFORE INSERT ON workflow_status "
          "BEGIN SELECT deja_test_no_such_function(); END")


def _post(url: str, token: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"{url}/runs", data=json.dumps(body).encode(),
                                     method="POST", headers={
                                         "authorization": f"Bearer {token}",
                                         "content-type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def _serve(env: dict[str, str], folder: Path, n: int) -> tuple[subprocess.Popen[bytes], str]:
    ready = folder / f"serve{n}.json"
    with (folder / f"serve{n}.log").open("wb") as log:
        serve = subprocess.Popen([sys.executable, "-m", "deja", "serve", "--port", "0",
                                  "--quiet", "--ready-file", str(ready)], env=env,
                                 stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT)
    said = (folder / f"serve{n}.log").read_text
    _wait("deja serve to listen", lambda: ready.exists() or serve.poll() is not None, said,
          timeout=120)
    assert serve.poll() is None, said()
    return serve, json.loads(ready.read_text())["url"]


def test_a_submission_the_queue_refuses_is_answered_503_and_leaves_no_row(
        tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    (work / "agent.py").write_text("import pathlib\npathlib.Path('ran').write_text('yes')\n")
    env = base_env(home, DEJA_CASSETTE_DIR=str(home / "cassettes"))
    body = {"command": [sys.executable, "agent.py"], "cwd": str(work), "run_id": "refused-1"}
    database = home / "runs.sqlite"
    serve, url = _serve(env, tmp_path, 0)
    worker = None
    try:
        token = (home / "serve.token").read_text().strip()
        with contextlib.closing(sqlite3.connect(database)) as db:
            db.execute(REFUSE)
            db.commit()
        status, answer = _post(url, token, body)
        assert status == 503, answer
        assert answer["error"]["type"] == "DatabaseUnavailable", answer
        store = Store(sqlite_url(home))
        try:
            assert store.get_run("refused-1") is None  # no row: nothing waits queued
        finally:
            store.close()
        serve.terminate()
        serve.wait(30)
        with contextlib.closing(sqlite3.connect(database)) as db:
            db.execute("DROP TRIGGER deja_test_refuse")
            db.commit()
        # The same submission again, once the queue takes it: accepted, and run.
        serve, url = _serve(env, tmp_path, 1)
        worker = start_worker("w1", env, tmp_path / "logs")
        wait_up(worker)
        status, answer = _post(url, token, body)
        assert (status, answer.get("status")) == (201, "queued"), answer
        _wait("the run to complete", lambda: (work / "ran").exists(), worker.log)
    finally:
        if worker is not None:
            worker.reap()
        serve.terminate()
        serve.wait(30)
    for n in (0, 1):
        assert "Traceback" not in (tmp_path / f"serve{n}.log").read_text()


def test_a_queued_row_the_engine_never_took_is_removed_by_the_next_worker(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = base_env(home, DEJA_CASSETTE_DIR=str(home / "cassettes"))
    with open_runs(sqlite_url(home)) as runs:
        spec = {"run_id": "r_left_behind", "command": [sys.executable, "-c", "pass"],
                "cwd": str(tmp_path), "cassette": str(home / "cassettes" / "r_left_behind.jsonl")}
        assert runs.store.add_run("r_left_behind", spec)  # the row, and no enqueue
        with runs.store.begin() as conn:  # written a while ago: past the grace period
            conn.exec_driver_sql("UPDATE deja_runs SET updated = updated - 3600")
        worker = start_worker("w1", env, tmp_path / "logs")
        try:
            wait_up(worker)
            _wait("the row to be removed", lambda: runs.store.get_run("r_left_behind") is None,
                  worker.log)
            assert "run r_left_behind: its submission never reached the queue" in \
                worker.log()
            assert not Path(spec["cassette"]).exists()
        finally:
            worker.reap()
    assert os.path.isdir(home)
