"""deja's recorder: capture every observation of an agent run into a signed cassette.

``import recorder`` stays light: it does not import streamlit, duckdb or vcrpy; the HTTP
patchers load when a session starts.
"""

from recorder.capture.session import Session, active
from recorder.cassette import FORMAT, Cassette, CassetteWriter, Fsync, load
from recorder.cassette.keys import Keyring, load_keyring
from recorder.effects import now, randint, random, utcnow, uuid4, value
from recorder.errors import (
    BudgetExhausted,
    Cancelled,
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
    KeyMissing,
    LoopDetected,
    NeedsAttention,
    RunStopped,
    SessionError,
    SignatureError,
    ToolReplayError,
    TornCassette,
    UnserializableValue,
    UnsupportedFormat,
    UnverifiedCassette,
)
from recorder.harness.guards import BreakerSettings, Budgets, LoopGuard
from recorder.intents import Intent, Settled, idempotency_key
from recorder.pricing import Price, PriceTable
from recorder.record import RecordSession, record, start
from recorder.tools import tool

__all__ = [
    "FORMAT",
    "BreakerSettings",
    "BudgetExhausted",
    "Budgets",
    "Cancelled",
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
    "Fsync",
    "Intent",
    "KeyMissing",
    "Keyring",
    "LoopDetected",
    "LoopGuard",
    "NeedsAttention",
    "Price",
    "PriceTable",
    "RecordSession",
    "RunStopped",
    "Session",
    "SessionError",
    "Settled",
    "SignatureError",
    "ToolReplayError",
    "TornCassette",
    "UnserializableValue",
    "UnsupportedFormat",
    "UnverifiedCassette",
    "active",
    "idempotency_key",
    "load",
    "load_keyring",
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
