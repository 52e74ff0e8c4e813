"""Faults around the signed log, through the real CLI and real processes.

- signals to ``deja record``: the program stops with it, the run ends ``interrupted``
  with an end line, the launcher exits 128 + N, and the run resumes to completion with
  every invoice paid once; SIGKILL to the launcher stops the program too;
- one writer per cassette: a second ``deja resume``, or ``deja record --force`` onto a
  cassette being written, is refused naming the holder; nothing is paid twice;
- a full disk (a small tmpfs): the write error stops the run at once, no request is sent
  twice, the file keeps its whole lines and verifies, and the run resumes elsewhere;
- what ``deja verify`` says of a cut-off file, and of an edited or removed ``key_id``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from recorder.cassette import load
from recorder.cassette.keys import Keyring
from recorder.testing.server import StubServer

ROOT = Path(__file__).resolve().parents[2]
AGENT = "examples/reconciliation.py"
SCRIPT = json.loads((ROOT / "examples" / "reconciliation.stub.json").read_text())
KEY = "test-key-0123456789abcdef"  # conftest's DEJA_KEY
PAYS = 20


def deja(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deja", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def start(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deja", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def payments(ledger: Path) -> list[str]:
    if not ledger.exists():
        return []
    with contextlib.closing(sqlite3.connect(ledger)) as db:
        try:
            return [r[0] for r in db.execute("SELECT invoice FROM payments ORDER BY invoice")]
        except sqlite3.OperationalError as exc:  # the agent made the file, not yet its table
            if "no such table" not in str(exc):
                raise
            return []


def wait_for(predicate, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def last_line(path: Path) -> dict:
    return json.loads(path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1])


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer(SCRIPT) as server:
        yield server


@pytest.fixture
def env(tmp_path: Path, stub: StubServer) -> dict[str, str]:
    return {**os.environ, "ANTHROPIC_BASE_URL": stub.url, "DEJA_KEY": KEY,
            "RECON_LEDGER": str(tmp_path / "ledger.sqlite")}


def assert_paid_once(ledger: Path) -> None:
    paid = payments(ledger)
    assert len(paid) == PAYS, paid
    assert len(set(paid)) == PAYS, collections.Counter(paid).most_common(3)


# --------------------------------------------------------------------------- signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_to_record_interrupts_the_run_with_an_end_line_and_it_resumes(
        tmp_path: Path, env: dict[str, str], signum: int) -> None:
    cassette = tmp_path / "run.jsonl"
    ledger = Path(env["RECON_LEDGER"])
    proc = start("record", "-o", str(cassette), "--", "python", AGENT,
                 env={**env, "RECON_DELAY": "0.05"})
    wait_for(lambda: len(payments(ledger)) >= 2, what="two payments")
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    paid = len(payments(ledger))
    time.sleep(0.5)
    assert len(payments(ledger)) == paid  # nothing goes on behind our back
    assert paid < PAYS
    end = last_line(cassette)
    assert end["kind"] == "end" and end["status"] == "interrupted", end
    assert end["exit_code"] == 128 + signum
    assert end["error"]["type"] == "Interrupted"
    record = json.loads((Path(env.get("DEJA_HOME", "")) / "runs" /
                         f"{load(cassette).run}.json").read_text())
    assert record["status"] == "interrupted"

    resumed = deja("resume", str(cassette), env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "end line is cut" in resumed.stderr
    assert_paid_once(ledger)
    final = load(cassette, allow_incomplete=False)
    assert final.end is not None and final.end["status"] == "completed"
    events = [o for o in final.observations if o["kind"] == "control"]
    assert events[-1]["event"] == "resumed"
    assert events[-1]["detail"]["after_end"]["status"] == "interrupted"


def test_sigkill_to_the_launcher_stops_the_program(tmp_path: Path, env: dict[str, str]) -> None:
    cassette = tmp_path / "run.jsonl"
    ledger = Path(env["RECON_LEDGER"])
    proc = start("record", "-o", str(cassette), "--", "python", AGENT,
                 env={**env, "RECON_DELAY": "0.05"})
    wait_for(lambda: len(payments(ledger)) >= 2, what="two payments")
    proc.kill()
    proc.communicate(timeout=30)
    # The program got SIGTERM as its parent died: it writes its own end line and stops.
    wait_for(lambda: cassette.read_bytes().endswith(b"\n")
             and last_line(cassette)["kind"] == "end", timeout=30, what="the end line")
    paid = len(payments(ledger))
    time.sleep(0.5)
    assert len(payments(ledger)) == paid < PAYS
    assert last_line(cassette)["status"] == "interrupted"
    resumed = deja("resume", str(cassette), env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert_paid_once(ledger)


def test_an_exit_by_signal_of_the_program_gives_128_plus_n(tmp_path: Path,
                                                           env: dict[str, str]) -> None:
    proc = deja("record", "-o", str(tmp_path / "k.jsonl"), "--", "python", "-c",
                "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", env=env)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "it can be resumed" in proc.stderr


# --------------------------------------------------------------------------- one writer


def test_a_cassette_has_one_writer(tmp_path: Path, env: dict[str, str]) -> None:
    cassette = tmp_path / "run.jsonl"
    ledger = Path(env["RECON_LEDGER"])
    proc = start("record", "-o", str(cassette), "--", "python", AGENT,
                 env={**env, "RECON_DELAY": "0.1"})
    try:
        wait_for(lambda: len(payments(ledger)) >= 1, what="a payment")
        run = load(cassette).run
        for attempt in (["resume", str(cassette)],
                        ["record", "--force", "-o", str(cassette), "--", "python", AGENT]):
            refused = deja(*attempt, env=env)
            assert refused.returncode == 2, refused.stderr
            assert "CassetteLocked" in refused.stderr
            assert f"pid {proc.pid}" in refused.stderr and run in refused.stderr
        with pytest.raises(Exception, match="being written by") as info:
            from replayer import resume
            resume(cassette).__enter__()
        assert type(info.value).__name__ == "CassetteLocked"
    finally:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert_paid_once(ledger)
    final = load(cassette, allow_incomplete=False)  # the chain is whole
    assert final.end is not None and final.end["status"] == "completed"
    assert not (tmp_path / ".run.jsonl.lock").exists()  # released and removed


def test_the_lock_dies_with_its_holder(tmp_path: Path, env: dict[str, str]) -> None:
    """A run killed outright (both processes) leaves no stale lock: it resumes."""
    cassette = tmp_path / "run.jsonl"
    ledger = Path(env["RECON_LEDGER"])
    proc = subprocess.Popen([sys.executable, "-m", "deja", "record", "-o", str(cassette), "--",
                             "python", AGENT], env={**env, "RECON_DELAY": "0.05"}, cwd=ROOT,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for(lambda: len(payments(ledger)) >= 2, what="two payments")
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the program at once
    proc.wait(timeout=30)
    assert (tmp_path / ".run.jsonl.lock").exists()  # left behind, but not held
    status = deja("status", load(cassette, allow_incomplete=True).run, env=env)
    assert status.returncode == 0, status.stderr
    assert ": crashed: its process" in status.stdout and "deja resume" in status.stdout
    by_path = json.loads(deja("status", str(cassette), "--json", env=env).stdout)
    assert (by_path["status"], by_path["last_recorded_status"]) == ("crashed", "running")
    assert by_path["process_alive"] is False
    resumed = deja("resume", str(cassette), env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert_paid_once(ledger)


# --------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 48 KiB tmpfs: the reconciliation cassette (~95 KB) fills it halfway through."""
    mount = tmp_path / "small"
    mount.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mount)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"mounting a tmpfs needs root: {done.stderr}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_the_run_at_once_and_loses_no_line(
        tmp_path: Path, env: dict[str, str], stub: StubServer, small_disk: Path) -> None:
    cassette = small_disk / "run.jsonl"
    ledger = Path(env["RECON_LEDGER"])
    proc = deja("record", "-o", str(cassette), "--", "python", AGENT, env=env)
    assert proc.returncode != 0
    assert "CassetteWriteError" in proc.stderr, proc.stderr
    assert "APIConnectionError" not in proc.stderr
    bodies = [json.dumps(r["body"], sort_keys=True) for r in stub.requests]
    assert len(bodies) == len(set(bodies)), "a request was sent twice (an SDK retry)"
    assert len(bodies) < 61  # it stopped before the end
    # The file holds whole lines only and its chain verifies.
    data = cassette.read_bytes()
    assert data.endswith(b"\n")
    crashed = load(cassette, allow_incomplete=True)
    assert crashed.torn_offset is None
    # The end line is written when a short line still fits after the long one failed: the
    # run was interrupted by the disk, so it resumes.
    assert crashed.end is None or (crashed.end["status"] == "interrupted" and
                                   crashed.end["error"]["type"] == "CassetteWriteError")
    assert len(crashed.observations) > 3
    # Nothing after the failure went out: every request the stub saw but the log lacks is
    # at most the one whose line failed.
    model_lines = sum(o["kind"] == "model" for o in crashed.observations)
    assert len(bodies) - model_lines <= 1
    # Room again (the file moved to a real disk): the run resumes, paying each invoice once.
    moved = tmp_path / "moved.jsonl"
    shutil.copy(cassette, moved)
    resumed = deja("resume", str(moved), env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert_paid_once(ledger)


def test_a_cassette_path_that_is_a_directory_is_a_named_error(tmp_path: Path) -> None:
    import recorder
    from recorder.cassette import CassetteWriter
    from recorder.errors import ConfigError

    folder = tmp_path / "taken.jsonl"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        CassetteWriter(folder, {"run": "r_x"}, KEY.encode())
    with recorder.record(folder) as run:  # record() takes a directory for <run>.jsonl
        recorder.uuid4()
    assert run.path.parent == folder and load(run.path).end is not None


# --------------------------------------------------------------------------- verify


@pytest.fixture
def small_cassette(tmp_path: Path) -> Path:
    import recorder

    path = tmp_path / "small.jsonl"
    with recorder.record(path, keyring=Keyring.of(KEY)):
        recorder.uuid4()
        recorder.now()
    return path


def test_verify_refuses_a_run_whose_end_line_was_cut(small_cassette: Path,
                                                     env: dict[str, str]) -> None:
    lines = small_cassette.read_bytes().splitlines(keepends=True)
    small_cassette.write_bytes(b"".join(lines[:-1]))
    cut = deja("verify", str(small_cassette), env=env)
    assert cut.returncode == 2
    assert "no end line after seq 1" in cut.stderr
    assert deja("verify", str(small_cassette), "--allow-incomplete", env=env).returncode == 0
    small_cassette.write_bytes(lines[0])
    header_only = deja("verify", str(small_cassette), env=env)
    assert header_only.returncode == 2
    assert "holds only its header" in header_only.stderr and "seq -1" not in header_only.stderr


@pytest.mark.parametrize("how", ["unknown", "removed", "list"])
def test_an_edited_key_id_is_tampering_not_a_missing_key(
        small_cassette: Path, env: dict[str, str], tmp_path: Path, how: str) -> None:
    lines = small_cassette.read_bytes().splitlines(keepends=True)
    header = json.loads(lines[0])
    if how == "unknown":
        header["key_id"] = "k_000000000000"
    elif how == "removed":
        del header["key_id"]
    else:
        header["key_id"] = ["k_1"]
    header["argv"] = ["python", "-c", f"open({str(tmp_path / 'PWNED')!r}, 'w')"]
    small_cassette.write_bytes(json.dumps(header).encode() + b"\n" + b"".join(lines[1:]))
    expected = "CorruptCassette" if how == "list" else "SignatureError"
    for command in (["verify"], ["replay"], ["replay", "--allow-unverified",
                                             "--run-recorded-command"],
                    ["show"], ["show", "--allow-unverified"]):
        proc = deja(*command, str(small_cassette), env=env)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert expected in proc.stderr, (command, proc.stderr)
        assert "Traceback" not in proc.stderr
    if how != "list":
        assert "key_id was edited" in proc.stderr
    listed = deja("ls", str(small_cassette.parent), "--json", env=env)
    rows = json.loads(listed.stdout)
    assert [r["status"] for r in rows] == ["error"] and expected in rows[0]["error"]
    assert not (tmp_path / "PWNED").exists()


def test_an_unverified_cassette_never_runs_its_header_command(
        tmp_path: Path, env: dict[str, str]) -> None:
    import recorder

    path = tmp_path / "foreign.jsonl"
    marker = tmp_path / "PWNED"
    with recorder.record(path, keyring=Keyring.of("somebody else's key")):
        recorder.uuid4()
    lines = path.read_bytes().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["argv"] = ["python", "-c", f"open({str(marker)!r}, 'w')"]
    path.write_bytes(json.dumps(header).encode() + b"\n" + b"".join(lines[1:]))
    for extra in ([], ["--allow-unverified"]):
        proc = deja("replay", str(path), *extra, env=env)
        assert proc.returncode == 2, proc.stderr
        assert not marker.exists()
    assert "does not run the command an unverified header names" in proc.stderr
    assert "open(" in proc.stderr  # the message shows what it refused to run
    ran = deja("replay", str(path), "--allow-unverified", "--", "python", "-c",
               "import recorder; recorder.uuid4()", env=env)
    assert ran.returncode == 0, ran.stderr  # the user's own command, served unverified
    assert "NOT VERIFIED" in ran.stdout and not marker.exists()


def test_fork_then_replay_verifies_the_other_cassette(
        tmp_path: Path, env: dict[str, str], small_cassette: Path) -> None:
    import recorder

    other = tmp_path / "other.jsonl"
    with recorder.record(other, keyring=Keyring.of("somebody else's key")):
        recorder.uuid4()
    out = tmp_path / "fork.jsonl"
    proc = deja("fork", str(small_cassette), "--at", "0", "--set", "value=x", "-o", str(out),
                "--then-replay", str(other), "--", "python", "-c", "pass", env=env)
    assert proc.returncode == 2, proc.stderr
    assert "UnverifiedCassette" in proc.stderr
    assert not out.exists()
    tampered = tmp_path / "tampered.jsonl"
    lines = small_cassette.read_bytes().splitlines(keepends=True)
    line = json.loads(lines[1])
    line["value"] = "forged"
    tampered.write_bytes(lines[0] + json.dumps(line).encode() + b"\n" + b"".join(lines[2:]))
    proc = deja("fork", str(small_cassette), "--at", "0", "--set", "value=x", "-o", str(out),
                "--then-replay", str(tampered), "--", "python", "-c", "pass", env=env)
    assert proc.returncode == 2 and "SignatureError" in proc.stderr
    assert not out.exists()


# --------------------------------------------------------------------------- small things


def test_record_force_onto_a_directory_records_inside_it(tmp_path: Path,
                                                         env: dict[str, str]) -> None:
    folder = tmp_path / "taken.jsonl"
    folder.mkdir()
    proc = deja("record", "--force", "-o", str(folder), "--", "python", "-c",
                "import recorder; recorder.uuid4()", env=env)
    assert proc.returncode == 0, proc.stderr
    (made,) = folder.glob("r_*.jsonl")
    assert f"recorded run {made.stem} to {made}" in proc.stderr
    assert load(made, allow_incomplete=False).end["status"] == "completed"


def test_a_refused_start_does_not_claim_a_recording(small_cassette: Path,
                                                    env: dict[str, str],
                                                    tmp_path: Path) -> None:
    before = small_cassette.read_bytes()
    blocked_home = tmp_path / "home-is-a-file"
    blocked_home.write_text("")
    proc = deja("record", "--force", "-o", str(small_cassette), "--", "python", "-c",
                "print('agent ran')",
                env={**env, "DEJA_KEY": "", "DEJA_HOME": str(blocked_home)})
    assert proc.returncode != 0
    assert "agent ran" not in proc.stdout
    assert "recorded run" not in proc.stderr
    assert small_cassette.read_bytes() == before  # the old run is untouched


def test_a_torn_file_with_an_edited_middle_is_tampered_not_torn(small_cassette: Path) -> None:
    from recorder.errors import SignatureError

    lines = small_cassette.read_bytes().splitlines(keepends=True)
    line = json.loads(lines[1])
    line["value"] = "forged"
    cut = lines[-1][: len(lines[-1]) // 2]
    small_cassette.write_bytes(lines[0] + json.dumps(line).encode() + b"\n"
                               + b"".join(lines[2:-1]) + cut)
    with pytest.raises(SignatureError, match="seq 0"):
        load(small_cassette)
    lines2 = [lines[0], *lines[1:-1], cut]
    small_cassette.write_bytes(b"".join(lines2))
    from recorder.errors import TornCassette

    with pytest.raises(TornCassette, match="lines before it are verified"):
        load(small_cassette)
