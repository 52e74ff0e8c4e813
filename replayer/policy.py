"""How a replay matches a call to the log: one value, the replay policy.

A replay matches a model or HTTP request by the fingerprint of its semantic request (see
:func:`recorder.capture.exchange.request_fingerprint`). A :class:`ReplayPolicy` says what
else may differ between the recording and the replay without changing what the call
means: parts of the request body to leave out (``ignore``, JSON pointers such as
``/metadata/user_id``; ``*`` stands for any key or list index, ``**`` for any depth) and
rewrites of every string in it (``normalise``, a regular expression and its replacement,
such as today's date in a system prompt). The index computes its keys under the policy,
and the request the program sends is read under the same policy, so both sides agree.

Each provider declares what of its requests changes between runs by itself
(:meth:`recorder.providers.Format.volatile_request_fields` and
:meth:`~recorder.providers.Format.stable_request_ids`): tool-use ids, which every policy
renames by their order of first appearance, and fields such as a user id or a cache
marker, which a policy with ``providers`` leaves out. :meth:`ReplayPolicy.configured` is
the policy deja builds: the project's ``[tool.deja.match]``, the providers' declarations
and what the caller gives.

When a call matches nothing, :func:`nearest` ranks the recorded requests field by field
(the most fields equal first, then the closest in the fields that differ, then recorded
order) and names how the nearest one differs: what a divergence report shows beside the
diff.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recorder import providers
from recorder.canonical import fingerprint
from recorder.cassette.schema import Kind
from recorder.errors import ConfigError
from recorder.harness.settings import match_settings
from recorder.providers import Provider

__all__ = ["ReplayPolicy", "closeness", "nearest"]


@functools.lru_cache(maxsize=256)
def _pointer(text: str) -> tuple[str, ...]:
    if not text.startswith("/"):
        raise ConfigError(f"ignore {text!r}: a JSON pointer starts with / (such as "
                          "/metadata/user_id, or /messages/*/content for every message)")
    parts = tuple(part.replace("~1", "/").replace("~0", "~") for part in text[1:].split("/"))
    if parts[-1] == "**":
        raise ConfigError(f"ignore {text!r}: ** (any depth) needs a field after it, such "
                          "as /**/cache_control")
    return parts


@dataclass(frozen=True)
class ReplayPolicy:
    """What a replay matches on: the request less ``ignore``, with ``normalise`` applied,
    its tool-use ids renamed by order of first appearance, and less what its provider
    declares volatile when ``providers`` (a policy built by hand says exactly what it
    lists; :meth:`configured` adds the project's rules and the providers')."""

    ignore: tuple[str, ...] = ()
    normalise: tuple[tuple[str, str], ...] = ()
    providers: bool = False
    _pointers: tuple[tuple[str, ...], ...] = field(default=(), init=False, repr=False,
                                                    compare=False)
    _patterns: tuple[tuple[re.Pattern[str], str], ...] = field(default=(), init=False,
                                                               repr=False, compare=False)

    def __post_init__(self) -> None:
        # each rule once, in the order given (a policy merged twice is the same policy)
        object.__setattr__(self, "ignore", tuple(dict.fromkeys(self.ignore)))
        object.__setattr__(self, "normalise", tuple(dict.fromkeys(
            (str(p), str(r)) for p, r in self.normalise)))
        object.__setattr__(self, "_pointers", tuple(_pointer(p) for p in self.ignore))
        patterns = []
        for pattern, replacement in self.normalise:
            try:
                patterns.append((re.compile(pattern), replacement))
            except re.error as exc:
                raise ConfigError(f"normalise {pattern!r}: not a regular expression ({exc})") \
                    from None
        object.__setattr__(self, "_patterns", tuple(patterns))

    @classmethod
    def parse(cls, ignore: Iterable[str] = (), normalise: Iterable[str] = (), *,
              providers: bool = False) -> ReplayPolicy:
        """From the command line's and the marker's form: ``normalise`` items are
        ``PATTERN=REPLACEMENT`` (the last ``=`` splits them)."""
        pairs = []
        for item in normalise:
            pattern, sep, replacement = item.rpartition("=")
            if not sep:
                raise ConfigError(f"normalise {item!r}: give PATTERN=REPLACEMENT, such as "
                                  r"'\d{4}-\d{2}-\d{2}=DATE'")
            pairs.append((pattern, replacement))
        return cls(tuple(ignore), tuple(pairs), providers)

    @classmethod
    def configured(cls, given: ReplayPolicy | None = None, *,
                   start: Path | None = None) -> ReplayPolicy:
        """The policy deja builds for a replay: the project's ``[tool.deja.match]`` (found
        from ``start``, the working directory by default), the providers' declarations
        (unless the table says ``providers = false``), then ``given``'s rules (the marker's,
        the command line's)."""
        table = match_settings(start)
        try:
            project = cls.parse(table.ignore, table.normalise, providers=table.providers)
        except ConfigError as exc:
            raise ConfigError(f"{table.where}: {exc}") from None
        return project if given is None else project.merged(given)

    def merged(self, other: ReplayPolicy) -> ReplayPolicy:
        """This policy's rules, then ``other``'s; the providers' declarations as this one
        says."""
        return ReplayPolicy((*self.ignore, *other.ignore), (*self.normalise, *other.normalise),
                            self.providers)

    @property
    def exact(self) -> bool:
        """Nothing declared: match on the fingerprints the cassette stores."""
        return not self.ignore and not self.normalise and not self.providers

    def request(self, body: Any) -> Any:
        """``body`` as the policy's own rules read it: a copy less the ignored parts,
        strings rewritten (``body`` itself when there are none)."""
        if not self.ignore and not self.normalise:
            return body
        body = copy.deepcopy(body)
        for parts in self._pointers:
            body = _drop(body, parts)
        return self._rewrite(body) if self._patterns else body

    def read(self, provider: Provider | None, body: Any) -> Any:
        """``body`` as the match reads it: its provider's ids renamed, its declared
        volatile fields left out (with ``providers``), then :meth:`request`."""
        if provider is None:
            return self.request(body)
        fmt = provider.format
        renamed = fmt.stable_request_ids(body)
        declared = fmt.volatile_request_fields() if self.providers else ()
        if declared:
            renamed = copy.deepcopy(renamed) if renamed is body else renamed
            for pointer in declared:
                renamed = _drop(renamed, _pointer(pointer))
        return self.request(renamed)

    def _rewrite(self, value: Any) -> Any:
        if isinstance(value, str):
            for pattern, replacement in self._patterns:
                value = pattern.sub(replacement, value)
            return value
        if isinstance(value, list):
            return [self._rewrite(item) for item in value]
        if isinstance(value, dict):
            return {key: self._rewrite(item) for key, item in value.items()}
        return value

    def key(self, kind: str, provider: str | None, method: str, url: str, body: Any) -> str:
        """The fingerprint of a request under the policy (as the index keys it)."""
        if kind == Kind.MODEL and provider is not None:
            reader = providers.get(provider)
            return reader.fingerprint(method, url, self.read(reader, body))
        return fingerprint(kind, method, url, self.request(body))

    def line_key(self, requests: Mapping[int, Any]) -> Callable[[Mapping[str, Any]], str]:
        """The key of a recorded model or HTTP line under the policy (``requests``: the
        model requests of its cassette, by seq)."""
        def key(obs: Mapping[str, Any]) -> str:
            if obs["kind"] == Kind.MODEL:
                provider = providers.for_line(obs)
                return provider.fingerprint("POST", obs["url"],
                                            self.read(provider, requests.get(obs["seq"])))
            request = obs.get("request") or {}
            return self.key(Kind.HTTP.value, None, obs.get("method", "GET"), obs["url"],
                            request.get("body"))
        return key


