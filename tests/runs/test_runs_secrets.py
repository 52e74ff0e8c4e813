"""The secret scan of the runs service: a submitted run's label, the question a run asks
and the answer it is given (``recorder.ask``), and a failed run's error never reach a file
in clear, while the program still gets the answer as it was typed.

Real ``deja worker`` processes run the programs; the runs service (what ``deja serve``
wraps) submits and answers. Then every file under ``$DEJA_HOME`` (the runs database with
the engine's tables, its WAL, status records, cassettes, the index after ``deja ls``), a
``sqlite3`` dump of the database, the worker's own log lines and what ``deja export`` sends to a
real OTLP/HTTP endpoint and writes as OTLP/JSON are searched for every secret of the scan
(``secret_agent.placements``) in clear, base64 at three alignments and URL-encoded.
"""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner
from lifecycle_helpers import (  # noqa: F401 (fixtures)
    PYTHON,
    Workers,
    home_fixture,
    runs_fixture,
    status_of,
    wait_for,
    workers_fixture,
    write_agent,
)
from secret_agent import RUNS_PLACEMENTS, OtlpReceiver, leaks, placements

from deja.cli import main
from deja.runs import config, service
from recorder.capture.redact import REDACTED
from recorder.cassette import load

ASKING = """\
import hashlib

import recorder

answer = recorder.ask("Deploy with password={question} now?")
with open("answer.sha256", "w") as f:  # what the program was given, not the answer itself
    f.write(hashlib.sha256(answer.encode()).hexdigest())
"""

WAIT = 120.0  # seconds: polled, so only a loaded machine waits this long

FAILING = """\
import recorder

recorder.now()
raise RuntimeError("cannot reach the ledger database: password={error}")
"""


def test_the_runs_database_and_its_exports_hold_no_secret(
        runs: service.Runs, workers: Workers, home: Path, tmp_path: Path) -> None:
    s = placements()
    assert set(RUNS_PLACEMENTS) <= set(s)
    agents = tmp_path / "agents"  # the programs' own files: not deja's, not scanned
    agents.mkdir()
    asking = write_agent(agents, "asking.py", ASKING.format(question=s["ask_question"]))
    failing = write_agent(agents, "failing.py", FAILING.format(error=s["runs_error"]))
    asked = runs.submit({"command": [PYTHON, asking.name], "cwd": str(agents),
                         "labels": {"team": "billing", "db_password": s["runs_label"]}})
    run_id = str(asked["run_id"])
    failed_id = str(runs.submit({"command": [PYTHON, failing.name],
                                 "cwd": str(agents)})["run_id"])

    worker = workers.start("w1")
    waiting = wait_for("the run to ask", lambda: status_of(runs, run_id, "input_required"),
                       timeout=WAIT, show=worker.output)
    assert waiting["question"] == f"Deploy with password={REDACTED} now?"
    assert waiting["labels"] == {"team": "billing", "db_password": REDACTED}
    typed = f"use {s['ask_answer']} for it"
    runs.answer(run_id, typed)
    done = wait_for("the run to complete", lambda: status_of(runs, run_id, "completed", "failed"),
                    timeout=WAIT, show=worker.output)
    assert done["status"] == "completed", (done, worker.output())
    # The program got the answer as typed; deja kept it redacted.
    given = (agents / "answer.sha256").read_text()
    assert given == hashlib.sha256(typed.encode()).hexdigest()
    cassette = config.cassette_dir() / f"{run_id}.jsonl"
    asks = [o for o in load(cassette).observations if o.get("name") == "ask"]
    assert [o["value"] for o in asks] == ["use ghp_[redacted] for it"]
    assert not (home / "runs" / f"{run_id}.answer").exists()  # read once, then removed

    ended = wait_for("the failing run to end", lambda: status_of(runs, failed_id, "failed"),
                     timeout=WAIT, show=worker.output)
    assert ended["error"] == f"cannot reach the ledger database: password={REDACTED}"
    worker.stop()

    # Everything deja wrote: DEJA_HOME (the database, status records, cassettes), the index,
    # a dump of the database, the worker's log, and the exports.
    cassettes = [cassette, config.cassette_dir() / f"{failed_id}.jsonl"]
    listed = subprocess.run([sys.executable, "-m", "deja", "ls", str(config.cassette_dir())],
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    dump = tmp_path / "runs-dump.sql"
    databases = [p for p in home.rglob("*.sqlite")]
    assert databases, sorted(home.rglob("*"))
    with dump.open("w") as out:
        for db in databases:
            with sqlite3.connect(db) as conn:
                out.writelines(f"{line}\n" for line in conn.iterdump())
    tables = dump.read_text()
    assert "deja_runs" in tables and "workflow_status" in tables
    exported = []
    with OtlpReceiver(tmp_path / "otlp") as receiver:
        for path in cassettes:
            sent = CliRunner().invoke(main, ["export", str(path), "--otlp", receiver.url])
            assert sent.exit_code == 0, sent.output
            target = tmp_path / f"{path.stem}.otlp.json"
            wrote = CliRunner().invoke(main, ["export", str(path), "--content", "--format",
                                              "otlp-json", "-o", str(target)])
            assert wrote.exit_code == 0, wrote.output
            exported.append(target)
        exported += wait_for("the endpoint to receive both runs",
                             lambda: list(receiver.files) if len(receiver.files) == 2 else None)
    # The worker's own lines (the programs' output passes through as they wrote it: a
    # program that prints its secret prints it).
    said = tmp_path / "worker-lines.log"
    said.write_text("".join(line for line in worker.output().splitlines(keepends=True)
                            if line.startswith("deja:")))
    assert f"run {failed_id} failed: cannot reach the ledger database" in said.read_text()
    files = [p for p in home.rglob("*") if p.is_file()]
    files += [dump, said, *exported]
    found = leaks(s, files)
    assert not found, "\n".join(found)
