"""A run's status record on disk: written over in place, sealed, and never read torn."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import recorder.harness.progress as progress
from recorder.harness.progress import Progress, close_record, read_status, runs_dir, status_path


def raw(run: str) -> str:
    return status_path(run).read_text(encoding="utf-8")


def test_a_record_is_written_over_in_place_never_made_again() -> None:
    record = Progress("r_inplace", {"turn_limit": 9}, interval=0)
    first = os.stat(record.path)
    for turn in range(1, 6):
        record.update(turn=turn, step=f"tool search(query='{'x' * turn * 40}')", force=True)
        assert os.stat(record.path).st_ino == first.st_ino  # the same file, written over
    assert stat.S_IMODE(first.st_mode) == 0o600
    assert sorted(p.name for p in runs_dir().iterdir()) == ["r_inplace.json"]  # no temp file
    shown = read_status("r_inplace")
    assert shown is not None and shown["turn"] == 5 and shown["turn_limit"] == 9
    assert "check" not in shown  # the seal is the file's, not the record's
    on_disk = json.loads(raw("r_inplace"))  # plain JSON: `cat` and older readers read it
    assert on_disk.pop("check") and on_disk == shown


def test_a_shorter_record_is_padded_to_the_length_of_the_one_it_replaces() -> None:
    record = Progress("r_pad", {}, interval=0)
    record.update(step="tool pay(" + "invoice='INV-7', " * 20 + ")", force=True)
    long = len(raw("r_pad"))
    record.update(step="done", force=True)
    text = raw("r_pad")
    # one write covers the whole old record: a process killed while writing leaves the old
    # record or the new one, never the new one's head on the old one's tail
    assert len(text) == long and text.endswith(" ") and text.rstrip().endswith("}")
    assert (read_status("r_pad") or {})["step"] == "done"


def test_a_record_that_does_not_match_its_seal_is_no_record() -> None:
    record = Progress("r_torn", {"note": "abc"}, interval=0)
    record.update(turn=3, force=True)
    good = raw("r_torn")
    status_path("r_torn").write_text(good.replace('"turn": 3', '"turn": 8'))  # half-written
    assert read_status("r_torn") is None
    head = json.dumps({"run_id": "r_torn", "status": "cancelled"})  # a new head, old tail
    status_path("r_torn").write_text(head[:-1] + good[len(head) - 1:])
    assert read_status("r_torn") is None
    status_path("r_torn").write_text("")  # made, not yet written
    assert read_status("r_torn") is None
    status_path("r_torn").write_text(json.dumps({"run_id": "r_torn", "turn": 2}))  # unsealed
    assert read_status("r_torn") == {"run_id": "r_torn", "turn": 2}  # an older deja's


def test_a_record_caught_while_being_written_is_read_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    record = Progress("r_caught", {}, interval=0)
    record.update(turn=4, step="model response 4", force=True)
    good = raw("r_caught")
    status_path("r_caught").write_text(good[:len(good) // 2])  # the write under way
    waits: list[float] = []

    def writer_finishes(seconds: float) -> None:  # while the reader waits
        waits.append(seconds)
        status_path("r_caught").write_text(good)

    monkeypatch.setattr(progress, "_pause", writer_finishes)
    shown = read_status("r_caught")
    assert shown is not None and shown["turn"] == 4 and len(waits) == 1


def test_a_reader_waits_for_the_write_under_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer holds the record's lock while it writes: a reader waits for it, and reads
    the record whole the first time (here it has no second read to fall back on)."""
    record = Progress("r_wait", {}, interval=0)
    record.update(turn=6, step="tool search", force=True)
    good = raw("r_wait")
    monkeypatch.setattr(progress, "_READS", 1)
    waiting = threading.Event()
    real_pause = progress._pause
    monkeypatch.setattr(progress, "_pause", lambda s: (waiting.set(), real_pause(s)))
    monkeypatch.setattr(progress, "_READ_WAIT", 30.0)
    fd = os.open(record.path, os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        os.pwrite(fd, good[:len(good) // 2].encode(), 0)  # half of it, and the old tail
        os.ftruncate(fd, len(good) // 2)
        result: list[dict[str, Any] | None] = []
        reader = threading.Thread(target=lambda: result.append(read_status("r_wait")))
        reader.start()
        assert waiting.wait(30)  # the reader is waiting for the lock
        os.pwrite(fd, good.encode(), 0)
    finally:
        os.close(fd)  # the lock goes with it
    reader.join(30)
    assert result and result[0] is not None and result[0]["turn"] == 6


def test_readers_and_a_writer_at_full_speed() -> None:
    record = Progress("r_busy", {}, interval=0)
    record.update(turn=0, step="turn 0 ", force=True)
    stop = threading.Event()

    def write() -> None:
        turn = 0
        while not stop.is_set():
            turn += 1  # records of varying length, each saying its turn twice
            record.update(turn=turn, step=f"turn {turn} " + "·" * (turn % 97), force=True)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        seen = []
        for _ in range(2000):
            shown = read_status("r_busy")
            assert shown is not None
            assert shown["step"].startswith(f"turn {shown['turn']} ")
            assert len(shown["step"]) == len(f"turn {shown['turn']} ") + shown["turn"] % 97
            seen.append(shown["turn"])
    finally:
        stop.set()
        writer.join()
    assert seen == sorted(seen)  # never an older record after a newer one


def test_a_record_longer_than_a_page_is_a_new_file_renamed_over_the_old() -> None:
    record = Progress("r_long", {}, interval=0)
    small = os.stat(record.path).st_ino
    record.update(step="tool write_file(" + "x" * 5000 + ")", force=True)
    long = os.stat(record.path)
    assert long.st_ino != small and stat.S_IMODE(long.st_mode) == 0o600
    assert len((read_status("r_long") or {})["step"]) == 5017
    record.update(step="done", force=True)  # after a long one: a new, short file
    after = os.stat(record.path)
    assert after.st_ino != long.st_ino and after.st_size < 4096
    record.update(step="done again", force=True)  # and in place from then on
    assert os.stat(record.path).st_ino == after.st_ino
    assert (read_status("r_long") or {})["step"] == "done again"
    assert sorted(p.name for p in runs_dir().iterdir()) == ["r_long.json"]


def test_a_worker_closing_a_dead_runs_record_writes_it_the_same_way() -> None:
    record = Progress("r_dead", {}, interval=0)
    record.update(turn=2, step="tool pay(" + "x" * 300 + ")", force=True)
    inode = os.stat(record.path).st_ino
    close_record("r_dead", "crashed", "the agent kept dying")
    assert os.stat(record.path).st_ino == inode
    shown = read_status("r_dead") or {}
    assert shown["status"] == "crashed" and shown["ended"] is True and shown["turn"] == 2


def test_two_writers_of_one_record_never_leave_it_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes may write one run's record (a launcher closing it as its program
    ends): each write is whole, under the file's lock. Here the second writes a longer
    record while the first is about to write: without the lock the first would pad its
    shorter record to the old length and leave the longer one's tail."""
    short, long = Progress("r_two", {}, interval=0), Progress("r_two", {}, interval=0)
    short.update(step="s", force=True)
    monkeypatch.setattr(progress, "_LOCK_WAIT", 30.0)
    real_pwrite = progress.os.pwrite
    done = threading.Event()
    threads: list[threading.Thread] = []

    def the_other_writes_first(fd: int, data: bytes, offset: int) -> int:
        if not threads and threading.current_thread() is threading.main_thread():
            other = threading.Thread(target=lambda: (
                long.update(step="l" * 300, force=True), done.set()))
            threads.append(other)
            other.start()
            done.wait(0.3)  # with the lock it waits for this write: the pause runs out
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(progress.os, "pwrite", the_other_writes_first)
    short.update(step="short", force=True)
    threads[0].join(30)
    assert done.is_set()
    shown = read_status("r_two")
    assert shown is not None and shown["step"] == "l" * 300  # written last, whole
    assert json.loads(raw("r_two"))["step"] == shown["step"]


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_lock_held_by_a_stuck_process_never_stops_the_run(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A process that holds a record's lock and never lets go (stopped; a forked child
    with an inherited descriptor) delays one write by the lock's wait, then none."""
    record = Progress("r_stuck", {}, interval=0)
    monkeypatch.setattr(progress, "_LOCK_WAIT", 0.2)
    with subprocess.Popen([sys.executable, "-c", HOLDER, str(record.path)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        waits: list[float] = []
        real_pause = progress._pause
        monkeypatch.setattr(progress, "_pause", lambda s: (waits.append(s), real_pause(s)))
        record.update(turn=1, step="tool pay", force=True)
        assert waits and sum(waits) <= 0.2 + 1e-9  # waited for the lock, then went on
        assert "locked by another process" in caplog.text
        waits.clear()
        record.update(turn=2, force=True)
        assert not waits  # not waited for again
        shown = read_status("r_stuck")  # a reader does not wait for it long either
        assert shown is not None and shown["turn"] == 2
        holder.communicate("")
    record.update(turn=3, force=True)  # the lock is free again: taken as usual
    assert record.path not in progress._STUCK
    assert (read_status("r_stuck") or {})["turn"] == 3


def test_what_is_not_a_regular_file_at_a_records_path_is_never_written_through(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    runs_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
    os.mkfifo(status_path("r_fifo"), 0o600)  # no reader: an open for writing would wait
    Progress("r_fifo", {}, interval=0).update(turn=1, force=True)
    assert read_status("r_fifo") is None
    assert "cannot write its status record" in caplog.text
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    status_path("r_link").symlink_to(target)
    Progress("r_link", {}, interval=0)
    assert target.read_text() == "{}" and read_status("r_link") is None
    status_path("r_open").write_text("{}")
    status_path("r_open").chmod(0o644)  # made by hand, readable by everyone
    Progress("r_open", {}, interval=0).update(turn=1, force=True)
    assert stat.S_IMODE(os.stat(status_path("r_open")).st_mode) == 0o600
    assert (read_status("r_open") or {})["turn"] == 1


def test_a_writer_that_waited_for_a_record_renamed_over_writes_the_new_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A record longer than a page is a new file renamed over the old: a writer that was
    waiting for the old file's lock meanwhile writes the new file, never the one gone."""
    record = Progress("r_moved", {}, interval=0)
    monkeypatch.setattr(progress, "_LOCK_WAIT", 30.0)
    waiting = threading.Event()
    real_pause = progress._pause
    monkeypatch.setattr(progress, "_pause", lambda s: (waiting.set(), real_pause(s)))
    fd = os.open(record.path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        writer = threading.Thread(target=lambda: record.update(turn=7, force=True))
        writer.start()
        assert waiting.wait(30)  # the writer waits for the lock of the file it opened
        moved = record.path.with_name("moved.tmp")
        moved.write_bytes(progress._sealed(json.dumps({"run_id": "r_moved", "turn": 6,
                                                        "step": "x" * 5000})))
        os.replace(moved, record.path)
    finally:
        os.close(fd)
    writer.join(30)
    assert (read_status("r_moved") or {})["turn"] == 7


@pytest.mark.filterwarnings("ignore:This process:DeprecationWarning")  # fork, threads
def test_a_process_forked_while_a_record_is_written_never_holds_its_lock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork (a multiprocessing worker, say) waits for a write under way: a child that
    lives on never holds the record's lock, and the run's next writes never wait."""
    record = Progress("r_fork", {}, interval=0)
    monkeypatch.setattr(progress, "_LOCK_WAIT", 5.0)
    inside, go = threading.Event(), threading.Event()
    real_pwrite = progress.os.pwrite

    def held_pwrite(fd: int, data: bytes, offset: int) -> int:
        if threading.current_thread() is not threading.main_thread() and not go.is_set():
            inside.set()
            go.wait(30)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(progress.os, "pwrite", held_pwrite)
    writer = threading.Thread(target=lambda: record.update(turn=1, force=True))
    writer.start()
    assert inside.wait(30)
    forked: list[int] = []

    def fork() -> None:
        pid = os.fork()
        if pid == 0:  # the child lives on, holding whatever descriptor it inherited
            time.sleep(60)
            os._exit(0)
        forked.append(pid)

    forker = threading.Thread(target=fork)
    forker.start()
    forker.join(0.3)
    assert not forked  # the fork waits for the write
    go.set()
    writer.join(30)
    forker.join(30)
    try:
        assert forked
        waits: list[float] = []
        monkeypatch.setattr(progress, "_pause", waits.append)
        record.update(turn=2, force=True)
        assert not waits and (read_status("r_fork") or {})["turn"] == 2
    finally:
        for pid in forked:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
