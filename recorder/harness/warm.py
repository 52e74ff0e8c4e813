"""Warm starts: a Python program run in a fork of a process that has imported its libraries.

A fresh interpreter that replays one recorded incident spends most of its life importing
(the Anthropic SDK alone takes over a second on a small machine); a suite of a hundred
incidents pays it a hundred times. A *warm* process (a fork server, see
:mod:`recorder.harness.warm_pool`) has imported deja and the SDKs its incidents recorded
once; each program it runs is a fork of it that becomes the program as a fresh
interpreter would start it:

- its arguments, environment, working directory and standard streams are the ones asked
  for; ``sys.path`` is rebuilt as Python builds it (the script's folder, or the working
  directory for ``-m``, then ``PYTHONPATH``, then the interpreter's own);
- signal handlers are Python's defaults (the signal mask is inherited, as across
  ``exec``), the fork server's wake-up descriptor is dropped, and ``sitecustomize`` runs
  again from the new path (deja's bootstrap starts the session there, as it does in a
  fresh interpreter);
- it ends as an interpreter ends: a ``SystemExit``'s status, an uncaught exception through
  ``sys.excepthook`` and status 1, a ``KeyboardInterrupt`` as death by SIGINT; then its
  non-daemon threads are waited for, its ``atexit`` functions run, its streams are
  flushed, and the fork ends with ``os._exit`` (it never returns into its parent's code).

What a fork cannot give: interpreter options (``-X``, ``-W``, ``-I`` ...; such commands
start cold, see :func:`forkable`), and a first import of the preloaded modules (their
import-time state is the fork server's; a program that sets an environment variable an
SDK reads while it is imported sees the SDK as already imported).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from recorder.harness.child import preexec

__all__ = ["Forked", "active", "fork_program", "forkable", "mark_warm", "python_command"]

_warm = False  # this process is a fork server or one of its forks: it may fork programs
_base_path: list[str] = []  # the interpreter's own sys.path (no script folder, no PYTHONPATH)
_close_in_child: set[int] = set()  # the fork server's own descriptors


def preload(modules: Sequence[str]) -> None:
    """Import ``modules`` (those that cannot be imported are left out), for the programs
    this process will fork to find imported."""
    for name in modules:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def mark_warm(server_fds: Sequence[int] = ()) -> None:
    """This process has imported what its programs need: :func:`fork_program` may be used
    here and in its forks. ``server_fds`` are descriptors a fork must not keep."""
    global _warm, _base_path
    _warm = True
    own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _base_path = [p for p in sys.path[1:] if p and os.path.abspath(p) not in own]
    _close_in_child.update(server_fds)


def active() -> bool:
    """Whether this process is warm (see :func:`mark_warm`)."""
    return _warm


def python_command(argv: Sequence[str]) -> bool:
    """``argv`` runs this interpreter on a script or a module, without interpreter
    options: what a fork of a warm process can start as ``argv`` would."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] == "-m":
        return len(argv) > 2 and not argv[2].startswith("-")
    return not argv[1].startswith("-")


def forkable(argv: Sequence[str]) -> bool:
    """This process is warm and ``argv`` is a :func:`python_command`."""
    return _warm and python_command(argv)


def fork_program(argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None = None,
                 fds: Mapping[int, int] | None = None, keep: Sequence[int] = (),
                 close: Sequence[int] = ()) -> int:
    """Fork, and in the child become ``argv`` (see :func:`forkable`) with ``env`` and
    ``cwd``; ``fds`` maps the child's standard descriptors (0, 1, 2) to ours, ``keep``
    are other descriptors it must have (a writer lock), ``close`` ones it must not. The
    child dies with us (a
    parent-death signal). Returns the child's pid; the child never returns."""
    pid = os.fork()
    if pid:
        return pid
    try:  # from here on, this is the child: whatever happens, it ends in os._exit
        die = preexec()
        if die is not None:
            die()
        _close_in_child.update(close)
        _become(argv, env=env, cwd=cwd, fds=fds or {}, keep=keep)
    except BaseException:  # noqa: BLE001 - a child that cannot start says why and ends
        with contextlib.suppress(Exception):
            traceback.print_exc()
            sys.stderr.flush()
        os._exit(1)
    _run_as_main(argv)


def _become(argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None,
            fds: Mapping[int, int], keep: Sequence[int]) -> None:
    """The process state a fresh ``argv`` would start with."""
    for fd in _close_in_child - set(keep) - set(fds.values()):
        with contextlib.suppress(OSError):
            os.close(fd)
    _close_in_child.clear()
    for target, source in fds.items():
        if source != target:
            os.dup2(source, target)
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start-up
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    atexit._clear()  # the parent's exit functions are not this program's
    if argv[1] == "-m":
        first, sys.argv = os.getcwd(), [argv[2], *argv[3:]]
    else:
        first, sys.argv = os.path.dirname(os.path.realpath(argv[1])), list(argv[1:])
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_base_path]
    sys.path_importer_cache.clear()
    _site_customize()


def _site_customize() -> None:
    """What ``site`` does at start-up with ``sitecustomize``: import it from the path (a
    new one: deja's bootstrap, when the program is launched by deja)."""
    sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":
            traceback.print_exc()
    except Exception:  # noqa: BLE001 - as site does: said, and the program still runs
        sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n")
        traceback.print_exc()


def _run_as_main(argv: Sequence[str]) -> NoReturn:
    """Run the program as ``__main__`` and end this process as the interpreter would."""
    run: Callable[[], object]
    if argv[1] == "-m":
        run = lambda: runpy.run_module(argv[2], run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        run = lambda: runpy.run_path(argv[1], run_name="__main__")  # noqa: E731
    code, killed = 0, None
    try:
        run()
    except SystemExit as exc:
        code = _exit_status(exc)
    except KeyboardInterrupt as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code, killed = 130, signal.SIGINT
    except BaseException as exc:  # noqa: BLE001 - the program's own: said as Python says it
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    _finalise()
    if killed is not None:  # as Python ends on an uncaught KeyboardInterrupt
        signal.signal(killed, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (killed,))
        os.kill(os.getpid(), killed)
    os._exit(code)


def _exit_status(exc: SystemExit) -> int:
    """The status ``SystemExit`` ends an interpreter with."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    with contextlib.suppress(Exception):
        sys.stderr.write(f"{exc.code}\n")
    return 1


def _finalise() -> None:
    """An interpreter's end: its threads waited for, ``atexit``, its streams flushed."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


class Forked:
    """A program started by :func:`fork_program`, as ``subprocess.Popen`` shows a child:
    ``pid``, ``wait``, ``poll``, ``send_signal`` and ``returncode`` (-N: killed by N)."""

    def __init__(self, argv: Sequence[str], **how: Any) -> None:
        self.args = list(argv)
        self.returncode: int | None = None
        self.pid = fork_program(argv, **how)

    def _reaped(self, flags: int) -> int | None:
        pid, status = os.waitpid(self.pid, flags)
        if pid == 0:
            return None
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            self._reaped(0)
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode if self.returncode is not None else self._reaped(os.WNOHANG)

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)
