"""`deja ls`: the runs table and its JSON; `deja ls` and `deja view`: the progress bar
while they index.

Runs are recorded here for real (`recorder.record`, `recorder.start` for one still being
written); the CLI runs through click's runner, or as a process (`sys.executable -m deja`)
with its stderr on a real pseudo-terminal (the `pty` module) or on a pipe.
"""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

import recorder
from deja.cli import main


def _record(path: Path, labels: dict[str, str] | None = None) -> str:
    with recorder.record(path, labels=labels) as run:
        recorder.value("note", lambda: "hello")
    return run.run_id


def test_ls_json_has_the_file_labels_as_an_object_and_running_runs(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    done = _record(runs / "done.jsonl", labels={"team": "search", "ticket": "INC-7"})
    shutil.copy(runs / "done.jsonl", runs / "done-copy.jsonl")
    live = recorder.start(runs / "live.jsonl")
    try:
        recorder.value("note", lambda: "still going")
        out = CliRunner().invoke(main, ["ls", str(runs), "--json"])
    finally:
        live.close()
    assert out.exit_code == 0, out.output
    rows = {r["file"]: r for r in json.loads(out.output)}
    assert set(rows) == {"done.jsonl", "done-copy.jsonl", "live.jsonl"}
    assert rows["done.jsonl"]["labels"] == {"team": "search", "ticket": "INC-7"}
    assert rows["done-copy.jsonl"]["run"] == rows["done.jsonl"]["run"] == done
    assert rows["live.jsonl"]["labels"] == {}
    assert rows["live.jsonl"]["status"] == "running"  # its writer holds the lock
    after = CliRunner().invoke(main, ["ls", str(runs), "--json"])
    status = {r["file"]: r["status"] for r in json.loads(after.output)}
    assert status["live.jsonl"] == "completed"


def test_ls_table_has_file_and_labels_and_never_wraps_a_run_id(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run = _record(runs / "a-rather-long-cassette-name-for-a-run.jsonl",
                  labels={"team": "search", "ticket": "INC-4312", "env": "staging"})
    out = CliRunner().invoke(main, ["ls", str(runs)], env={"COLUMNS": "140"})
    assert out.exit_code == 0, out.output
    header = next(line for line in out.output.splitlines() if " run " in line)
    for column in ("run", "file", "status", "labels"):
        assert f" {column} " in header, header
    assert run in out.output  # whole, on one line
    assert "env=staging," in out.output and "team=search," in out.output
    # Narrower than the table: the other columns fold, the run id still does not.
    narrow = CliRunner().invoke(main, ["ls", str(runs)], env={"COLUMNS": "100"})
    assert narrow.exit_code == 0 and run in narrow.output


def _many(runs: Path, n: int) -> None:
    for i in range(n):
        _record(runs / f"run-{i:02d}.jsonl")


def _read_until(fd: int, marker: bytes | None, timeout: float = 60) -> bytes:
    """What the process writes to the terminal ``fd`` until ``marker`` (None: until it
    closes the terminal)."""
    seen = b""
    while marker is None or marker not in seen:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the process closed its end
            break
        if not chunk:
            break
        seen += chunk
    return seen


def test_ls_shows_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _many(runs, 25)
    leader, follower = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "160"}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "deja", "ls", str(runs)],
                                stdout=subprocess.PIPE, stderr=follower,
                                stdin=subprocess.DEVNULL, env=env)
        os.close(follower)
        seen = _read_until(leader, None)
        stdout = proc.stdout.read() if proc.stdout else b""
        assert proc.wait(timeout=60) == 0, seen.decode(errors="replace")
    finally:
        os.close(leader)
        if proc.stdout:
            proc.stdout.close()
    text = seen.decode("utf-8", errors="replace")
    assert "indexing cassettes" in text and "25/25" in text, text
    assert b"run-24.jsonl" in stdout and b"indexing" not in stdout
    # Indexed now: a second listing has nothing to read, and draws no bar.
    again = subprocess.run([sys.executable, "-m", "deja", "ls", str(runs)],
                           capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0 and "indexing" not in again.stderr


def test_ls_piped_prints_no_progress(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _many(runs, 25)
    proc = subprocess.run([sys.executable, "-m", "deja", "ls", str(runs)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "160"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "run-00.jsonl" in proc.stdout and "indexing" not in proc.stdout


def test_view_shows_a_progress_bar_on_a_terminal_before_it_serves(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _many(runs, 25)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "deja", "view", str(runs), "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=follower,
                            stdin=subprocess.DEVNULL, env={**os.environ, "TERM": "xterm"})
    os.close(follower)
    try:
        seen = _read_until(leader, b"deja view: ").decode("utf-8", errors="replace")
    finally:
        proc.terminate()  # deja view stops the Streamlit server with it
        proc.wait(timeout=30)
        os.close(leader)
    assert "indexing cassettes" in seen and "25/25" in seen, seen
    assert seen.index("indexing cassettes") < seen.index("deja view: ")
