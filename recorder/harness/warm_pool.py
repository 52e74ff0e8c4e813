"""A fork server: one warm process that starts Python commands as forks of itself.

:class:`WarmPool` starts the server (this interpreter, ``preload`` imported, marked warm by
:func:`recorder.harness.warm.mark_warm`) and hands out :class:`WarmChild` processes that
look to their caller like ``subprocess.Popen`` objects: a pid, ``poll``, ``wait``,
``send_signal``, and their standard output read to its end by ``communicate``. A caller's
thread each may start one at a time; the server itself stays single-threaded (it only
forks from its main thread), which is what makes forking it safe.

The protocol, over a Unix socket in a private folder: the caller connects and sends one
request (a 4-byte length, then JSON: ``argv``, ``cwd``, ``env``) with its three standard
descriptors attached (``SCM_RIGHTS``); the server forks (see
:func:`recorder.harness.warm.fork_program`), answers ``{"pid": N}`` and, when the child
has ended, ``{"exit": STATUS}`` (``subprocess``'s convention: -N for a signal). A caller
that goes away before its child ended gets it stopped (SIGTERM); a server whose parent
dies gets SIGTERM (a parent-death signal) and its forks in turn.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from recorder.harness import warm
from recorder.harness.child import preexec

__all__ = ["WarmChild", "WarmPool", "serve"]

_LENGTH = struct.Struct("!I")
_READY = b"ready\n"


class WarmPool:
    """A fork server for commands run by this interpreter, ``preload`` imported once
    (modules that cannot be imported are left out). Use as a context manager, or call
    :meth:`close`; :meth:`start` returns None when ``argv`` cannot be forked (another
    program, interpreter options), for the caller to start it cold."""

    def __init__(self, preload: Sequence[str], *, timeout: float = 120.0) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="deja-warm-")
        self.path = str(Path(self._folder.name) / "fork.sock")
        self._closed = threading.Event()
        self._server = self._spawn(preload)
        assert self._server.stdout is not None
        if not _ready(self._server.stdout, timeout):
            self.close()
            raise RuntimeError("the fork server did not start")

    def _spawn(self, preload: Sequence[str]) -> subprocess.Popen[bytes]:
        """The server, started from a thread of its own that lives until :meth:`close`:
        a parent-death signal fires when the *thread* that started a child ends, and a
        caller's thread (a worker's step) may end long before the pool does."""
        code = "from recorder.harness.warm_pool import serve; serve()"
        started: list[subprocess.Popen[bytes] | BaseException] = []
        ready = threading.Event()

        def keep() -> None:
            try:
                started.append(subprocess.Popen(
                    [sys.executable, "-c", code, self.path, *preload],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, preexec_fn=preexec()))
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                started.append(exc)
            finally:
                ready.set()
            self._closed.wait()

        threading.Thread(target=keep, name="deja-warm-server", daemon=True).start()
        ready.wait()
        if isinstance(started[0], BaseException):
            self._folder.cleanup()
            raise started[0]
        return started[0]

    def start(self, argv: Sequence[str], *, cwd: str, stderr: int | IO[bytes],
              env: dict[str, str] | None = None) -> WarmChild | None:
        """``argv`` started as a fork of the server (its standard output a pipe, read by
        :meth:`WarmChild.communicate`), or None if it cannot be."""
        if not warm.python_command(argv):
            return None
        return WarmChild(self.path, argv, cwd=cwd,
                         stderr=stderr if isinstance(stderr, int) else stderr.fileno(),
                         env=dict(os.environ) if env is None else env)

    def close(self) -> None:
        if self._server.poll() is None:
            self._server.terminate()
            try:
                self._server.wait(30)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        if self._server.stdout is not None:
            self._server.stdout.close()
        self._closed.set()
        self._folder.cleanup()

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ready(out: IO[bytes], timeout: float) -> bool:
    selector = selectors.DefaultSelector()
    selector.register(out, selectors.EVENT_READ)
    try:
        return bool(selector.select(timeout)) and out.readline() == _READY
    finally:
        selector.close()


class WarmChild:
    """One command run as a fork of the server, as ``subprocess.Popen`` would show it."""

    def __init__(self, path: str, argv: Sequence[str], *, cwd: str, stderr: int,
                 env: dict[str, str]) -> None:
        self.args = list(argv)
        self.returncode: int | None = None
        self._reading = threading.Lock()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buffer = b""
        request = json.dumps({"argv": self.args, "cwd": cwd, "env": env}).encode()
        read, write = os.pipe()
        try:
            self._conn.connect(path)
            with open(os.devnull, "rb") as null:
                socket.send_fds(self._conn, [_LENGTH.pack(len(request)) + request],
                                [null.fileno(), write, stderr])
        except BaseException:
            os.close(read)
            self._conn.close()
            raise
        finally:
            os.close(write)
        self.stdout = os.fdopen(read, "rb")
        answer = self._message(None)
        if "pid" not in answer:
            self.stdout.close()
            raise OSError(f"the fork server could not start {self.args[1]!r}: "
                          f"{answer.get('error')}")
        self.pid = int(answer["pid"])

    def communicate(self) -> tuple[bytes, None]:
        """Its standard output, read to the end, once it has ended."""
        with self.stdout:
            out = self.stdout.read()
        self.wait()
        return out, None

    def _message(self, timeout: float | None) -> dict[str, Any]:
        """The server's next message (TimeoutError when none came within ``timeout``,
        ConnectionError if the server went away). The socket is only ever read with
        :attr:`_reading` held, and its own timeout is never changed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                raise TimeoutError
            chunk = self._conn.recv(4096)
            if not chunk:
                raise ConnectionError("the fork server went away")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        found: dict[str, Any] = json.loads(line)
        return found

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status, once it has ended (``subprocess.TimeoutExpired`` after
        ``timeout``). Safe from several threads at once (a worker polls its children
        while each job's thread waits for its own)."""
        if not self._reading.acquire(timeout=-1 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        try:
            if self.returncode is None:
                try:
                    self.returncode = int(self._message(timeout)["exit"])
                except TimeoutError:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
                except (ConnectionError, OSError, ValueError, KeyError):
                    self.returncode = -int(signal.SIGKILL)  # the server died: so did its forks
                self._conn.close()
            return self.returncode
        finally:
            self._reading.release()

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0)
        return None

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# --------------------------------------------------------------------------- the server

def serve() -> None:
    """The fork server's main: ``sys.argv`` is [-c, SOCKET, MODULE...]."""
    path, preload = sys.argv[1], sys.argv[2:]
    # Ctrl-C in the caller's terminal reaches the whole group: the forks running then stop
    # on it (each takes Python's handler back), the server goes with its caller.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warm.preload(preload)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    warm.mark_warm((listener.fileno(), wake_r, wake_w))
    sys.stdout.buffer.write(_READY)
    sys.stdout.flush()
    _Server(listener, wake_r).loop()


class _Server:
    def __init__(self, listener: socket.socket, wake: int) -> None:
        self._listener = listener
        self._wake = wake
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(wake, selectors.EVENT_READ, "reap")
        self._children: dict[int, socket.socket] = {}  # pid: the caller's connection
        self._callers: dict[socket.socket, int] = {}  # connection: its child's pid

    def loop(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.data == "accept":
                    conn, _ = self._listener.accept()
                    self._selector.register(conn, selectors.EVENT_READ, "request")
                elif key.data == "reap":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake, 4096)
                    self._reap()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _read(self, conn: socket.socket) -> None:
        """A caller's request, or its going away."""
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        except OSError:
            data, fds = b"", []
        if not data or conn in self._callers:  # gone (or talking out of turn): its child stops
            self._drop(conn)
            for fd in fds:
                os.close(fd)
            return
        try:
            request = self._request(conn, data)
            fd_map = dict(zip((0, 1, 2), fds, strict=True))
            pid = warm.fork_program(request["argv"], env=request["env"], cwd=request["cwd"],
                                    fds=fd_map, close=[c.fileno() for c in self._callers])
        except Exception as exc:  # noqa: BLE001 - the caller is told; the server goes on
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": str(exc)}).encode() + b"\n")
            self._drop(conn)
            return
        finally:
            for fd in fds:
                os.close(fd)
        self._children[pid] = conn
        self._callers[conn] = pid
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")

    @staticmethod
    def _request(conn: socket.socket, data: bytes) -> dict[str, Any]:
        while len(data) < _LENGTH.size:
            data += conn.recv(_LENGTH.size - len(data))
        (size,) = _LENGTH.unpack(data[:_LENGTH.size])
        body = data[_LENGTH.size:]
        conn.settimeout(30)
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ConnectionError("the request was cut short")
            body += chunk
        conn.settimeout(None)
        request: dict[str, Any] = json.loads(body)
        return request

    def _drop(self, conn: socket.socket) -> None:
        """A caller gone: its running child is stopped (and reaped later)."""
        pid = self._callers.pop(conn, None)
        if pid is not None and pid in self._children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        self._selector.unregister(conn)
        conn.close()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self._children.pop(pid, None)
            if conn is None:
                continue
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
            if self._callers.get(conn) == pid:
                del self._callers[conn]
                self._selector.unregister(conn)
                conn.close()

