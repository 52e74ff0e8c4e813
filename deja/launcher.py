"""Running a recorded program as a child: signals, its lifetime, its exit status.

``deja record``, ``fork``, ``resume`` and ``replay`` start the program as a child process
and wait for it. What a user expects of such a launcher (as of ``uv run`` or ``poetry
run``):

- **The child dies with the launcher.** On Linux the child is started with a parent-death
  signal (SIGTERM): if the launcher is killed, even with SIGKILL, the program is stopped
  rather than left running, unrecorded, paying invoices nobody sees.
- **Signals are passed on.** SIGTERM, SIGINT and SIGHUP sent to the launcher are sent to
  the child, which ends its run ``interrupted`` with an end line (see ``deja.boot``); the
  launcher waits for it and exits 128 + the signal's number, as a shell reports a
  process killed by that signal. A child killed by a signal gives the same status. A
  signal that lands just before the wait starts is passed on at once too
  (:func:`recorder.harness.child.wait`).
- **The writer lock travels with the program.** The cassette's writer lock, taken by the
  launcher before anything is read or written, is inherited by the child (the launch
  spec's ``lock_fd``), so it is held while either of them lives. The child is told the
  cassette's absolute path: it may run in another directory (the recorded one, or
  ``--cwd``), where a relative path would name another file and its lock.
- **No signal lands while the interpreter starts.** A Python program is started with
  SIGTERM, SIGINT and SIGHUP blocked (the spec's ``signals_held``; the launcher blocks them in
  itself around the start, so the child has them blocked from its first instruction, and
  takes its own in once it forwards them); deja's bootstrap unblocks them once its handler
  is in place, and a signal that came meanwhile ends the run ``interrupted`` as soon as it
  has started. Unblocked, a Ctrl-C during Python's start-up is a "Fatal Python error" and
  a run left without its end line. Other programs (and ``python -I``, ``-E`` or ``-S``,
  which skip the bootstrap) start with the signal mask the launcher had: the launcher
  blocks the three in itself around their start all the same, and the child lets them in
  before it becomes the program, so a signal that lands between the start and the
  forwarding is passed on once the forwarding is in place (a Ctrl-C would otherwise stop
  the launcher with a traceback, and the program by its parent-death signal, with neither
  an ``interrupted`` run nor the status 128 + N). This holds as long as the launcher's
  other threads block them too, as deja's own do.

The launcher tells the child all of this in the one launch spec it is started with
(``DEJA_LAUNCH``, a :class:`recorder.launch.LaunchSpec`): the session that
:func:`deja.boot.child_env` put there, with the launcher's own part added.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from deja.boot import LAUNCH_ENV
from recorder.cassette.lock import WriterLock
from recorder.harness import warm
from recorder.harness.child import preexec
from recorder.harness.child import wait as child_wait
from recorder.harness.warm import Forked
from recorder.launch import LaunchSpec

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True)
class Exit:
    """How the child ended: its status as a shell reports it, and the signal the
    launcher received while waiting, if any."""

    code: int
    received: int | None = None

    @property
    def status(self) -> int:
        """What the launcher exits with."""
        return 128 + self.received if self.received is not None else self.code


def boots(argv: list[str]) -> bool:
    """``argv`` runs this interpreter in a way that imports deja's bootstrap (which lets
    blocked signals in): not ``-I``, ``-E`` or ``-S``, which skip ``PYTHONPATH`` or
    ``site``."""
    if not argv or argv[0] != sys.executable:
        return False
    args = iter(argv[1:])
    for arg in args:
        if arg in ("-c", "-m", "-", "--") or not arg.startswith("-"):
            return True  # the program starts here: the rest are its own arguments
        if arg.startswith("--"):
            continue
        if arg in ("-X", "-W"):
            next(args, None)
            continue
        if arg.startswith(("-X", "-W")):
            continue
        if any(flag in arg for flag in "IES"):
            return False
        if "c" in arg or "m" in arg:  # e.g. -uc CODE: the program starts here too
            return True
    return True


def shell_status(returncode: int) -> int:
    """``subprocess``'s -N for a child killed by signal N becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


