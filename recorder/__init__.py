"""deja's recorder: capture every observation of an agent run into a signed cassette.

``import recorder`` stays light: it does not import streamlit, duckdb or vcrpy; the HTTP
patchers load when a session starts.
"""

from .cassette import FORMAT, Cassette, CassetteWriter, Fsync, load
from .effects import now, randint, random, utcnow, uuid4, value
from .errors import (
    CassetteError,
    ConfigError,
    CorruptCassette,
    DejaError,
    Divergence,
    DivergenceInfo,
    KeyMissing,
    SessionError,
    SignatureError,
    ToolReplayError,
    TornCassette,
    UnserializableValue,
    UnsupportedFormat,
)
from .keys import Keyring, load_keyring
from .pricing import Price, PriceTable
from .record import RecordSession, record, start
from .session import Session, active
from .tools import tool

__all__ = [
    "FORMAT",
    "Cassette",
    "CassetteError",
    "CassetteWriter",
    "ConfigError",
    "CorruptCassette",
    "DejaError",
    "Divergence",
    "DivergenceInfo",
    "Fsync",
    "KeyMissing",
    "Keyring",
    "Price",
    "PriceTable",
    "RecordSession",
    "Session",
    "SessionError",
    "SignatureError",
    "ToolReplayError",
    "TornCassette",
    "UnserializableValue",
    "UnsupportedFormat",
    "active",
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
