"""A loaded cassette's model fingerprints, worked out in file order when first asked for.

A model line's fingerprint is what a replay matches a call on: a digest of its request,
which the line stores as a delta of an earlier one (:mod:`recorder.cassette._delta`).
Working it out means rebuilding every request in file order, which is most of what reading
a long cassette would cost; a reader that does not match calls (``deja show``, ``ls``, the
viewer, a run's totals) never needs it. So :func:`recorder.cassette.load` checks each line
(its signature, its place, its field types, the earlier lines it names) and leaves the
requests alone; :class:`Pass` rebuilds them, from the first line not yet passed up to the
one asked for, the first time a replay's index, a request or a whole line needs them.

A request rebuilt here shares the items of its history with the one it extends, object
for object, so :class:`~recorder.canonical.Parts` hashes only the items a turn adds; what
the pass keeps (the last few requests and answers, the digests of recent parts) is let go
once it has passed the last line.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from recorder import providers  # a module reference: providers imports this package
from recorder.canonical import Parts
from recorder.cassette import _delta
from recorder.cassette.schema import Kind

if TYPE_CHECKING:
    from recorder.cassette.lines import Store

WINDOW = 2 * _delta.WINDOW  # recent requests and answers kept while passing
PARTS_SPAN = 128  # model lines passed with one Parts (what it remembers is let go after)


_paused = 0  # readers inside no_cycle_collection, in every thread
_was_enabled = False  # whether the collector was on when the first of them came in
_pausing = threading.Lock()


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """The cyclic garbage collector paused while lines are read. They are JSON trees,
    which hold no reference cycles, and reading them allocates containers by the hundred
    thousand: each collection the allocations set off would go through all of them again
    (a fifth of a long cassette's load time). Reference counting still frees everything
    as usual; the collector is enabled again after, as it was, once the last reader of
    any thread is out (two readers that each looked for themselves could leave it off)."""
    global _paused, _was_enabled
    with _pausing:
        if _paused == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _pausing:
            _paused -= 1
            if _paused == 0 and _was_enabled:
                gc.enable()


class Window(dict[int, Any]):
    """The last :data:`WINDOW` values put in (requests or answers, by seq), and the rest
    from ``fallback`` (the store, which restores them): what a line refers to is nearly
    always one of the last few."""

    def __init__(self, fallback: Callable[[int], Any]) -> None:
        super().__init__()
        self._fallback = fallback

    def __missing__(self, seq: int) -> Any:
        return self._fallback(seq)

    def put(self, seq: int, value: Any) -> None:
        self[seq] = value
        if len(self) > WINDOW:
            del self[next(iter(self))]


class Pass:
    """The fingerprints of ``store``'s model lines, one line after the other from line
    ``start`` (the lines before it are passed already); the caller holds the store's lock
    and turns a fault into a named one. The store is held weakly: the store holds its
    pass, which must not keep it alive."""

    def __init__(self, store: Store, start: int = 0) -> None:
        ref = weakref.ref(store)
        self._ref = ref
        self.at = start  # the first line not passed yet
        self._models = 0  # model lines passed
        self._parts = Parts()
        self._requests = Window(lambda seq: _alive(ref).request(seq))
        self._replies = Window(lambda seq: _alive(ref).replies[seq])

    def through(self, seq: int, stored: Any = None) -> None:
        """Pass every line up to ``seq`` (``stored``: line ``seq``'s request as the line
        stores it, when the caller has parsed the line already); ``at``, and the store's
        ``matched``, are moved past each line as it is done."""
        store = _alive(self._ref)
        heads = store.heads
        while self.at <= seq:
            at = self.at
            if heads[at].kind == Kind.MODEL:
                heads[at] = heads[at]._replace(fp=self._model(store, at, stored if at == seq
                                                              else None))
            self.at = store.matched = at + 1

    def _model(self, store: Store, seq: int, stored: Any) -> str:
        """Model line ``seq``'s fingerprint, from its request rebuilt; the request (for the
        store too) and the answer it gives kept while the next lines may refer to them
        (given ``stored``, the line is not parsed again: the store finds its answer)."""
        if self._models % PARTS_SPAN == 0:
            self._parts = Parts()
        self._models += 1
        line = store.parsed(seq) if stored is None else None
        request = _delta.decode(line["request"] if line is not None else stored,
                                self._requests, self._replies, self._parts, store.shapes, seq)
        provider = providers.for_line({"provider": store.providers[seq]})
        fp = provider.fingerprint("POST", store.urls[seq] or "", request, self._parts)
        self._requests.put(seq, request)
        store.rebuilt(seq, request)
        response = line.get("response") if line is not None else None
        if isinstance(response, dict) and "body_json" in response:
            reply = providers.replied(response["body_json"])
            if reply is not None:
                self._replies.put(seq, reply)
        return fp


def _alive(ref: weakref.ref[Store]) -> Store:
    store = ref()
    if store is None:  # the store calls its pass: it is alive while the pass runs
        raise ReferenceError("the cassette's store is gone")
    return store
