"""deja's recorder: capture every observation of an agent run into a signed cassette.

``import recorder`` is light: each name below is imported from its module when it is first
used (``recorder.record``, ``recorder.tool``, ...), so a command or a program that needs
one part of deja does not pay for the rest, and nothing imports streamlit, duckdb or vcrpy
until a session starts.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker sees; at run time, _WHERE below
    from recorder.ask import artefact, ask
    from recorder.capture.session import Session, active, mode
    from recorder.cassette import FORMAT, Cassette, CassetteWriter, Fsync, load
    from recorder.cassette.keys import Keyring, load_keyring
    from recorder.effects import now, randint, random, utcnow, uuid4, value
    from recorder.errors import (
        BudgetExhausted,
        Cancelled,
        CannotConvert,
        CannotLaunch,
        CassetteError,
        CassetteLocked,
        CassetteNotFound,
        CassetteWriteError,
        CircuitOpen,
        ConfigError,
        CorruptCassette,
        DejaError,
        Divergence,
        DivergenceInfo,
        EditError,
        ExportFailed,
        KeyMissing,
        LoopDetected,
        NeedsAttention,
        NoSuchRun,
        NoSuchStep,
        NotAVcrCassette,
        NotResumable,
        PathTaken,
        RunStopped,
        SessionError,
        SignatureError,
        ToolRefused,
        ToolReplayError,
        TornCassette,
        UnserializableValue,
        UnsupportedFormat,
        UnverifiedCassette,
        UsageError,
        VcrImportError,
    )
    from recorder.harness.guards import BreakerSettings, Budgets, LoopSettings
    from recorder.intents import Intent, Settled, idempotency_key
    from recorder.providers.pricing import Price, PriceTable
    from recorder.record import RecordSession, record, start
    from recorder.tools import tool

__all__ = [
    "FORMAT",
    "BreakerSettings",
    "BudgetExhausted",
    "Budgets",
    "Cancelled",
    "CannotConvert",
    "CannotLaunch",
    "Cassette",
    "CassetteError",
    "CassetteLocked",
    "CassetteNotFound",
    "CassetteWriteError",
    "CassetteWriter",
    "CircuitOpen",
    "ConfigError",
    "CorruptCassette",
    "DejaError",
    "Divergence",
    "DivergenceInfo",
    "EditError",
    "ExportFailed",
    "Fsync",
    "Intent",
    "KeyMissing",
    "Keyring",
    "LoopDetected",
    "LoopSettings",
    "NeedsAttention",
    "NoSuchRun",
    "NoSuchStep",
    "NotAVcrCassette",
    "NotResumable",
    "PathTaken",
    "Price",
    "PriceTable",
    "RecordSession",
    "RunStopped",
    "Session",
    "SessionError",
    "Settled",
    "SignatureError",
    "ToolRefused",
    "ToolReplayError",
    "TornCassette",
    "UnserializableValue",
    "UnsupportedFormat",
    "UnverifiedCassette",
    "UsageError",
    "VcrImportError",
    "active",
    "artefact",
    "ask",
    "idempotency_key",
    "load",
    "load_keyring",
    "mode",
    "now",
    "randint",
    "random",
    "record",
    "start",
    "tool",
    "utcnow",
    "uuid4",
    "value",
]


# Where each name of __all__ is: the module it is imported from on first use.
_WHERE: dict[str, str] = {name: module for module, names in {
    "recorder.ask": ("artefact", "ask"),
    "recorder.capture.session": ("Session", "active", "mode"),
    "recorder.cassette": ("FORMAT", "Cassette", "CassetteWriter", "Fsync", "load"),
    "recorder.cassette.keys": ("Keyring", "load_keyring"),
    "recorder.effects": ("now", "randint", "random", "utcnow", "uuid4", "value"),
    "recorder.harness.guards": ("BreakerSettings", "Budgets", "LoopSettings"),
    "recorder.intents": ("Intent", "Settled", "idempotency_key"),
    "recorder.providers.pricing": ("Price", "PriceTable"),
    "recorder.record": ("RecordSession", "record", "start"),
    "recorder.tools": ("tool",),
}.items() for name in names}
# The functions named like the module they are defined in: the package's attribute stays
# the function when the module is imported (the import system sets the attribute to the
# module then), as it did when this file imported everything up front.
_SHADOWED = frozenset({"ask", "record"})


class _Package(types.ModuleType):
    """The ``recorder`` module's type: it imports a name of ``__all__`` on first use."""

    def __getattr__(self, name: str) -> Any:
        module = _WHERE.get(name) or ("recorder.errors" if name in __all__ else None)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        self.__dict__[name] = value
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(__all__))


sys.modules[__name__].__class__ = _Package
