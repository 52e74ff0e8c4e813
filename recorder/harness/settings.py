"""Harness settings: from ``record(...)`` arguments, ``[tool.deja]`` and CLI flags.

``[tool.deja]`` is read from the nearest ``pyproject.toml`` at or above the working
directory (or the file named by ``DEJA_CONFIG``)::

    [tool.deja]
    fsync = "turn"

    [tool.deja.budgets]        # any of them; unset means no limit
    turns = 60
    tokens = 400_000
    max_tokens = 8192          # per-turn ceiling on the request's max_tokens
    max_tokens_mode = "refuse" # or "clamp"
    seconds = 3600
    dollars = 20.0

    [tool.deja.loop]           # or loop = false
    repeats = 3
    window = 5

    [tool.deja.breaker]        # or breaker = false
    failures = 5
    window = 60
    cooldown = 30

    [tool.deja.prices]         # dollars per million tokens (recorder.providers.pricing)
    "my-fine-tune" = [2.0, 8.0]                    # input, output
    "my-cached-tune" = [2.0, 8.0, 2.5, 0.2]        # ..., cache_write, cache_read
    "my-model" = {input = 1.0, output = 4.0, cache_read = 0.1}  # or named rates

    [tool.deja.redact]         # added to the built-in rules (recorder.capture.redact)
    headers = ["x-tenant-token"]
    body_paths = ["/metadata/user_id"]
    patterns = ["corp-[0-9a-f]{32}"]
    query = ["session"]

    [tool.deja.match]          # what a replay may find changed (replayer.policy)
    ignore = ["/metadata/session"]                      # JSON pointers
    normalise = ['[0-9]{4}-[0-9]{2}-[0-9]{2}=DATE']     # PATTERN=REPLACEMENT
    providers = true           # and what each provider declares volatile (the default)

Explicit arguments win over the file; the file wins over the defaults. Redaction rules
add up instead: the file's and the arguments' all apply, and so do a replay's ``match``
rules and those its caller gives. Anything malformed is a :class:`ConfigError` naming the
file and key, raised when the run (or the replay) starts.
"""

from __future__ import annotations

import copy
import functools
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recorder.capture.redact import Redaction
from recorder.cassette import Fsync
from recorder.errors import ConfigError
from recorder.harness.guards import BreakerSettings, Budgets, LoopSettings
from recorder.providers.pricing import PriceTable

DEFAULT_BUDGETS = Budgets(turns=200, seconds=3600.0)
_KEYS = {"fsync", "budgets", "loop", "breaker", "prices", "redact", "match"}
_REDACT_KEYS = ("headers", "body_paths", "patterns", "query")
_MATCH_LISTS = ("ignore", "normalise")


def find_pyproject(start: Path | None = None) -> Path | None:
    if os.environ.get("DEJA_CONFIG"):
        return Path(os.environ["DEJA_CONFIG"])
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def project_settings(start: Path | None = None) -> tuple[dict[str, Any], Path | None]:
    """The ``[tool.deja]`` table and the file it came from (empty when there is none).

    A file is parsed again only once its text has changed (the recording proxy resolves
    the settings for every new run, and a project's ``pyproject.toml`` can be long)."""
    path = find_pyproject(start)
    if path is None:
        return {}, None
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read [tool.deja]: {exc}") from None
    return copy.deepcopy(_deja_table(path, text)), path


