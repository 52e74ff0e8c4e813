"""The launch spec: the one value (``DEJA_LAUNCH``) a launcher starts a program with.

Read as the bootstrap reads it, and through a real process: a spec that is not one this
deja reads (not JSON, another version, a field it does not know or of the wrong type)
stops the program before it runs, with one line and exit status 3, never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deja.boot import BOOT_DIR, BOOT_FAILED, LAUNCH_ENV, child_env
from recorder.errors import ConfigError
from recorder.launch import LAUNCH_VERSION, LaunchMode, LaunchSpec

PROGRAM = ("import os; print('ran', os.environ.get('DEJA_MODE'), "
           "os.environ.get('DEJA_LAUNCH'), os.environ.get('PYTHONPATH'))")


def test_a_spec_reads_back_as_written() -> None:
    spec = LaunchSpec(mode=LaunchMode.RECORD, cassette="/runs/r.jsonl", report="/tmp/x.json",
                      run_id="r_1", argv=("python", "agent.py"), labels={"team": "a"},
                      redact_headers=("x-secret",), budgets={"turns": 3}, loop_guard=False,
                      launcher_pid=42, lock_fd=7, lock_cassette="/runs/r.jsonl",
                      signals_held=True)
    text = spec.encode()
    assert text.startswith(f'{{"version":{LAUNCH_VERSION},"mode":"record"')
    assert LaunchSpec.decode(text) == spec
    fork = LaunchSpec("fork", "/p.jsonl", at=3, patch=[{"op": "replace", "path": "/result",
                                                         "value": 1}], out="/f.jsonl")
    assert fork.mode is LaunchMode.FORK and isinstance(fork.patch, tuple)  # given as JSON gives
    assert LaunchSpec.decode(fork.encode()) == fork


@pytest.mark.parametrize(("text", "said"), [
    ("{", "is not JSON"),
    ("[1]", "is not a JSON object"),
    ('{"mode": "record", "cassette": "r.jsonl"}', "is version None, and this deja reads "
                                                  "version 1"),
    ('{"version": 2, "mode": "record", "cassette": "r.jsonl"}', "is version 2"),
    ('{"version": 1, "mode": "record"}', "has no cassette"),
    ('{"version": 1, "mode": "rewind", "cassette": "r"}',
     "mode is 'rewind', not one of record, replay, fork, resume"),
    ('{"version": 1, "mode": "fork", "cassette": "r", "at": "3"}',
     "at is '3', not an integer or null"),
    ('{"version": 1, "mode": "record", "cassette": "r", "overwrite": 1}',
     "overwrite is 1, not true or false"),
    ('{"version": 1, "mode": "record", "cassette": "r", "argv": "python a.py"}',
     "argv is 'python a.py', not a list or null"),
    ('{"version": 1, "mode": "record", "cassette": "r", "rewind": true}',
     "has fields this deja does not know: rewind"),
])
def test_a_spec_this_deja_does_not_read_is_refused_by_name(text: str, said: str) -> None:
    with pytest.raises(ConfigError, match="the launch spec") as caught:
        LaunchSpec.decode(text)
    assert said in str(caught.value)


def boot(launch: str | None, cwd: Path,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A Python program started in ``cwd`` with deja's bootstrap and ``launch`` as its spec."""
    run_env = env if env is not None else {**os.environ, "PYTHONPATH": str(BOOT_DIR)}
    if launch is not None:
        run_env[LAUNCH_ENV] = launch
    return subprocess.run([sys.executable, "-c", PROGRAM], env=run_env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("launch", [
    "not json at all",
    json.dumps({"version": 99, "mode": "record", "cassette": "r.jsonl"}),
    json.dumps({"version": 1, "mode": "record", "cassette": "r.jsonl", "budget": 1}),
])
def test_a_program_given_a_bad_spec_does_not_run(tmp_path: Path, launch: str) -> None:
    done = boot(launch, tmp_path)
    assert done.returncode == BOOT_FAILED, done.stderr
    assert "ran" not in done.stdout
    assert done.stderr.startswith(f"deja: {LAUNCH_ENV}: the launch spec ")
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())  # nothing recorded


def test_the_program_sees_its_mode_and_neither_the_spec_nor_the_bootstrap(
        tmp_path: Path) -> None:
    run = tmp_path / "r.jsonl"
    env = child_env("record", cassette=str(run), run_id="r_spec0001", argv=["python", "-c"])
    assert json.loads(env[LAUNCH_ENV])["cassette"] == str(run)
    assert env["DEJA_MODE"] == "record" and env["PYTHONPATH"].startswith(str(BOOT_DIR))
    done = boot(None, tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ran", "record", "None", "None"]
    assert run.read_text().count("\n") == 2  # header and end: the program ran recorded


def test_the_users_switch_to_allow_unverified_is_passed_on_in_the_spec(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_ALLOW_UNVERIFIED", "1")
    env = child_env("replay", cassette="/r.jsonl", allow_unverified=True)
    assert "DEJA_ALLOW_UNVERIFIED" not in env  # the launcher decided; the spec says it
    assert LaunchSpec.decode(env[LAUNCH_ENV]).allow_unverified is True
    assert env["ANTHROPIC_API_KEY"]  # a replayed client needs no real key
