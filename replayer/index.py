"""The replay index: which recorded observation answers which call, in O(1).

Observations are grouped by a key (the request fingerprint for model and HTTP calls,
``tool`` + name + arguments for tools, an MCP server's tools included, the server, method
and params for its other requests, the name for effects). Each group is a queue in
recorded order, so identical calls are served in the order they were recorded and
concurrent calls can arrive in any order. When a call finds no entry, the first unused
observation of the same family is what the run expected there.

Effects are grouped twice: by name and call site (file and function), which is how they
are served, and by name alone, the fallback for a call site that recorded none (and the
only grouping for cassettes written before effects named their site). An observation
sits in both queues; whichever serves it first marks it used, the other skips it.

Model and HTTP calls are grouped twice too: by their stored fingerprint (an exact match)
and, once a call matches none, by their key under the replay policy
(:meth:`Index.take_loose`, an equivalent match), keyed then, at the first such call, so
that a replay whose calls all match exactly never reads a request under the policy.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from recorder.canonical import digest
from recorder.cassette import Cassette
from recorder.cassette.schema import STOPS, Kind
from recorder.effects import Site

FAMILY: dict[str, str] = {Kind.MODEL: "net", Kind.HTTP: "net", Kind.TOOL: "tool",
                          Kind.INTENT: "tool", Kind.EFFECT: "effect", Kind.MCP: "mcp"}


def key_of(obs: Mapping[str, Any]) -> tuple[str, str] | None:
    kind = obs.get("kind")
    family = FAMILY.get(kind or "")
    if family is None:
        return None
    if family == "effect":
        return family, obs["name"]
    return family, obs["fp"]


def tool_key(name: str, args_key: Any) -> tuple[str, str]:
    return "tool", digest(["tool", name, args_key])


class Index:
    """Unused observations by key, plus the first unused one of each family."""

    def __init__(self, cassette: Cassette) -> None:
        self._lock = threading.Lock()
        self._queues: dict[tuple[str, str], deque[Mapping[str, Any]]] = {}
        # every line of each key, served or not, and each line's key
        self._recorded: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        self._key_of: dict[int, tuple[str, str]] = {}
        # model and HTTP lines by their key under the replay policy, once a call needs it
        self._loose: dict[str, list[Mapping[str, Any]]] | None = None
        self._loose_of: dict[int, str] = {}
        # effects by (name, file, function) of their call site
        self._sites: dict[tuple[str, str, str], deque[Mapping[str, Any]]] = {}
        self._order: dict[str, list[Mapping[str, Any]]] = {"net": [], "tool": [], "effect": [],
                                                           "mcp": []}
        self._cursor = {family: 0 for family in self._order}
        self.used: set[int] = set()
        self.total = 0
        # outcome of each side-effect intent, by the intent's seq
        self.outcomes: dict[int, Mapping[str, Any]] = {}
        # each refusing control line, with the seqs that come before it and must be used
        self.stops: list[tuple[Mapping[str, Any], list[int]]] = []
        self._stop_next = 0
        before: list[int] = []
        # read by field name across kinds (an outcome's intent, an effect's name)
        observations: tuple[Mapping[str, Any], ...] = cassette.observations
        for obs in observations:
            if obs.get("kind") == Kind.CONTROL and obs.get("event") in STOPS \
                    and "within" not in obs:
                self.stops.append((obs, list(before)))
                before.append(obs["seq"])
                self.total += 1
                continue
            if "observed" in obs:  # seen at a boundary: its request is matched whole
                continue
            if (key_of(obs) is not None and "within" not in obs) or obs.get("kind") == Kind.OUTCOME:
                before.append(obs["seq"])
            if obs.get("kind") == Kind.OUTCOME and "within" not in obs:
                self.outcomes[obs["intent"]] = obs
                self.total += 1
                continue
            key = key_of(obs)
            if key is None or "within" in obs:  # made inside a tool body: served with the tool
                continue
            self._queues.setdefault(key, deque()).append(obs)
            self._recorded.setdefault(key, []).append(obs)
            self._key_of[obs["seq"]] = key
            self._order[key[0]].append(obs)
            self.total += 1
            site = Site.parse(obs.get("site")) if key[0] == "effect" else None
            if site is not None:
                where = (obs["name"], site.file, site.function)
                self._sites.setdefault(where, deque()).append(obs)

    def take(self, key: tuple[str, str]) -> Mapping[str, Any] | None:
        """The first unused observation of ``key``, marked used (None: none is left)."""
        with self._lock:
            obs = self._next_unused(self._queues.get(key))
            if obs is not None:
                self._use(obs)
            return obs

    def _use(self, obs: Mapping[str, Any]) -> None:
        self.used.add(obs["seq"])
        outcome = self.outcomes.get(obs["seq"])
        if outcome is not None:
            self.used.add(outcome["seq"])

    def take_loose(self, key: str,
                   line_key: Callable[[Mapping[str, Any]], str]) -> Mapping[str, Any] | None:
        """The first unused model or HTTP line whose key under the replay policy
        (``line_key``, :meth:`replayer.policy.ReplayPolicy.line_key`) is ``key``, marked
        used. The lines are keyed at the first call."""
        with self._lock:
            group = self._loose_group(key, line_key)
            obs = next((o for o in group if o["seq"] not in self.used), None)
            if obs is not None:
                self._use(obs)
            return obs

    def loose_group(self, key: str,
                    line_key: Callable[[Mapping[str, Any]], str]) -> list[Mapping[str, Any]]:
        """Every model or HTTP line whose key under the replay policy is ``key``, served or
        not, in recorded order."""
        with self._lock:
            return list(self._loose_group(key, line_key))

    def _loose_group(self, key: str,
                     line_key: Callable[[Mapping[str, Any]], str]) -> list[Mapping[str, Any]]:
        if self._loose is None:
            self._loose = {}
            for obs in self._order["net"]:
                self._loose_of[obs["seq"]] = loose = line_key(obs)
                self._loose.setdefault(loose, []).append(obs)
        return self._loose.get(key, [])

    def recorded(self, key: tuple[str, str]) -> list[Mapping[str, Any]]:
        """Every observation of ``key``, served or not, in recorded order."""
        return list(self._recorded.get(key, ()))

    def played(self, seq: int) -> int:
        """How many of the observations that answer what ``seq`` answers (its key; for a
        model or HTTP line, under the replay policy once lines are keyed so) were served."""
        with self._lock:
            loose = self._loose_of.get(seq)
            if loose is not None and self._loose is not None:
                group = self._loose[loose]
            else:
                group = self._recorded.get(self._key_of.get(seq, ("", "")), [])
            return sum(1 for obs in group if obs["seq"] in self.used)

    def family(self, family: str) -> list[Mapping[str, Any]]:
        """The recorded observations of ``family``, served or not, in recorded order."""
        return list(self._order[family])

    def take_effect(self, name: str, file: str | None,
                    function: str | None) -> tuple[Mapping[str, Any] | None, bool]:
        """The effect that answers ``name`` asked for at ``file``/``function``, and whether
        it was recorded at another site (served by name, in recorded order)."""
        with self._lock:
            obs = None
            if file is not None and function is not None:
                obs = self._next_unused(self._sites.get((name, file, function)))
            moved = False
            if obs is None:
                obs = self._next_unused(self._queues.get(("effect", name)))
                moved = (obs is not None and file is not None
                         and Site.parse(obs.get("site")) is not None)
            if obs is not None:
                self.used.add(obs["seq"])
            return obs, moved

    def _next_unused(self, queue: deque[Mapping[str, Any]] | None) -> Mapping[str, Any] | None:
        while queue:
            obs = queue.popleft()
            if obs["seq"] not in self.used:
                return obs
        return None

    def pending_stop(self) -> Mapping[str, Any] | None:
        """The refusing control line the next call meets, once everything before it is used."""
        with self._lock:
            if self._stop_next >= len(self.stops):
                return None
            obs, before = self.stops[self._stop_next]
            if len(self.used) < len(before) or not all(s in self.used for s in before):
                return None
            self._stop_next += 1
            self.used.add(obs["seq"])
            return obs

    @property
    def remaining(self) -> int:
        """How many recorded observations have not been served yet."""
        return self.total - len(self.used)

    def expected(self, family: str) -> Mapping[str, Any] | None:
        """The first recorded observation of ``family`` not served yet."""
        with self._lock:
            order, i = self._order[family], self._cursor[family]
            while i < len(order) and order[i]["seq"] in self.used:
                i += 1
            self._cursor[family] = i
            return order[i] if i < len(order) else None

    def unserved(self, family: str) -> list[Mapping[str, Any]]:
        """The recorded observations of ``family`` not served yet, in recorded order."""
        with self._lock:
            return [obs for obs in self._order[family][self._cursor[family]:]
                    if obs["seq"] not in self.used]

    def unused(self) -> list[int]:
        with self._lock:
            seqs = [o["seq"] for fam in self._order.values() for o in fam]
            seqs += [o["seq"] for o in self.outcomes.values()]
            seqs += [o["seq"] for o, _ in self.stops]
            return sorted(s for s in seqs if s not in self.used)

