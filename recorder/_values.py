"""Values that tools return and effects produce, as JSON that replays to an equal value.

JSON types are stored as they are; ``bytes`` and ``tuple`` are tagged so that replay gives
back the same type. Anything else is refused with :class:`UnserializableValue` at record
time (never discovered at replay time): pass ``encode=``/``decode=`` to the tool for it.
"""

from __future__ import annotations

import base64
from typing import Any

from .errors import UnserializableValue

_TAGS = ("$bytes", "$tuple", "$dict")


def encode(value: Any, *, where: str = "value") -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return {"$float": repr(value)}
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, where=where) for v in value]}
    if isinstance(value, list):
        return [encode(v, where=where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise UnserializableValue(f"{where}: dict keys must be strings to be recorded")
        out = {k: encode(v, where=where) for k, v in value.items()}
        return {"$dict": out} if len(value) == 1 and next(iter(value)).startswith("$") else out
    raise UnserializableValue(
        f"{where}: a {type(value).__name__} cannot be recorded as it is; return JSON-like "
        "values (dict, list, str, numbers, bytes) or pass encode=/decode= functions")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            tag, inner = next(iter(value.items()))
            if tag == "$bytes":
                return base64.b64decode(inner)
            if tag == "$tuple":
                return tuple(decode(v) for v in inner)
            if tag == "$float":
                return float(inner)
            if tag == "$dict":
                return {k: decode(v) for k, v in inner.items()}
        return {k: decode(v) for k, v in value.items()}
    return value


def args_key(args: dict[str, Any]) -> Any:
    """A JSON form of call arguments for matching; falls back to repr for odd types."""
    try:
        return encode(args, where="arguments")
    except UnserializableValue:
        return {k: repr(v) for k, v in args.items()}
