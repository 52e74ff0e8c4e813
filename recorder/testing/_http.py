"""The stub's HTTP server and the thread it serves in.

A test, or ``deja stub``, shares its process with the server: the server's threads start
with the process's signals blocked, so the kernel gives a SIGTERM or a Ctrl-C to a thread of
the test or of the command, whose handlers then run at once (Python runs them in the main
thread, and a main thread asleep wakes only for a signal delivered to it).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("recorder.testing.server")

# Signals a process is sent, rather than those a thread causes itself (a fault, a broken
# pipe, a file grown too large: blocked, they would become errors of that thread's calls).
# A wider set than deja's own threads block (recorder.background), which this package may
# not import: every signal the test or the command may handle.
PROCESS_SIGNALS = frozenset(signal.valid_signals()) - {
    signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE,
    signal.SIGILL, signal.SIGTRAP, signal.SIGSYS, signal.SIGABRT, signal.SIGPIPE,
    signal.SIGXFSZ}


class HttpServer(ThreadingHTTPServer):
    """A threading HTTP server that keeps its connections, to close them all at stop;
    ``stub`` is what its handlers answer from."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 stub: Any) -> None:
        self.stub = stub
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # pragma: no cover - not a TCP socket
            pass
        with self._conns_lock:
            self._conns.add(sock)
        return sock, addr

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
            self._conns.clear()
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:  # pragma: no cover
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("stub server: error while handling %s", client_address, exc_info=True)


def serve_in_thread(httpd: HttpServer, name: str) -> threading.Thread:
    """``httpd`` served in a daemon thread (and its request threads), started with
    :data:`PROCESS_SIGNALS` blocked from its first instruction: it inherits the mask of
    the thread that starts it, here for the moment of the start. A thread that cannot
    start closes the server's socket; so does a signal handler that raises as the mask is
    restored (the server is stopped first)."""
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              name=name, daemon=True)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, PROCESS_SIGNALS)
    try:
        thread.start()
    except BaseException:
        httpd.server_close()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        raise
    try:  # a signal that came meanwhile runs its handler here
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    except BaseException:
        httpd.shutdown()
        httpd.server_close()
        raise
    return thread
