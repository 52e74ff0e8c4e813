"""The launcher and a program that is not Python (no bootstrap holds its signals): a Ctrl-C
that lands between the program's start and the launcher's forwarding is passed on to the
program, and the program starts with the stop signals it would have without deja."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from deja import launcher
from deja.boot import child_env

STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def test_a_ctrl_c_right_after_the_start_reaches_a_program_that_is_not_python(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the forwarding, the launcher's own Ctrl-C handling (KeyboardInterrupt) would
    stop the launcher alone; the program ends by the signal instead, at once (with SIGINT
    blocked in it, it would sleep its 20 s and end with status 0)."""
    start = launcher._start
    started: list[Any] = []

    def start_then_interrupted(*args: Any, **kwargs: Any) -> Any:
        child = start(*args, **kwargs)
        started.append(child)
        # to this thread (the process's would go to any thread not blocking it): it stays
        # pending here until the forwarding lets it in
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        return child

    monkeypatch.setattr(launcher, "_start", start_then_interrupted)
    argv = ["sleep", "20"]
    env = child_env("record", cassette=str(tmp_path / "r.jsonl"), run_id="r_sig00001",
                    argv=argv)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            done = launcher.run(argv, env=env)
        except KeyboardInterrupt:
            pytest.fail("the Ctrl-C stopped the launcher and not its program")
    finally:
        signal.signal(signal.SIGINT, previous)
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert (done.code, done.received) == (128 + signal.SIGINT, signal.SIGINT)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before  # the launcher's own


def test_a_ctrl_c_that_reaches_the_child_before_its_exec_ends_it_as_it_would_the_program(
) -> None:
    """A terminal's Ctrl-C goes to the child too, which may still be running Python between
    its fork and its exec, with the launcher's handlers and SIGINT held: let in, it must
    end the child as the signal would, not raise KeyboardInterrupt inside ``Popen``."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, launcher.FORWARDED)
    try:
        pid = os.fork()
        if pid == 0:  # the child, as between Popen's fork and its exec
            try:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                os.kill(os.getpid(), signal.SIGINT)  # held: pending
                start = launcher._child_start(held)
                assert start is not None
                start()
            except BaseException:  # noqa: BLE001 - said by the status
                os._exit(3)
            os._exit(0)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT, status


def test_a_program_that_is_not_python_starts_with_the_stop_signals_let_in(
        tmp_path: Path) -> None:
    argv = ["grep", "^SigBlk", "/proc/self/status"]
    env = child_env("record", cassette=str(tmp_path / "r.jsonl"), run_id="r_sig00004",
                    argv=argv)
    out = tmp_path / "out.txt"
    with out.open("wb") as sink:
        assert launcher.run(argv, env=env, stdout=sink.fileno()).status == 0
    name, mask = out.read_text().split()
    assert name == "SigBlk:"
    assert [s for s in STOP if int(mask, 16) & (1 << (s - 1))] == []


def test_the_launchers_mask_is_as_it_was_after_a_program_that_cannot_start(
        tmp_path: Path) -> None:
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    argv = [str(tmp_path / "no-such-program")]
    env = child_env("record", cassette=str(tmp_path / "r.jsonl"), run_id="r_sig00002",
                    argv=argv)
    with pytest.raises(FileNotFoundError):
        launcher.run(argv, env=env)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def test_the_launchers_mask_is_as_it_was_after_its_program_ends(tmp_path: Path) -> None:
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    argv = ["sh", "-c", "exit 4"]
    env = child_env("record", cassette=str(tmp_path / "r.jsonl"), run_id="r_sig00003",
                    argv=argv)
    assert launcher.run(argv, env=env).status == 4
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
