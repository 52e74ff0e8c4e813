"""The recorder's deferred writes (recorder.background): one thread for every open run.

A cassette's group commit and a run's status record are written off the agent's calls by
one daemon thread per process; starting a run starts no thread of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from recorder.background import CHORES, Chores
from recorder.cassette import CassetteWriter, load
from recorder.cassette.keys import Keyring
from recorder.errors import CassetteWriteError
from recorder.harness.progress import Progress, read_status

KEY = b"test-key-0123456789abcdef"  # the DEJA_KEY that conftest sets for every test


def poll(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def model_line(writer: CassetteWriter, n: int) -> None:
    writer.append({"kind": "model", "provider": "anthropic", "fp": f"f{n}",
                   "response": {"status": 200, "body": "a"}},
                  request_body={"model": "m", "messages": [{"role": "user", "content": "q"}]},
                  has_request=True)


def background_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "deja-background"]


def test_chores_run_once_each_in_the_order_they_are_due() -> None:
    chores = Chores("test-chores")
    done: list[str] = []
    gate = threading.Event()  # the thread's first chore holds it until the others are filed,
    chores.soon("gate", gate.wait)  # however late this thread is scheduled between them
    now = time.monotonic()
    chores.soon("late", lambda: done.append("late"), now + 0.05)
    chores.soon("early", lambda: done.append("early"), now)
    chores.soon("early", lambda: done.append("early, again"), now)  # waiting: no second
    gate.set()
    poll("both chores", lambda: len(done) == 2)
    assert done == ["early", "late"]
    assert not chores.waiting("early") and not chores.waiting("late")

    chores.soon("dropped", lambda: done.append("dropped"), time.monotonic() + 0.05)
    assert chores.waiting("dropped")
    chores.forget("dropped")
    assert not chores.waiting("dropped")
    chores.soon("after", lambda: done.append("after"), time.monotonic() + 0.1)
    poll("the chore after the dropped one", lambda: "after" in done)
    assert done == ["early", "late", "after"]  # the dropped one never ran


def test_forget_returns_only_once_a_running_chore_has_ended() -> None:
    chores = Chores("test-chores")
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def slow() -> None:
        started.set()
        release.wait(30)
        order.append("chore ended")

    chores.soon("file", slow)
    assert started.wait(30)
    forgetting = threading.Thread(target=lambda: (chores.forget("file"),
                                                  order.append("forget returned")))
    forgetting.start()
    poll("forget to wait", lambda: chores.waiting("file"))
    assert order == []  # the chore runs: forget waits for it
    release.set()
    forgetting.join(30)
    assert order == ["chore ended", "forget returned"]


def test_a_chore_that_fails_is_logged_and_the_thread_goes_on(caplog: Any) -> None:
    chores = Chores("test-chores")
    done: list[str] = []

    def bad() -> None:
        raise RuntimeError("a bug in a chore")

    chores.soon("bad", bad)
    chores.soon("good", lambda: done.append("good"), time.monotonic() + 0.02)
    poll("the chore after the failed one", lambda: done == ["good"])
    assert "a background write failed" in caplog.text and "a bug in a chore" in caplog.text


def test_many_open_cassettes_and_status_records_share_one_thread(tmp_path: Path) -> None:
    before = threading.active_count()
    writers = [CassetteWriter(tmp_path / f"r{i}.jsonl", {"run": f"r_bg_{i}"}, KEY, "turn")
               for i in range(40)]
    records = [Progress(f"r_bg_{i}", {}, interval=0.01) for i in range(40)]
    for i, (writer, progress) in enumerate(zip(writers, records, strict=True)):
        model_line(writer, i)  # a group commit asked for, off this thread
        progress.update(turn=1, step="model response 1")  # a write left to the background
    assert len(background_threads()) == 1
    assert threading.active_count() <= before + 1  # not one thread per run, or two
    poll("every record's latest state", lambda: all(
        (read_status(f"r_bg_{i}") or {}).get("turn") == 1 for i in range(40)))
    poll("every group commit", lambda: not any(CHORES.waiting(w._group) for w in writers))
    for writer in writers:
        writer.close({"status": "completed"})
    for progress in records:
        progress.update(status="completed", ended=True, force=True)
    ring = Keyring.of(KEY)
    assert all(load(w.path, keyring=ring).verified for w in writers)


FORKED = """
import os, sys, threading, time
from pathlib import Path
from recorder.background import CHORES
from recorder.cassette import CassetteWriter, load
from recorder.cassette.keys import Keyring
from recorder.harness.progress import Progress, read_status

KEY, d = %r, Path(sys.argv[1])

def model_line(writer):
    writer.append({"kind": "model", "provider": "anthropic", "fp": "f",
                   "response": {"status": 200, "body": "a"}},
                  request_body={"model": "m", "messages": []}, has_request=True)

