"""The recorder's deferred writes: one thread per process does them all.

Two writes are kept off the agent's calls: a cassette's group commit (its model and
HTTP lines forced to disk within about 10 ms, :mod:`recorder.cassette.writer`) and a
run's status record (its latest state written at most every 0.2 s,
:mod:`recorder.harness.progress`). One daemon thread does both, for every open run of the
process. Starting a run starts no thread: the recording proxy opens a run per
conversation, and a thread start holds its event loop until the new thread has run; a
proxy holding hundreds of runs open keeps one thread, not two per run competing for the
interpreter.

A chore is a callable filed under a key (the object it works for). :meth:`Chores.soon`
asks for it to run once, at a given time or later; asking again while it waits changes
nothing, and asking while it runs files it again (the new state is written by the next
run). :meth:`Chores.forget` drops a key's chore and returns once no run of it is in
progress, so that its owner may close the file it works on. A chore handles its own
errors; one it lets through is logged, and the thread goes on.

The thread blocks the signals sent to a whole process (:func:`start_quiet`): Python
runs a signal's handler in the main thread only, and a main thread waiting in a system
call (the agent's ``time.sleep``, a socket read) wakes for a signal the kernel delivered
to it, not for one it delivered to this thread, which it may when this thread does not
block it: a ``SIGTERM`` would then wait for the main thread's sleep to end. A chore
never starts a process (a child would inherit the blocked signals).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Hashable

log = logging.getLogger("deja.recorder")

# Sent to a process as a whole: by kill, a terminal, a timer, a child's end.
PROCESS_SIGNALS = frozenset({
    signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM,
    signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGWINCH})


def start_quiet(thread: threading.Thread) -> None:
    """Start ``thread``, one of deja's own that never starts a process, with
    :data:`PROCESS_SIGNALS` blocked from its first instruction (it inherits the mask of
    the thread that starts it, here for the moment of the start): the kernel delivers
    them to a thread of the program instead, whose handlers then run at once."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, PROCESS_SIGNALS)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Chores:
    """Runs deferred chores in order of their due time, on one daemon thread."""

    def __init__(self, name: str = "deja-background") -> None:
        self.name = name
        self._reset()

    def _reset(self) -> None:
        """A fresh state (and in a forked child: the parent's thread and chores are not
        the child's)."""
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Hashable]] = []
        self._queued: dict[Hashable, tuple[int, Callable[[], None]]] = {}
        self._running: Hashable | None = None
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def soon(self, key: Hashable, chore: Callable[[], None], at: float = 0.0) -> None:
        """Run ``chore`` once, no sooner than ``at`` (``time.monotonic()``), unless a
        chore of ``key`` is waiting already."""
        with self._cond:
            if key in self._queued:
                return
            n = next(self._order)
            heapq.heappush(self._heap, (at, n, key))  # unfiled until the next line: skipped
            self._queued[key] = (n, chore)
            if self._thread is None:
                self._start()
            elif self._heap[0][1] == n:  # due before anything the thread waits for
                self._cond.notify()

    def _start(self) -> None:
        """Start the thread (the caller holds ``_cond``). When the process can start no
        more threads, the chores wait: the next :meth:`soon` tries again, and what they
        would have done is done by their owners at the end (a closing writer forces its
        file, an ending run writes its record)."""
        thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        try:
            start_quiet(thread)
        except RuntimeError as exc:
            log.warning("deja: cannot start the background writer thread (%s); lines are "
                        "forced to disk when their run ends", exc)
            return
        self._thread = thread

    def waiting(self, key: Hashable) -> bool:
        """Whether a chore of ``key`` is waiting or running."""
        with self._cond:
            return key in self._queued or self._running == key

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s waiting chore; return once none of it is running."""
        with self._cond:
            self._queued.pop(key, None)
            while self._running == key and threading.current_thread() is not self._thread:
                self._cond.wait()

    def _loop(self) -> None:
        with self._cond:
            while True:
                heap = self._heap
                while heap and self._queued.get(heap[0][2], (None,))[0] != heap[0][1]:
                    heapq.heappop(heap)  # forgotten (or filed again since)
                if not heap:
                    self._cond.wait()
                    continue
                at, _, key = heap[0]
                wait = at - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(heap)
                _, chore = self._queued.pop(key)
                self._running = key
                self._cond.release()
                try:
                    chore()
                except BaseException:  # a chore keeps its own errors; this one is a bug
                    log.exception("deja: a background write failed")
                finally:
                    self._cond.acquire()
                    self._running = None
                    self._cond.notify_all()


CHORES = Chores()
os.register_at_fork(after_in_child=CHORES._reset)
