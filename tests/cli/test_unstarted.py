"""A fork or a resume that cannot start says so, and leaves nothing of itself behind.

The program runs in a process of its own under deja's bootstrap, which starts the session
before the program's first line: there the project's ``[tool.deja]`` is read, the parent's
lines are served and the cassette is opened. When that fails, the bootstrap says why and
the program never runs. The launcher used to go on as if it had: "forked run ... -> FILE"
for a fork whose file held only the copied steps, "resumed run ..." for a resume, whose
interrupted end line was gone. A line found malformed only when restored is now refused
before anything runs (exit 2), and a session that cannot start leaves no fork file and a
resumed cassette as it was found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recorder.cassette import lock
from recorder.errors import ConfigError
from replayer.fork import fork
from replayer.resume import resume
from tests.cli.test_signed_malformed import GOLDEN, _mutant
from tests.conftest import TEST_KEY
from tests.tamper import join, resign

AGENT = (f"import sys\nsys.path.insert(0, {str(GOLDEN.parent)!r})\n"
         "from agent import agent\nprint(agent('http://127.0.0.1:9'))\n")
BAD_SETTINGS = '[tool.deja]\nbudget_usd = 5\n'  # a key deja does not know: refused at start


def _deja(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "300", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "deja", *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _project(folder: Path, settings: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run_agent.py").write_text(AGENT)
    if settings is not None:
        (folder / "pyproject.toml").write_text(settings)
    return folder


def _golden(out: Path, *, interrupted: bool = False) -> Path:
    """The golden run signed with this machine's key (interrupted: its end line says so)."""
    docs = [json.loads(raw) for raw in GOLDEN.read_bytes().splitlines()]
    if interrupted:
        docs[-1].update(status="interrupted", reason="signal 2")
    out.write_bytes(join(resign(docs, TEST_KEY.encode())))
    return out


def test_a_fork_that_cannot_start_writes_nothing(tmp_path: Path) -> None:
    parent = _golden(tmp_path / "parent.jsonl")
    project = _project(tmp_path / "project", BAD_SETTINGS)
    before = sorted(p.name for p in tmp_path.iterdir())
    done = _deja("fork", parent, "--at", "2", "--set", 'result.sky="hail"', "-o",
                 tmp_path / "forked.jsonl", "--cwd", project, "--", sys.executable,
                 "run_agent.py", cwd=tmp_path)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "could not start fork: ConfigError" in done.stderr and "budget_usd" in done.stderr
    assert "the fork did not start; nothing was written" in done.stderr, done.stderr
    assert "forked run" not in done.stderr and "Traceback" not in done.stderr
    assert "18 degrees" not in done.stdout  # the program never ran
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no fork file, no lock

    fixed = _project(tmp_path / "fixed", None)  # a fork from a project that starts (its
    done = _deja("fork", parent, "--at", "2", "--set", 'result.sky="clear"',  # edit the
                 "--then-replay", parent, "-o", tmp_path / "forked.jsonl",  # recorded value,
                 "--cwd", fixed, "--", sys.executable, "run_agent.py",  # so the parent
                 cwd=tmp_path)  # answers what follows)
    assert done.returncode == 0, done.stderr
    assert "forked run" in done.stderr and "18 degrees" in done.stdout


