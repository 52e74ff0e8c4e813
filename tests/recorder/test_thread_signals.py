"""deja's own threads in a process it shares (a test's, `deja stub`'s, a worker's) start with
the process's signals blocked, so the kernel gives a SIGTERM or a Ctrl-C to a thread of the
program, whose handlers run at once; and a stub server that could not start its thread
leaves nothing bound and nothing to stop."""

from __future__ import annotations

import os
import signal
import threading
import types
from typing import Any

import pytest

from deja.runs.output import StderrTail
from recorder.testing import _http
from recorder.testing.server import StubServer
from tests.recorder.test_background import blocked_signals

SCRIPT = {"default": {"text": "ok"}}
STOP = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM, signal.SIGCHLD)


def mask_of(tid: int) -> int:
    return blocked_signals(os.getpid(), tid)


def blocks_all(tid: int) -> bool:
    return all(mask_of(tid) & 1 << (signum - 1) for signum in STOP)


def test_the_stub_servers_thread_blocks_them() -> None:
    before = mask_of(threading.get_native_id())
    with StubServer(SCRIPT) as stub:
        thread = next(t for t in threading.enumerate() if t.name == f"deja-stub-{stub.port}")
        assert thread.native_id is not None and blocks_all(thread.native_id)
        assert mask_of(threading.get_native_id()) == before  # the caller's, as it was


def test_the_worker_s_stderr_copier_blocks_them() -> None:
    before = mask_of(threading.get_native_id())
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
    assert mask_of(threading.get_native_id()) == before


class _CannotStart(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def test_a_stub_server_whose_thread_cannot_start_leaves_nothing_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []

    class Recorded(_http.HttpServer):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    # the server module's view of threading only: the rest of the process keeps its own
    monkeypatch.setattr(_http, "threading", types.SimpleNamespace(
        **{**vars(threading), "Thread": _CannotStart}))
    monkeypatch.setattr("recorder.testing.server.HttpServer", Recorded)
    stub = StubServer(SCRIPT)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with pytest.raises(RuntimeError, match="can't start new thread"):
        stub.start()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
    assert len(made) == 1 and made[0].socket.fileno() == -1  # its socket closed
    stub.stop()  # nothing to stop: it returns at once