@functools.lru_cache(maxsize=8)
def _deja_table(path: Path, text: str) -> dict[str, Any]:
    """The checked ``[tool.deja]`` table of ``path``, whose text is ``text``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: cannot read [tool.deja]: {exc}") from None
    table = data.get("tool", {}).get("deja", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.deja] must be a table")
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown [tool.deja] key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(_KEYS))}")
    return table


@dataclass(frozen=True)
class Settings:
    """The guards of one run, resolved."""

    budgets: Budgets = DEFAULT_BUDGETS
    loop: LoopSettings = field(default_factory=LoopSettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    prices: PriceTable = field(default_factory=PriceTable)
    fsync: str | None = None
    redaction: Redaction = field(default_factory=Redaction)

    def to_header(self) -> dict[str, Any]:
        return {"budgets": self.budgets.to_dict(),
                "loop": {"repeats": self.loop.repeats, "window": self.loop.window,
                         "alternation": self.loop.alternation, "enabled": self.loop.enabled},
                "breaker": {"failures": self.breaker.failures, "window": self.breaker.window,
                            "cooldown": self.breaker.cooldown, "enabled": self.breaker.enabled}}


def resolve(*, budgets: Budgets | Mapping[str, Any] | None = None,
            loop_guard: LoopSettings | Mapping[str, Any] | bool | None = None,
            breaker: BreakerSettings | Mapping[str, Any] | bool | None = None,
            prices: Mapping[str, Any] | None = None, fsync: str | None = None,
            redact_headers: Sequence[str] = (), redact_body: Sequence[str] = (),
            redact_patterns: Sequence[str] = (), redact_query: Sequence[str] = (),
            use_project: bool = True) -> Settings:
    table, path = project_settings() if use_project else ({}, None)
    where = f"{path}: [tool.deja]" if path else "settings"
    try:
        base = DEFAULT_BUDGETS
        if "budgets" in table:
            base = base.merged(**Budgets.of(table["budgets"]).to_dict())
        if budgets is not None:
            chosen = Budgets.of(budgets)
            base = chosen if isinstance(budgets, Budgets) else base.merged(**chosen.to_dict())
        loop = LoopSettings.of(loop_guard if loop_guard is not None else table.get("loop"))
        brk = BreakerSettings.of(breaker if breaker is not None else table.get("breaker"))
        for given in (table.get("prices"), prices):
            if given is not None and not isinstance(given, Mapping):
                raise ConfigError(f"prices must be a table of model = [input, output] or "
                                  f"model = {{input = ..., output = ...}} (dollars per "
                                  f"million tokens), not {given!r}")
        price_table = PriceTable({**(table.get("prices") or {}), **(prices or {})})
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    chosen_fsync = fsync or table.get("fsync")
    if chosen_fsync is not None:
        try:
            Fsync.parse(chosen_fsync)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    filed = _redact_table(table.get("redact"), f"{where}.redact")
    try:
        redaction = Redaction.of([*filed["headers"], *redact_headers],
                                 [*filed["body_paths"], *redact_body],
                                 [*filed["patterns"], *redact_patterns],
                                 [*filed["query"], *redact_query])
    except ConfigError as exc:
        raise ConfigError(f"redaction rules: {exc}") from None
    return Settings(base, loop, brk, price_table, chosen_fsync, redaction)


def _redact_table(table: Any, where: str) -> dict[str, list[str]]:
    """``[tool.deja.redact]``, checked: lists of strings under known keys, valid patterns."""
    out: dict[str, list[str]] = {key: [] for key in _REDACT_KEYS}
    if table is None:
        return out
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where} must be a table with {', '.join(_REDACT_KEYS)}")
    unknown = sorted(set(table) - set(_REDACT_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(_REDACT_KEYS)}")
    for key in _REDACT_KEYS:
        values = table.get(key, [])
        if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
            raise ConfigError(f"{where}.{key} must be a list of non-empty strings, not "
                              f"{values!r}")
        try:
            Redaction.of(**{key: values})
        except ConfigError as exc:
            raise ConfigError(f"{where}.{key}: {exc}") from None
        out[key] = list(values)
    return out


@dataclass(frozen=True)
class MatchSettings:
    """``[tool.deja.match]``: what a replay may find changed without diverging. ``ignore``
    holds JSON pointers, ``normalise`` ``PATTERN=REPLACEMENT`` rewrites (checked by the
    replay policy that reads them); ``providers``: whether the fields each provider
    declares volatile are left out too. ``where`` names the table, for messages."""

    ignore: tuple[str, ...] = ()
    normalise: tuple[str, ...] = ()
    providers: bool = True
    where: str = "[tool.deja.match]"


def match_settings(start: Path | None = None) -> MatchSettings:
    """The project's ``[tool.deja.match]`` (the nearest ``pyproject.toml`` at or above
    ``start``, the working directory by default, or ``DEJA_CONFIG``); the defaults when
    there is none."""
    table, path = project_settings(start)
    where = f"{path}: [tool.deja.match]" if path else "[tool.deja.match]"
    given = table.get("match")
    if given is None:
        return MatchSettings(where=where)
    if not isinstance(given, Mapping):
        raise ConfigError(f"{where} must be a table with ignore, normalise and providers")
    unknown = sorted(set(given) - {*_MATCH_LISTS, "providers"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: ignore, "
                          "normalise, providers")
    lists = {}
    for key in _MATCH_LISTS:
        values = given.get(key, [])
        if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
            raise ConfigError(f"{where}.{key} must be a list of non-empty strings, not "
                              f"{values!r}")
        lists[key] = tuple(values)
    providers = given.get("providers", True)
    if not isinstance(providers, bool):
        raise ConfigError(f"{where}.providers is true or false, not {providers!r}")
    return MatchSettings(lists["ignore"], lists["normalise"], providers, where)