def poll(check):
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.005)

def threads():
    return [t for t in threading.enumerate() if t.name == "deja-background"]

parent = CassetteWriter(d / "parent.jsonl", {"run": "r_parent"}, KEY, "turn")
model_line(parent)  # the parent's background thread runs
assert threads()
pid = os.fork()
if pid == 0:  # the parent's chores are not the child's; the child's own get done
    code = 1
    try:
        child = CassetteWriter(d / "child.jsonl", {"run": "r_child"}, KEY, "turn")
        model_line(child)
        poll(lambda: not CHORES.waiting(child._group))
        progress = Progress("r_child", {}, interval=0.01)
        progress.update(turn=7)
        poll(lambda: (read_status("r_child") or {}).get("turn") == 7)
        child.close({"status": "completed"})
        code = 0 if len(threads()) == 1 else 2
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
parent.close({"status": "completed"})
ring = Keyring.of(KEY)
assert load(d / "child.jsonl", keyring=ring).end["status"] == "completed"
assert load(d / "parent.jsonl", keyring=ring).end["status"] == "completed"
print("ok")
"""


def test_a_forked_child_records_with_a_background_thread_of_its_own(tmp_path: Path) -> None:
    """A process forked while the background thread runs (a warm fork server's program,
    say) gets a thread of its own for its chores; the parent's stay the parent's."""
    done = subprocess.run([sys.executable, "-c", FORKED % KEY, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def failing_in_background(monkeypatch: Any) -> list[int]:
    """``os.fsync`` failing (a disk that filled up under delayed allocation) when the
    background thread calls it; the fds it was called with."""
    real, calls = os.fsync, []

    def fsync(fd: int) -> None:
        if threading.current_thread().name == "deja-background":
            calls.append(fd)
            raise OSError(28, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_a_header_the_group_commit_cannot_force_is_no_recording(
        tmp_path: Path, monkeypatch: Any) -> None:
    """Under fsync="turn" the header goes to disk with the group commit; when that fails,
    nothing was recorded, as when the header's own write fails: the file is emptied (so
    `deja record` removes it, exits 74, and a worker dispatches the run again), and the
    next call is refused before it goes out."""
    calls = failing_in_background(monkeypatch)
    writer = CassetteWriter(tmp_path / "run.jsonl", {"run": "r_hdr"}, KEY, "turn")
    poll("the group commit of the header", lambda: calls)
    failed = poll("the writer to say it failed", lambda: writer.failed)
    assert "its header failed" in str(failed) and "Nothing was recorded" in str(failed)
    assert (tmp_path / "run.jsonl").stat().st_size == 0
    with pytest.raises(CassetteWriteError, match="its header failed"):
        model_line(writer, 0)
    assert (tmp_path / "run.jsonl").stat().st_size == 0
    writer.abandon()


def test_a_failed_group_commit_refuses_the_end_line(tmp_path: Path, monkeypatch: Any) -> None:
    """A pass that failed just before the run ends is not lost: the end line is refused
    (a completed status would claim lines the disk may not have)."""
    writer = CassetteWriter(tmp_path / "run.jsonl", {"run": "r_end"}, KEY, "turn")
    poll("the header's group commit", lambda: not CHORES.waiting(writer._group))
    calls = failing_in_background(monkeypatch)
    model_line(writer, 0)
    poll("the failed pass", lambda: calls and writer._group.error is not None)
    with pytest.raises(CassetteWriteError, match="forcing to disk seq 1 failed"):
        writer.close({"status": "completed"})
    writer.abandon()
    lines = (tmp_path / "run.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"kind":"end"' not in lines[-1]


SLEEPER = """
import threading, time
from recorder.background import CHORES
ran = threading.Event()
CHORES.soon("k", ran.set)
ran.wait()
print(threading.get_native_id(), CHORES._thread.native_id, flush=True)
time.sleep(60)
"""


def blocked_signals(pid: int, tid: int) -> int:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("SigBlk:"))
               .split()[1], 16)


def test_the_thread_leaves_a_process_s_signals_to_the_program() -> None:
    """The kernel may deliver a process's SIGTERM to any thread that does not block it;
    Python acts on it in the main thread only, and a main thread asleep wakes only for
    one delivered to it. The background thread blocks them: a SIGTERM reaches the
    program's main thread, asleep or not, at once."""
    import signal

    with subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE,
                          text=True) as program:
        try:
            assert program.stdout is not None
            main, background = map(int, program.stdout.readline().split())
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM,
                           signal.SIGCHLD):
                assert blocked_signals(program.pid, background) & 1 << (signum - 1)
                assert not blocked_signals(program.pid, main) & 1 << (signum - 1)
        finally:
            program.kill()