def test_a_resume_that_cannot_start_leaves_the_cassette_as_it_was(tmp_path: Path) -> None:
    run = _golden(tmp_path / "run.jsonl", interrupted=True)
    found = run.read_bytes()
    project = _project(tmp_path / "project", BAD_SETTINGS)
    done = _deja("resume", run, "--cwd", project, "--", sys.executable, "run_agent.py",
                 cwd=tmp_path)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "could not start resume: ConfigError" in done.stderr
    assert "the run was not resumed" in done.stderr, done.stderr
    assert "resumed run" not in done.stderr and "Traceback" not in done.stderr
    assert run.read_bytes() == found  # its interrupted end line is back where it was

    fixed = _project(tmp_path / "fixed", None)  # and it resumes once the project is fixed
    done = _deja("resume", run, "--cwd", fixed, "--", sys.executable, "run_agent.py",
                 cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "end status completed" in done.stderr and "18 degrees" in done.stdout
    last = json.loads(run.read_bytes().splitlines()[-1])
    assert (last["kind"], last["status"]) == ("end", "completed")
    resumed = [json.loads(raw) for raw in run.read_bytes().splitlines()
               if b'"resumed"' in raw]
    assert resumed[0]["detail"]["after_end"]["status"] == "interrupted"


def test_a_line_found_malformed_when_restored_stops_a_fork_or_resume_before_it_runs(
        tmp_path: Path) -> None:
    """The lines a fork or resume serves are restored whole before the program runs."""
    project = _project(tmp_path / "project", None)
    bad = _mutant(tmp_path / "bad.jsonl", 4, ("response", "headers"), [None] * 9)
    parent = _golden(tmp_path / "parent.jsonl")
    runs = [("fork", parent, "--at", "2", "--set", 'result.sky="hail"', "--then-replay", bad,
             "-o", tmp_path / "forked.jsonl"),
            ("fork", bad, "--at", "0", "--set", "value=\"x\"", "-o", tmp_path / "f2.jsonl")]
    unfinished = tmp_path / "unfinished.jsonl"  # the malformed run, its end line gone
    unfinished.write_bytes(b"".join(bad.read_bytes().splitlines(keepends=True)[:-1]))
    runs.append(("resume", unfinished))
    for args in runs:
        found = unfinished.read_bytes()
        done = _deja(*args, "--cwd", project, "--", sys.executable, "run_agent.py",
                     cwd=tmp_path)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "CorruptCassette" in done.stderr and "seq 3" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and "could not start" not in done.stderr
        assert "forked run" not in done.stderr and "resumed run" not in done.stderr
        assert "18 degrees" not in done.stdout
        assert unfinished.read_bytes() == found
    assert not (tmp_path / "forked.jsonl").exists() and not (tmp_path / "f2.jsonl").exists()


def test_resume_in_process_that_cannot_start_lets_the_cassette_go_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``replayer.resume()`` whose session cannot start (its settings refused) puts back
    the end line it cut and releases the cassette's writer lock."""
    run = _golden(tmp_path / "run.jsonl", interrupted=True)
    found = run.read_bytes()
    monkeypatch.chdir(_project(tmp_path / "project", BAD_SETTINGS))
    with pytest.raises(ConfigError, match="budget_usd"), resume(run):
        pytest.fail("the block must not run")
    assert run.read_bytes() == found
    assert lock.holder_of(run) is None  # its writer lock let go


def test_fork_in_process_that_cannot_start_leaves_no_file_and_no_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parent = _golden(tmp_path / "parent.jsonl")
    out = tmp_path / "forked.jsonl"
    monkeypatch.chdir(_project(tmp_path / "project", BAD_SETTINGS))
    with pytest.raises(ConfigError, match="budget_usd"), \
            fork(parent, at=2, sets=['result.sky="hail"'], out=out):
        pytest.fail("the block must not run")
    assert not out.exists() and lock.holder_of(out) is None


def test_a_fork_whose_command_boots_python_twice_keeps_the_fork_that_ran(
        tmp_path: Path) -> None:
    """A shell command that starts Python twice boots deja's bootstrap twice; the second
    boot cannot start a second fork into the same file, which says nothing of the first."""
    parent = _golden(tmp_path / "parent.jsonl")
    project = _project(tmp_path / "project", None)
    out = tmp_path / "forked.jsonl"
    done = _deja("fork", parent, "--at", "2", "--set", 'result.sky="clear"', "--then-replay",
                 parent, "-o", out, "--cwd", project, "--", "sh", "-c",
                 f"{sys.executable} run_agent.py; {sys.executable} -c 'print(1)'",
                 cwd=tmp_path)
    assert "18 degrees" in done.stdout, done.stderr  # the fork ran
    assert "nothing was written" not in done.stderr, done.stderr
    assert out.exists() and json.loads(out.read_bytes().splitlines()[0])["parent"]["step"] == 2


def test_a_replay_whose_start_fails_is_said_without_a_traceback(tmp_path: Path) -> None:
    """The cassette changed between the command's check and the program's start: the
    program's bootstrap refuses it, and deja replay says the program ended before the
    replay could report."""
    run = _golden(tmp_path / "run.jsonl")
    project = _project(tmp_path / "project", None)
    done = _deja("replay", run, "--cwd", project, "--", "sh", "-c",
                 f"printf garbage >> {run}; exec {sys.executable} run_agent.py", cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "could not start replay" in done.stderr and "Traceback" not in done.stderr
    assert "before the replay could report" in done.stderr
