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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

from recorder.canonical import digest
from recorder.cassette import Cassette
from recorder.cassette.lines import Head, Lines, head_of
from recorder.cassette.schema import STOPS, Kind
from recorder.effects import Site

FAMILY: dict[str, str] = {Kind.MODEL: "net", Kind.HTTP: "net", Kind.TOOL: "tool",
                          Kind.INTENT: "tool", Kind.EFFECT: "effect", Kind.MCP: "mcp"}


def key_of(head: Head) -> tuple[str, str] | None:
    family = FAMILY.get(head.kind)
    if family is None:
        return None
    if family == "effect":
        return family, str(head.name)
    return family, str(head.fp)


def tool_key(name: str, args_key: Any) -> tuple[str, str]:
    return "tool", digest(["tool", name, args_key])


def heads(observations: Sequence[Mapping[str, Any]]) -> Sequence[Head]:
    """What the index matches ``observations`` on: a loaded cassette's heads as load kept
    them, or those of lines given whole (a fork's prefix)."""
    if isinstance(observations, Lines):
        return observations.heads
    return [head_of(obs) for obs in observations]


class _Lines(Mapping[int, Mapping[str, Any]]):
    """Seqs by key (an intent's seq -> its outcome's), read as the lines they name."""

    def __init__(self, lines: Sequence[Mapping[str, Any]], seqs: dict[int, int]) -> None:
        self._lines, self.seqs = lines, seqs

    def __getitem__(self, key: int) -> Mapping[str, Any]:
        return self._lines[self.seqs[key]]

    def __iter__(self) -> Any:
        return iter(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


class Index:
    """Unused observations by key, plus the first unused one of each family. It keeps
    seqs; a line is read from the cassette (restored then) when a call takes it."""

    def __init__(self, cassette: Cassette) -> None:
        self._lock = threading.Lock()
        self._lines: Sequence[Mapping[str, Any]] = cassette.observations
        self._heads = heads(self._lines)
        # every line of each key, served or not (one seq, or a list of them), and how far
        # the calls served have gone through a list
        self._recorded: dict[tuple[str, str], int | list[int]] = {}
        self._next: dict[Any, int] = {}
        # model and HTTP lines by their key under the replay policy, once a call needs it
        self._loose: dict[str, list[int]] | None = None
        self._loose_of: dict[int, str] = {}
        # effects by (name, file, function) of their call site
        self._sites: dict[tuple[str, str, str], list[int]] = {}
        self._order: dict[str, list[int]] = {"net": [], "tool": [], "effect": [], "mcp": []}
        self._cursor = {family: 0 for family in self._order}
        self.used: set[int] = set()
        self.total = 0
        # outcome of each side-effect intent, by the intent's seq
        self.outcomes = _Lines(self._lines, {})
        # each refusing control line, with the seqs that come before it and must be used
        self.stops: list[tuple[Mapping[str, Any], list[int]]] = []
        self._stop_next = 0
        self._add(self._heads)

    def _add(self, found: Iterable[Head]) -> None:
        before: list[int] = []
        for head in found:
            seq, within = head.seq, head.within is not None
            if head.kind == Kind.CONTROL and head.event in STOPS and not within:
                self.stops.append((self._lines[seq], list(before)))
                before.append(seq)
                self.total += 1
                continue
            if head.observed:  # seen at a boundary: its request is matched whole
                continue
            key = key_of(head)
            if (key is not None and not within) or head.kind == Kind.OUTCOME:
                before.append(seq)
            if head.kind == Kind.OUTCOME and not within:
                self.outcomes.seqs[cast(int, head.intent)] = seq
                self.total += 1
                continue
            if key is None or within:  # made inside a tool body: served with the tool
                continue
            group = self._recorded.setdefault(key, seq)
            if group != seq:  # a second line of the key: a list
                if isinstance(group, int):
                    group = self._recorded[key] = [group]
                group.append(seq)
            self._order[key[0]].append(seq)
            self.total += 1
            site = Site.parse(head.site) if key[0] == "effect" else None
            if site is not None:
                self._sites.setdefault((str(head.name), site.file, site.function),
                                       []).append(seq)

    def _read(self, seqs: Iterable[int]) -> list[Mapping[str, Any]]:
        return [self._lines[seq] for seq in seqs]

    def take(self, key: tuple[str, str], *, served: bool = False) -> Mapping[str, Any] | None:
        """The first unused observation of ``key``, marked used (None: none is left);
        ``served``: only what serving it reads, when the lines are a loaded cassette's
        (:meth:`~recorder.cassette.lines.Lines.served`)."""
        with self._lock:
            seq = self._next_unused(key, self._recorded.get(key))
            if seq is None:
                return None
            self._use(seq)
        if served and isinstance(self._lines, Lines):
            return self._lines.served(seq)
        return self._lines[seq]

    def _use(self, seq: int) -> None:
        self.used.add(seq)
        outcome = self.outcomes.seqs.get(seq)
        if outcome is not None:
            self.used.add(outcome)

    def take_loose(self, key: str,
                   line_key: Callable[[Mapping[str, Any]], str]) -> Mapping[str, Any] | None:
        """The first unused model or HTTP line whose key under the replay policy
        (``line_key``, :meth:`replayer.policy.ReplayPolicy.line_key`) is ``key``, marked
        used. The lines are keyed at the first call."""
        with self._lock:
            group = self._loose_group(key, line_key)
            seq = next((s for s in group if s not in self.used), None)
            if seq is None:
                return None
            self._use(seq)
        return self._lines[seq]

    def loose_group(self, key: str,
                    line_key: Callable[[Mapping[str, Any]], str]) -> list[Mapping[str, Any]]:
        """Every model or HTTP line whose key under the replay policy is ``key``, served or
        not, in recorded order."""
        with self._lock:
            group = list(self._loose_group(key, line_key))
        return self._read(group)

    def _loose_group(self, key: str, line_key: Callable[[Mapping[str, Any]], str]) -> list[int]:
        if self._loose is None:
            self._loose = {}
            for seq in self._order["net"]:
                self._loose_of[seq] = loose = line_key(self._lines[seq])
                self._loose.setdefault(loose, []).append(seq)
        return self._loose.get(key, [])

    def recorded(self, key: tuple[str, str]) -> list[Mapping[str, Any]]:
        """Every observation of ``key``, served or not, in recorded order."""
        return self._read(self._group(key))

    def _group(self, key: tuple[str, str]) -> list[int]:
        group = self._recorded.get(key, [])
        return [group] if isinstance(group, int) else group

    def played(self, seq: int) -> int:
        """How many of the observations that answer what ``seq`` answers (its key; for a
        model or HTTP line, under the replay policy once lines are keyed so) were served."""
        with self._lock:
            loose = self._loose_of.get(seq)
            if loose is not None and self._loose is not None:
                group = self._loose[loose]
            else:
                key = key_of(self._heads[seq]) if 0 <= seq < len(self._heads) else None
                group = self._group(key) if key is not None else []
            return sum(1 for s in group if s in self.used)

    def family(self, family: str) -> list[Mapping[str, Any]]:
        """The recorded observations of ``family``, served or not, in recorded order."""
        return self._read(self._order[family])

    def take_effect(self, name: str, file: str | None,
                    function: str | None) -> tuple[Mapping[str, Any] | None, bool]:
        """The effect that answers ``name`` asked for at ``file``/``function``, and whether
        it was recorded at another site (served by name, in recorded order)."""
        with self._lock:
            seq = None
            if file is not None and function is not None:
                where = (name, file, function)
                seq = self._next_unused(where, self._sites.get(where))
            by_name = seq is None
            if by_name:
                seq = self._next_unused(("effect", name), self._recorded.get(("effect", name)))
            if seq is None:
                return None, False
            self.used.add(seq)
        obs = self._lines[seq]
        return obs, by_name and file is not None and Site.parse(obs.get("site")) is not None

    def _next_unused(self, key: Any, group: int | list[int] | None) -> int | None:
        """The first seq of ``group`` not used yet (the group of ``key``)."""
        if group is None or isinstance(group, int):
            return None if group is None or group in self.used else group
        i = self._next.get(key, 0)
        while i < len(group) and group[i] in self.used:
            i += 1
        self._next[key] = i
        return group[i] if i < len(group) else None

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
            while i < len(order) and order[i] in self.used:
                i += 1
            self._cursor[family] = i
            seq = order[i] if i < len(order) else None
        return self._lines[seq] if seq is not None else None

    def unserved(self, family: str) -> list[Mapping[str, Any]]:
        """The recorded observations of ``family`` not served yet, in recorded order."""
        with self._lock:
            seqs = [s for s in self._order[family][self._cursor[family]:] if s not in self.used]
        return self._read(seqs)

    def unused(self) -> list[int]:
        with self._lock:
            seqs = [s for fam in self._order.values() for s in fam]
            seqs += self.outcomes.seqs.values()
            seqs += [o["seq"] for o, _ in self.stops]
            return sorted(s for s in seqs if s not in self.used)