@contextlib.contextmanager
def _forwarding(child: subprocess.Popen[bytes] | Forked, received: list[int],
                mask: Iterable[int]) -> Iterator[None]:
    """Our signals passed on to ``child`` while it runs; ``mask``, the signal mask to go
    back to once the handlers are in place (what was blocked while the child started),
    and in any case on the way out."""
    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {}
    try:
        for signum in FORWARDED:
            with contextlib.suppress(ValueError, OSError):  # not the main thread: no handlers
                previous[signum] = signal.signal(signum, forward)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one that came meanwhile: forwarded
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _start(argv: list[str], *, env: dict[str, str], cwd: Path | None,
           pass_fds: tuple[int, ...], stdout: int | None,
           mask: Iterable[int] | None) -> subprocess.Popen[bytes] | Forked:
    """The program started: a fresh interpreter, or (in a warm process, for a plain
    ``python script`` or ``python -m module``) a fork of this one that becomes the program
    with the SDKs already imported (:mod:`recorder.harness.warm`). ``mask``: the signal
    mask a fresh program starts with (None: the one it inherits, stop signals blocked)."""
    if warm.forkable(argv):  # a Python program that boots: it lets them in itself
        assert mask is None, "a warm fork boots: it starts with the stop signals blocked"
        return Forked(argv, env=env, cwd=str(cwd) if cwd is not None else None,
                      fds={1: stdout} if stdout is not None else {}, keep=pass_fds)
    return subprocess.Popen(argv, env=env, cwd=cwd, pass_fds=pass_fds, stdout=stdout,
                            preexec_fn=_child_start(mask))


def _child_start(mask: Iterable[int] | None) -> Callable[[], None] | None:
    """What a fresh child runs between its fork and its exec: the parent-death signal
    (:func:`recorder.harness.child.preexec`) and, with ``mask``, that signal mask. A stop
    signal that reached the child meanwhile (a terminal's Ctrl-C goes to the launcher and
    to it) then does what it would do to the program: our Python handlers, which its exec
    would reset, are reset first, so it ends the child rather than raise in it."""
    die = preexec()
    if mask is None:
        return die
    unblocked = frozenset(mask)

    def start() -> None:
        if die is not None:
            die()
        for signum in FORWARDED:
            if callable(signal.getsignal(signum)):
                signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)

    return start


def run(argv: list[str], *, env: dict[str, str], cwd: Path | None = None,
        lock: WriterLock | None = None, stdout: int | None = None) -> Exit:
    """Run ``argv`` until it ends; pass it our signals; it dies if we die; it inherits
    ``lock``; its standard output goes to ``stdout`` (a file descriptor; default ours).
    ``env`` holds the child's launch spec (:func:`deja.boot.child_env`), to which the
    launcher adds its pid, the lock's descriptor and whether the stop signals are held.
    ``FileNotFoundError`` (and other ``OSError``) propagate when it cannot start.
    """
    env = dict(env)
    held = boots(argv)
    spec = dataclasses.replace(
        LaunchSpec.decode(env[LAUNCH_ENV]), launcher_pid=os.getpid(), signals_held=held,
        lock_fd=lock.fd if lock is not None else None,
        lock_cassette=str(Path(lock.cassette).resolve()) if lock is not None else None)
    env[LAUNCH_ENV] = spec.encode()
    pass_fds = (lock.fd,) if lock is not None else ()
    # Blocked here until the forwarding is in place; a program that boots starts with them
    # blocked too (see above), any other with our mask as it was.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    received: list[int] = []
    try:
        child = _start(argv, env=env, cwd=cwd, pass_fds=pass_fds, stdout=stdout,
                       mask=None if held else mask)
        with _forwarding(child, received, mask):
            if lock is not None:
                lock.note(child=child.pid)
            code = child_wait(child)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return Exit(shell_status(code), received[0] if received else None)
