"""The script format of the stub Anthropic server (:mod:`recorder.testing.server`), and its loader.

A *script* (a dict, a JSON file, or JSON text) says how to answer ``POST /v1/messages``::

    {
      "model": "claude-sonnet-4-5",
      "select": "conversation",
      "rules": [
        {"when": {"tool_result_is_error": false}, "text": "Found it."},
        {"when": {"position": 0, "first_user": "Say hi"}, "text": "hi"}
      ],
      "turns": [
        {"text": "Let me search.", "tool_use": {"name": "search", "input": {"query": "x"}}},
        {"error": {"status": 529, "retry_after": 0}, "then": [{"text": "retried"}]}
      ],
      "default": {"text": "ok"}
    }

Top-level keys: ``model`` (the reply's model when the request names none), ``select``
(``"sequence"``, the default, or ``"conversation"``), ``rules``, ``turns`` and ``default``.
Keys starting with ``_`` (and ``comment``/``description``/``name``) are notes, ignored
everywhere.

How an answer is chosen (:func:`recorder.testing.match.pick`):

1. ``rules``, in order: the first rule whose ``when`` holds answers. ``when`` conditions (all
   given must hold): ``position`` (the number of assistant messages in the request),
   ``first_user`` (the first user message's text equals), ``last_user`` (the last user
   message's text equals), ``last_user_contains``, ``tool_result_contains`` (a ``tool_result``
   of the last user message contains the string), ``tool_result_is_error`` (``true``: one of
   those results has ``is_error: true``; ``false``: there is one and none has), ``endpoint``
   (the request's path: ``/v1/messages``, ``/v1/chat/completions`` or ``/v1/responses``;
   Gemini's by the end of its path, ``:generateContent`` or ``:streamGenerateContent``),
   ``stream`` (``true``: the request asks for a stream; ``false``: it does not) and
   ``previous_response_id`` (a Responses request continues this response). A message's
   text is its string content or its text blocks and tool results, joined by newlines.
2. Else ``turns``: with ``"select": "conversation"`` the turn at the request's position
   (``turns[0]`` for a new conversation, ``turns[1]`` after one assistant reply, ...); with
   ``"sequence"`` the next turn by a pointer shared by every client of the server (reset by
   :meth:`StubServer.load`).
3. Else ``default``; with none, a 500 ``stub script exhausted`` with ``x-should-retry: false``.

Rules and conversation turns remember nothing between requests. A failure turn among them
(``error``, ``sse_error`` or ``drop``) with a ``then`` list is a retry sequence keyed by the
SDK's ``x-stainless-retry-count`` header: attempt 0 gets the failure, attempt *k* the
*k*-th entry of ``then``; the first entry that is not a failure answers every later attempt,
and attempts past the list get ``default`` (else the exhausted 500). ``then`` needs a failure
turn of ``rules`` or of conversation ``turns``, and its entries have no ``then`` of their own.

Turn keys. Content, built from parts: ``text``, ``thinking``, ``tool_use`` (an object or a list
of objects with ``name``, optional ``input`` and ``id``), ``stop_reason``, ``stop_sequence``,
``usage`` (token counts; left out, they are estimated). The placeholder ``{echo}`` in ``text``
or ``thinking`` is replaced by the last user message's text. Or content as recorded:
``message`` (a whole Messages API message object, sent as it is; as a stream it is rendered to
events; or an OpenAI ``chat.completion`` or Responses ``response`` object, sent as it is to a
JSON request of its API, else rendered from its text, tool calls, usage and stop reason;
or a Gemini response with ``candidates``, sent as it is, as one chunk to a stream) or
``sse`` (a raw ``text/event-stream`` body, sent verbatim to a streaming request and, for the
Messages API, assembled into one message for a non-streaming one, or a 529 if it holds an
error event; an OpenAI or Gemini stream is ``data:`` lines, a Responses stream typed
events).
Neither mixes with the built parts. Failures: ``error`` (``status``
400-599, ``type``, ``message``, ``retry_after`` seconds, which sets ``retry-after`` and
``retry-after-ms``, ``should_retry``, which sets ``x-should-retry``, and ``headers``, response
headers sent as they are), ``sse_error`` (a stream cut by an error event after
``after_events`` events; a 529 for a non-streaming request), ``drop`` (``"before_headers"`` or
``"after_headers"``: the connection is closed). Timing: ``delay_ms`` before answering,
``event_delay_ms`` between stream events. ``should_retry`` on the turn sets
``x-should-retry`` on its error. ``when`` (rules only) and ``then`` as above.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

from recorder.testing.match import FAILURE_KEYS, GEMINI_GENERATE, GEMINI_STREAM, is_failure

__all__ = ["ENDPOINTS", "FAILURE_KEYS", "SELECT_MODES", "StubScriptError", "is_failure",
           "load_script"]

SELECT_MODES = ("sequence", "conversation")

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
_SCRIPT_KEYS = frozenset({"model", "select", "rules", "turns", "default"})
_BUILT_KEYS = ("text", "thinking", "tool_use", "stop_reason", "stop_sequence", "usage")
_TURN_KEYS = frozenset(
    {
        *_BUILT_KEYS,
        "message",
        "sse",
        "error",
        "sse_error",
        "drop",
        "delay_ms",
        "event_delay_ms",
        "should_retry",
        "then",
    }
)
_ERROR_KEYS = frozenset({"status", "type", "message", "retry_after", "should_retry", "headers"})
_SSE_ERROR_KEYS = frozenset({"type", "message", "after_events", "status"})
_TOOL_KEYS = frozenset({"name", "input", "id"})
_WHEN_STR_KEYS = ("first_user", "last_user", "last_user_contains", "tool_result_contains")
_WHEN_KEYS = frozenset({"position", "tool_result_is_error", "endpoint", "stream",
                        "previous_response_id", *_WHEN_STR_KEYS})
# The endpoints the stub answers, which a rule's ``when.endpoint`` may name.
ENDPOINTS = ("/v1/messages", "/v1/chat/completions", "/v1/responses", GEMINI_GENERATE,
             GEMINI_STREAM)
# Headers the server sets itself from the body it sends; a script cannot override them.
_FRAMING_HEADERS = frozenset(
    {"content-length", "content-type", "transfer-encoding", "connection", "request-id"}
)
_TOKEN = re.compile(r"[!#$%&'*+.^`|~0-9A-Za-z-]+")


class StubScriptError(ValueError):
    """A stub script is malformed; the message names the bad turn and field."""


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
    if "headers" in err:
        _validate_headers(where, err["headers"])


def _validate_headers(where: str, headers: Any) -> None:
    if not isinstance(headers, dict):
        raise StubScriptError(
            f"{where}: field 'error.headers' must be an object of header names to strings, "
            f"got {headers!r}"
        )
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            raise StubScriptError(f"{where}: 'error.headers' has a bad header name {name!r}")
        if name.lower() in _FRAMING_HEADERS:
            raise StubScriptError(
                f"{where}: 'error.headers' cannot set {name!r}: the server sets it from the "
                "body it sends"
            )
        if not isinstance(value, str) or "\r" in value or "\n" in value:
            raise StubScriptError(
                f"{where}: 'error.headers.{name}' must be a one-line string, got {value!r}"
            )


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
    _validate_recorded(where, turn)


def _validate_recorded(where: str, turn: dict) -> None:
    """Check ``message`` and ``sse``: content as recorded, never mixed with built parts."""
    recorded = [key for key in ("message", "sse") if key in turn]
    if not recorded:
        return
    if len(recorded) > 1:
        raise StubScriptError(f"{where}: fields 'message' and 'sse' cannot be combined")
    key = recorded[0]
    mixed = [k for k in (*_BUILT_KEYS, "sse_error" if key == "sse" else "") if k in turn]
    if mixed:
        raise StubScriptError(
            f"{where}: field {key!r} holds the whole reply; it cannot be combined with "
            f"{', '.join(repr(k) for k in mixed)}"
        )
    if key == "sse":
        sse = turn["sse"]
        if not isinstance(sse, str) or ("event:" not in sse and "data:" not in sse):
            raise StubScriptError(
                f"{where}: field 'sse' must be the text of an event stream ('event: ...' "
                f"or 'data: ...' lines), got {sse!r:.60}"
            )
        return
    message = turn["message"]
    if isinstance(message, dict) and "content" not in message and any(
            isinstance(message.get(k), list) for k in ("choices", "output", "candidates")):
        return  # an OpenAI chat.completion or Responses response, a Gemini response
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        raise StubScriptError(
            f"{where}: field 'message' must be a Messages API message object with a "
            f"'content' list (or an OpenAI chat.completion with 'choices', a Responses "
            f"response with 'output', a Gemini response with 'candidates'), got "
            f"{message!r:.80}"
        )
    for i, block in enumerate(message["content"]):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise StubScriptError(
                f"{where}: 'message.content[{i}]' must be a content block with a 'type'"
            )


def _validate_when(where: str, when: Any) -> None:
    if not isinstance(when, dict):
        raise StubScriptError(
            f"{where}: field 'when' must be an object of conditions, got {when!r}"
        )
    _check_keys(f"{where}: when", when, _WHEN_KEYS)
    if "position" in when:
        _check_non_negative_int(where, "when.position", when["position"])
    for key in _WHEN_STR_KEYS:
        if key in when:
            _check_str(where, f"when.{key}", when[key])
    if "tool_result_is_error" in when and not isinstance(when["tool_result_is_error"], bool):
        raise StubScriptError(f"{where}: field 'when.tool_result_is_error' must be true or false")
    if "stream" in when and not isinstance(when["stream"], bool):
        raise StubScriptError(f"{where}: field 'when.stream' must be true or false")
    if "previous_response_id" in when:
        _check_str(where, "when.previous_response_id", when["previous_response_id"])
    if "endpoint" in when and when["endpoint"] not in ENDPOINTS:
        raise StubScriptError(
            f"{where}: field 'when.endpoint' must be one of {', '.join(ENDPOINTS)}, got "
            f"{when['endpoint']!r}"
        )


def _validate_rule(where: str, rule: Any) -> None:
    if not isinstance(rule, dict):
        raise StubScriptError(f"{where}: must be an object, got {rule!r}")
    if "when" not in rule:
        raise StubScriptError(f"{where}: a rule needs a 'when' object of conditions")
    _validate_when(where, rule["when"])
    _validate_turn(where, {k: v for k, v in rule.items() if k != "when"})
    _validate_then(where, rule, "conversation")


def _validate_then(where: str, turn: dict, select: str) -> None:
    """Check the ``then`` list of a rule or a turn of ``turns`` (and each turn in it)."""
    if "then" not in turn:
        return
    if select != "conversation":
        raise StubScriptError(
            f"{where}: field 'then' needs 'select': 'conversation' (or the turn in 'rules')"
        )
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
    Returns a validated deep copy that always has ``"turns"`` and ``"rules"`` lists.
    Raises :class:`StubScriptError` naming the bad turn (``turn 3``, ``turn 3: then[0]``,
    ``rule 1`` or ``default``) and field.
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
    rules = data.setdefault("rules", [])
    if not isinstance(rules, list):
        raise StubScriptError(f"script: field 'rules' must be a list, got {type(rules).__name__}")
    for index, rule in enumerate(rules):
        _validate_rule(f"rule {index}", rule)
    default = data.get("default")
    if default is not None:
        _validate_turn("default", default)
        if "then" in default:
            raise StubScriptError("default: field 'then' is not allowed on the default turn")
    return data
