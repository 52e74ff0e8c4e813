"""Waiting for a child process (recorder.harness.child.wait): a signal to the waiting
process is acted on at once, even one whose handler the interpreter had not run yet when
the wait started."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from recorder.harness.child import wait


def waiting(tid: int) -> bool:
    """Whether thread ``tid`` of this process sleeps in the kernel, and not for a lock
    (a futex: the interpreter's own lock, taken between bytecodes)."""
    task = Path(f"/proc/self/task/{tid}")
    asleep = (task / "stat").read_text().rsplit(") ", 1)[1][:1] == "S"
    return asleep and "futex" not in (task / "wchan").read_text()


def test_a_signal_that_is_pending_when_the_wait_starts_stops_it_at_once() -> None:
    """The signal lands in another thread while this one waits: its handler is pending
    (Python runs handlers in the main thread, between bytecodes) and nothing wakes a
    plain ``waitpid``; it would run when the child ends by itself, 60 s later."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    handled: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        handled.append(signum)
        child.kill()

    main = threading.get_native_id()

    def land_in_this_thread() -> None:
        deadline = time.monotonic() + 30
        while not waiting(main) and time.monotonic() < deadline:  # the wait has begun
            time.sleep(0.01)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, handler)
    other = threading.Thread(target=land_in_this_thread)
    try:
        other.start()
        code = wait(child)
    finally:
        other.join()
        signal.signal(signal.SIGUSR1, previous)
        child.kill()
        child.wait()
    assert handled == [signal.SIGUSR1]
    assert code == -signal.SIGKILL  # stopped by the handler, not ended by itself


def test_a_child_that_ends_is_waited_for_and_the_wakeup_descriptor_is_given_back() -> None:
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    assert wait(child) == 7 and child.returncode == 7
    assert signal.set_wakeup_fd(before) == before


def test_a_launcher_with_many_descriptors_open_waits_all_the_same() -> None:
    """The pidfd may be numbered past 1023, which ``select`` refuses."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    held: list[int] = []
    try:
        while len(held) < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        assert wait(child) == 3
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
