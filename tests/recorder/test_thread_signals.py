"""deja's own threads in a process it shares (a test's, `deja stub`'s, a worker's) start with
the process's signals blocked, so the kernel gives a SIGTERM or a Ctrl-C to a thread of the
program, whose handlers run at once; and a stub server that could not start its thread
leaves nothing bound and stops at once."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest

from deja.runs.output import StderrTail
from recorder.testing import server as stub_server
from recorder.testing.server import StubServer
from tests.recorder.test_background import blocked_signals

SCRIPT = {"default": {"text": "ok"}}
STOP = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM, signal.SIGCHLD)


def blocks_all(tid: int) -> bool:
    mask = blocked_signals(os.getpid(), tid)
    return all(mask & 1 << (signum - 1) for signum in STOP)


def test_the_stub_servers_thread_blocks_them_from_its_first_instruction() -> None:
    with StubServer(SCRIPT) as stub:
        thread = next(t for t in threading.enumerate() if t.name == f"deja-stub-{stub.port}")
        assert thread.native_id is not None and blocks_all(thread.native_id)
    assert not blocks_all(threading.get_native_id())  # the caller's mask, as it was


def test_the_worker_s_stderr_copier_blocks_them() -> None:
    read, write = os.pipe()
    tail = StderrTail(os.fdopen(read, "rb"))  # it closes the stream once it has ended
    try:
        tid = tail._thread.native_id
        blocked = tid is not None and blocks_all(tid)
    finally:
        os.write(write, b"the last line\n")
        os.close(write)
    assert tail.text() == "the last line\n"
    assert blocked
    assert not blocks_all(threading.get_native_id())


class _CannotStart(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def test_a_stub_server_whose_thread_cannot_start_leaves_its_port_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(stub_server.threading, "Thread", _CannotStart)
    stub = StubServer(SCRIPT, port=port)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with pytest.raises(RuntimeError, match="can't start new thread"):
        stub.start()
    monkeypatch.undo()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
    stopped = threading.Event()  # nothing to stop: it returns (no loop to wait for)
    threading.Thread(target=lambda: (stub.stop(), stopped.set()), daemon=True).start()
    assert stopped.wait(10), "stop() waited for a loop that never ran"
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # not left bound
