"""deja's recorder: capture every observation of an agent run into a signed cassette.

``import recorder`` is light: each name below is imported from its module when it is first
used (``recorder.record``, ``recorder.tool``, ...), so a command or a program that needs
one part of deja does not pay for the rest, and nothing imports streamlit, duckdb or vcrpy
until a session starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recorder.imports import import_on_first_use

if TYPE_CHECKING:  # what a type checker sees; at run time, each is imported on first use
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


# The module each name of __all__ is defined in; the others are errors (recorder.errors).
import_on_first_use(__name__, {
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
}, rest="recorder.errors")