def _drop(value: Any, parts: tuple[str, ...]) -> Any:
    """``value`` without what the pointer ``parts`` names (``*``: every key or index)."""
    if not parts:
        return value
    head, rest = parts[0], parts[1:]
    if head == "**":  # here, and at every depth below
        value = _drop(value, rest)
        children = value.items() if isinstance(value, dict) else \
            enumerate(value) if isinstance(value, list) else ()
        for name, child in list(children):
            value[name] = _drop(child, parts)
        return value
    if isinstance(value, dict):
        names = list(value) if head == "*" else [head] if head in value else []
        for name in names:
            if rest:
                value[name] = _drop(value[name], rest)
            else:
                del value[name]
    elif isinstance(value, list):
        if head == "*":
            indexes = range(len(value))
        elif head.isdigit() and int(head) < len(value):
            indexes = range(int(head), int(head) + 1)
        else:
            indexes = range(0)
        if rest:
            for i in indexes:
                value[i] = _drop(value[i], rest)
        else:
            for i in reversed(indexes):
                del value[i]
    return value


def _fields(request: Any) -> dict[str, Any]:
    """A request as fields to compare: a JSON object's members, the items of its
    conversation (the field its provider names, :func:`recorder.providers.history_field`)
    each a field of its own (``messages[3]``), anything else one field."""
    if not isinstance(request, dict):
        return {"request": request}
    history = providers.history_field(request)
    out: dict[str, Any] = {}
    for name, value in request.items():
        if name == history and isinstance(value, list):
            out.update({f"{name}[{i}]": item for i, item in enumerate(value)})
            out[f"{name} (length)"] = len(value)
        else:
            out[name] = value
    return out


def nearest(actual: Any, candidates: Iterable[tuple[int, Any]]) -> tuple[int, list[str]] | None:
    """The recorded request nearest to ``actual`` among ``candidates`` ((seq, request) in
    recorded order): the one with the most fields equal; on a tie, the one closest to
    ``actual`` in the fields that differ (the words they share, :func:`closeness`); then
    the earliest. With the fields that differ. None when there is no candidate."""
    mine = _fields(actual)
    best: tuple[int, float, int, list[str]] | None = None
    for seq, request in candidates:
        theirs = _fields(request)
        names = list(dict.fromkeys([*theirs, *mine]))
        differ = [name for name in names if theirs.get(name, _ABSENT) != mine.get(name, _ABSENT)]
        same = len(names) - len(differ)
        if best is not None and same < best[0]:
            continue
        close = sum(closeness(theirs.get(name), mine.get(name)) for name in differ)
        if best is None or (same, close) > best[:2]:
            best = (same, close, seq, differ)
    return None if best is None else (best[2], best[3])


_WORD = re.compile(r"\w+")
_CLOSENESS_CHARS = 100_000  # of a field's text: enough to tell requests apart, and bounded


def closeness(a: Any, b: Any) -> float:
    """How alike two values are, from 0 to 1: the share of the words of their JSON text
    they have in common (counted with repeats)."""
    if a is b:
        return 1.0
    words = [Counter(_WORD.findall(json.dumps(v, sort_keys=True, default=str)
                                   [:_CLOSENESS_CHARS])) for v in (a, b)]
    union = sum((words[0] | words[1]).values())
    return sum((words[0] & words[1]).values()) / union if union else 1.0


_ABSENT = object()
