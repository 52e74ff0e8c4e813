"""A run's status record on disk: written over in place, sealed, and never read torn."""

from __future__ import annotations

import json
import os
import stat
import threading

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

    monkeypatch.setattr(progress.time, "sleep", writer_finishes)
    shown = read_status("r_caught")
    assert shown is not None and shown["turn"] == 4 and len(waits) == 1


def test_readers_never_see_a_record_half_written() -> None:
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
    record just after the first has read the file's length: without the lock the first
    would pad its shorter record to the old length and leave the longer one's tail."""
    short, long = Progress("r_two", {}, interval=0), Progress("r_two", {}, interval=0)
    short.update(step="s", force=True)
    real_fstat = progress.os.fstat
    done = threading.Event()

    def fstat_then_the_other_writes(fd: int) -> os.stat_result:
        result = real_fstat(fd)
        if not done.is_set() and threading.current_thread() is threading.main_thread():
            other = threading.Thread(target=lambda: (
                long.update(step="l" * 300, force=True), done.set()))
            other.start()
            done.wait(0.5)  # with the lock it waits for this write: the pause runs out
            monkeypatch.setattr(progress.os, "fstat", real_fstat)
            threads.append(other)
        return result

    threads: list[threading.Thread] = []
    monkeypatch.setattr(progress.os, "fstat", fstat_then_the_other_writes)
    short.update(step="short", force=True)
    for t in threads:
        t.join()
    shown = read_status("r_two")
    assert shown is not None and shown["step"] in ("short", "l" * 300)
    assert json.loads(raw("r_two"))["step"] == shown["step"]
