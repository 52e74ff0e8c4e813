"""Values that tools return and effects produce, as JSON that replays to an equal value.

JSON types are stored as they are; ``bytes`` and ``tuple`` are tagged so that replay gives
back the same type. Anything else is refused with :class:`UnserializableValue` at record
time (never discovered at replay time): pass ``encode=``/``decode=`` to the tool for it.
Refused too, naming where: a container that contains itself, nesting deeper than
``MAX_DEPTH`` levels as stored (a tag is a level: a tuple takes two), a string with a lone
surrogate (UTF-8 has no bytes for it) and a dict key that is not a string.
"""

from __future__ import annotations

import base64
from typing import Any

from recorder._fastjson import BODY_DEPTH
from recorder.errors import UnserializableValue

_TAGS = ("$bytes", "$tuple", "$dict")


# Levels of lists and dicts as stored, tags counted: a line holds a value a few levels down
# and a cassette's reader takes lines up to LINE_DEPTH deep.
MAX_DEPTH = BODY_DEPTH


def encode(value: Any, *, where: str = "value") -> Any:
    try:
        return _encode(value, set(), 1)
    except _Refused as refused:
        trail = "".join(refused.trail)
        if len(trail) > 80:
            trail = f"{trail[:40]}…{trail[-30:]}"
        at = f" at {trail}" if trail else ""
        raise UnserializableValue(f"{where}{at}: {refused.reason}") from None


class _Refused(Exception):
    """Why a value cannot be stored, and where in it (filled in on the way out)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.trail: list[str] = []


def _encode(value: Any, path: set[int], level: int) -> Any:
    """``value`` as stored, its outermost list or dict (or tag) ``level`` levels deep."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, str):
        if not value.isascii():
            _check_text(value)
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            _within(level)
            return {"$float": repr(value)}
        return value
    if isinstance(value, (bytes, bytearray)):
        _within(level)
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if not isinstance(value, (tuple, list, dict)):
        raise _Refused(f"a {type(value).__name__} cannot be recorded as it is; return "
                       "JSON-like values (dict, list, str, numbers, bytes) or pass "
                       "encode=/decode= functions")
    if id(value) in path:
        raise _Refused(f"the {type(value).__name__} contains itself; a cassette can only "
                       "hold a tree of values")
    tagged = isinstance(value, tuple) or (
        isinstance(value, dict) and len(value) == 1 and str(next(iter(value))).startswith("$"))
    inner = level + 1 if tagged else level  # the list or dict that holds the items
    _within(inner)
    path.add(id(value))
    key: Any = None
    try:
        if isinstance(value, (tuple, list)):
            items = []
            for key, v in enumerate(value):  # noqa: B007 - named in a refusal
                items.append(_encode(v, path, inner + 1))
            return {"$tuple": items} if isinstance(value, tuple) else items
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise _Refused(f"dict keys must be strings to be recorded (found the "
                               f"{type(key).__name__} {key!r})")
            if not key.isascii():
                _check_text(key)
            out[key] = _encode(v, path, inner + 1)
    except _Refused as refused:
        refused.trail.insert(0, f"[{key!r}]")
        raise
    finally:
        path.discard(id(value))
    return {"$dict": out} if tagged else out


def _within(level: int) -> None:
    if level > MAX_DEPTH:
        raise _Refused(f"nested more than {MAX_DEPTH} levels deep as stored (a tuple takes "
                       "two); a cassette cannot hold it faithfully")


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _Refused(f"the string holds {text[exc.start:exc.end]!r} at position "
                       f"{exc.start}, a lone surrogate, which UTF-8 cannot encode; a cassette "
                       "cannot store it") from None


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
        return {_ascii(k): _ascii(repr(v)) for k, v in args.items()}


def _ascii(text: str) -> str:
    return text.encode("ascii", "backslashreplace").decode("ascii")
