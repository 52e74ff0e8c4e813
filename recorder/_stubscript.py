"""The script format of the stub Anthropic server (:mod:`recorder.stubserver`), and its loader.

A *script* (a dict, a JSON file, or JSON text) lists the turns to answer ``POST /v1/messages``
with::

    {
      "model": "claude-sonnet-4-5",
      "select": "sequence",
      "turns": [
        {"text": "Hello!", "usage": {"input_tokens": 12, "output_tokens": 3}},
        {"text": "Let me search.", "tool_use": {"name": "search", "input": {"query": "x"}}},
        {"tool_use": [{"name": "a", "input": {}}, {"name": "b", "input": {"k": 1}}]},
        {"thinking": "hmm", "text": "answer"},
        {"error": {"status": 529, "type": "overloaded_error", "message": "Overloaded",
                   "retry_after": 0}},
        {"text": "partial", "sse_error": {"type": "overloaded_error", "after_events": 3}},
        {"drop": "before_headers"},
        {"text": "slow", "delay_ms": 50, "event_delay_ms": 5}
      ],
      "default": {"text": "ok"}
    }

Turn fields: ``text``, ``thinking``, ``tool_use`` (a dict or a list of dicts with ``name``,
optional ``input`` and ``id``), ``stop_reason``, ``stop_sequence``, ``usage``, ``error``,
``sse_error``, ``drop`` (``"before_headers"`` / ``"after_headers"``), ``delay_ms``,
``event_delay_ms``, ``should_retry`` and ``then`` (below). The placeholder ``{echo}`` in
``text`` or ``thinking`` is replaced by the text of the last user message. Keys starting with
``_`` (and ``comment``/``description``/``name``) are ignored, so scripts can carry notes.

Which turn answers a request is set by ``select``:

``"sequence"`` (the default)
    Each request takes the next turn, by a pointer shared by every client of the server.
    Past the end of ``turns`` every request gets ``default``; with no ``default`` the server
    answers 500 ``stub script exhausted`` (with ``x-should-retry: false``).

``"conversation"``
    The request itself picks the turn: its position is the number of messages with role
    ``assistant`` in its ``messages`` (a trailing assistant prefill counts too), so a new
    conversation gets ``turns[0]``, the request after one assistant reply ``turns[1]``, and so
    on. No pointer moves, so clients interleaving, a client that crashes and resumes, or one
    replaying part of a conversation all get the same turn for the same position. Past the
    end of ``turns``: ``default`` as-is for every request, else the exhausted 500.

    *Failure turns* (with ``error``, ``sse_error`` or ``drop``) are one-shot: the server counts
    the requests at each position, serves a failure turn only to the first, and gives repeats
    (such as the SDK's retry) the next entry of the turn's optional ``then`` list. An entry
    that is not a failure is served to every later repeat at that position; a failure entry
    is again served once. When ``then`` is absent or used up, repeats get ``default`` (else
    the exhausted 500). For example ``{"error": {"status": 529}, "then": [{"text": "ok"}]}``
    fails the first request at its position and answers ``ok`` to every retry after it.
    ``then`` is only valid in conversation mode, on failure turns of ``turns``, and its
    entries cannot have a ``then`` of their own.

Loading a script into a running server (:meth:`StubServer.load`, ``POST /_stub/script``)
resets the pointer, the per-position counts and ``served``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["FAILURE_KEYS", "SELECT_MODES", "StubScriptError", "is_failure", "load_script"]

SELECT_MODES = ("sequence", "conversation")
FAILURE_KEYS = ("error", "sse_error", "drop")

_DROP_MODES = ("before_headers", "after_headers")

_USAGE_KEYS = frozenset(
    {
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    }
)

_NOTE_KEYS = frozenset({"comment", "description", "name"})
_SCRIPT_KEYS = frozenset({"model", "select", "turns", "default"})
_TURN_KEYS = frozenset(
    {
        "text",
        "thinking",
        "tool_use",
        "stop_reason",
        "stop_sequence",
        "usage",
        "error",
        "sse_error",
        "drop",
        "delay_ms",
        "event_delay_ms",
        "should_retry",
        "then",
    }
)
_ERROR_KEYS = frozenset({"status", "type", "message", "retry_after", "should_retry"})
_SSE_ERROR_KEYS = frozenset({"type", "message", "after_events", "status"})
_TOOL_KEYS = frozenset({"name", "input", "id"})


class StubScriptError(ValueError):
    """A stub script is malformed; the message names the bad turn and field."""


def is_failure(turn: dict) -> bool:
    """Whether ``turn`` fails the request (``error``, ``sse_error`` or ``drop``)."""
    return any(key in turn for key in FAILURE_KEYS)


def _is_note(key: Any) -> bool:
    return isinstance(key, str) and (key.startswith("_") or key in _NOTE_KEYS)


def _check_keys(where: str, obj: dict, allowed: frozenset[str], *, notes: bool = False) -> None:
    for key in obj:
        if key in allowed or (notes and _is_note(key)):
            continue
        raise StubScriptError(
            f"{where}: unknown field {key!r} (expected one of {', '.join(sorted(allowed))})"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_non_negative_number(where: str, field: str, value: Any) -> None:
    if not _is_number(value) or value < 0:
        raise StubScriptError(f"{where}: field {field!r} must be a number >= 0, got {value!r}")


def _check_non_negative_int(where: str, field: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise StubScriptError(f"{where}: field {field!r} must be an integer >= 0, got {value!r}")


def _check_str(where: str, field: str, value: Any, *, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, str):
        raise StubScriptError(f"{where}: field {field!r} must be a string, got {value!r}")


def _check_status(where: str, field: str, status: Any) -> None:
    if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
        raise StubScriptError(
            f"{where}: field {field!r} must be an HTTP status 400-599, got {status!r}"
        )


def _validate_tool(where: str, field: str, tool: Any) -> None:
    if not isinstance(tool, dict):
        raise StubScriptError(f"{where}: field {field!r} must be an object, got {tool!r}")
    _check_keys(f"{where}: {field}", tool, _TOOL_KEYS)
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise StubScriptError(f"{where}: field '{field}.name' must be a non-empty string")
    if "input" in tool and not isinstance(tool["input"], dict):
        raise StubScriptError(
            f"{where}: field '{field}.input' must be an object, got {tool['input']!r}"
        )
    if "id" in tool and (not isinstance(tool["id"], str) or not tool["id"]):
        raise StubScriptError(f"{where}: field '{field}.id' must be a non-empty string")


def _validate_error(where: str, err: Any) -> None:
    if not isinstance(err, dict):
        raise StubScriptError(f"{where}: field 'error' must be an object, got {err!r}")
    _check_keys(f"{where}: error", err, _ERROR_KEYS)
    _check_status(where, "error.status", err.get("status"))
    for key in ("type", "message"):
        if key in err:
            _check_str(where, f"error.{key}", err[key])
    if "retry_after" in err:
        _check_non_negative_number(where, "error.retry_after", err["retry_after"])
    if "should_retry" in err and not isinstance(err["should_retry"], bool):
        raise StubScriptError(f"{where}: field 'error.should_retry' must be true or false")


def _validate_sse_error(where: str, err: Any) -> None:
    if not isinstance(err, dict):
        raise StubScriptError(f"{where}: field 'sse_error' must be an object, got {err!r}")
    _check_keys(f"{where}: sse_error", err, _SSE_ERROR_KEYS)
    for key in ("type", "message"):
        if key in err:
            _check_str(where, f"sse_error.{key}", err[key])
    if "after_events" in err:
        _check_non_negative_int(where, "sse_error.after_events", err["after_events"])
    if "status" in err:
        _check_status(where, "sse_error.status", err["status"])


def _validate_turn(where: str, turn: Any) -> None:
    """Check every field of a turn but ``then`` (see :func:`_validate_then`)."""
    if not isinstance(turn, dict):
        raise StubScriptError(f"{where}: must be an object, got {turn!r}")
    _check_keys(where, turn, _TURN_KEYS, notes=True)

    for field in ("text", "thinking"):
        if field in turn:
            _check_str(where, field, turn[field])
    if "stop_reason" in turn:
        _check_str(where, "stop_reason", turn["stop_reason"])
    if "stop_sequence" in turn:
        _check_str(where, "stop_sequence", turn["stop_sequence"], nullable=True)

    if "tool_use" in turn:
        tool_use = turn["tool_use"]
        if isinstance(tool_use, list):
            if not tool_use:
                raise StubScriptError(f"{where}: field 'tool_use' must not be an empty list")
            for i, tool in enumerate(tool_use):
                _validate_tool(where, f"tool_use[{i}]", tool)
        else:
            _validate_tool(where, "tool_use", tool_use)

    if "usage" in turn:
        usage = turn["usage"]
        if not isinstance(usage, dict):
            raise StubScriptError(f"{where}: field 'usage' must be an object, got {usage!r}")
        _check_keys(f"{where}: usage", usage, _USAGE_KEYS)
        for key, value in usage.items():
            _check_non_negative_int(where, f"usage.{key}", value)

    if "should_retry" in turn and not isinstance(turn["should_retry"], bool):
        raise StubScriptError(f"{where}: field 'should_retry' must be true or false")

    failures = [key for key in FAILURE_KEYS if key in turn]
    if len(failures) > 1:
        raise StubScriptError(
            f"{where}: fields {' and '.join(repr(f) for f in failures)} cannot be combined"
        )
    if "error" in turn:
        _validate_error(where, turn["error"])
    if "sse_error" in turn:
        _validate_sse_error(where, turn["sse_error"])
    if "drop" in turn and turn["drop"] not in _DROP_MODES:
        raise StubScriptError(
            f"{where}: field 'drop' must be 'before_headers' or 'after_headers', "
            f"got {turn['drop']!r}"
        )

    for field in ("delay_ms", "event_delay_ms"):
        if field in turn:
            _check_non_negative_number(where, field, turn[field])


def _validate_then(where: str, turn: dict, select: str) -> None:
    """Check the ``then`` list of a turn of ``turns`` (and each turn in it)."""
    if "then" not in turn:
        return
    if select != "conversation":
        raise StubScriptError(f"{where}: field 'then' needs 'select': 'conversation'")
    if not is_failure(turn):
        raise StubScriptError(
            f"{where}: field 'then' applies only to a turn with "
            f"{', '.join(repr(k) for k in FAILURE_KEYS)}"
        )
    then = turn["then"]
    if not isinstance(then, list):
        raise StubScriptError(f"{where}: field 'then' must be a list of turns, got {then!r}")
    for i, entry in enumerate(then):
        _validate_turn(f"{where}: then[{i}]", entry)
        if "then" in entry:
            raise StubScriptError(f"{where}: then[{i}]: field 'then' cannot be nested")


def _read_script_source(script: dict | str | os.PathLike) -> Any:
    if isinstance(script, dict):
        return copy.deepcopy(script)
    if isinstance(script, str) and script.lstrip().startswith("{"):
        try:
            return json.loads(script)
        except json.JSONDecodeError as exc:
            raise StubScriptError(f"script: invalid JSON: {exc}") from exc
    if isinstance(script, str | os.PathLike):
        path = Path(script)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise StubScriptError(f"script: cannot read {str(path)!r}: {exc}") from exc
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise StubScriptError(f"script {str(path)!r}: invalid JSON: {exc}") from exc
    raise StubScriptError(
        f"script must be a dict, a JSON file path or JSON text, got {type(script).__name__}"
    )


def load_script(script: dict | str | os.PathLike) -> dict:
    """Load and validate a stub script.

    ``script`` is a dict, a path to a JSON file, or a string of JSON text (starting with ``{``).
    Returns a validated deep copy that always has a ``"turns"`` list.
    Raises :class:`StubScriptError` naming the bad turn (``turn 3``, ``turn 3: then[0]``, or
    ``default``) and field.
    """
    data = _read_script_source(script)
    if not isinstance(data, dict):
        raise StubScriptError(f"script: top level must be an object, got {type(data).__name__}")
    _check_keys("script", data, _SCRIPT_KEYS, notes=True)
    if "model" in data:
        _check_str("script", "model", data["model"])
    select = data.get("select", "sequence")
    if select not in SELECT_MODES:
        raise StubScriptError(
            f"script: field 'select' must be 'sequence' or 'conversation', got {select!r}"
        )
    turns = data.setdefault("turns", [])
    if not isinstance(turns, list):
        raise StubScriptError(f"script: field 'turns' must be a list, got {type(turns).__name__}")
    for index, turn in enumerate(turns):
        where = f"turn {index}"
        _validate_turn(where, turn)
        _validate_then(where, turn, select)
    default = data.get("default")
    if default is not None:
        _validate_turn("default", default)
        if "then" in default:
            raise StubScriptError("default: field 'then' is not allowed on the default turn")
    return data
