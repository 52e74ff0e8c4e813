"""Which answer of a stub script (:mod:`recorder.testing.script`) a request gets.

Everything here is a function of the script and the request alone: its ``messages`` and its
``x-stainless-retry-count`` header, which the anthropic SDK sets on every attempt (0 for the
first, 1 for its first retry, ...). Nothing is remembered between requests, so any number of
runs, forks, resumes and replays of a conversation, in any order and at the same time, get the
same answer at the same place. The one exception is the ``"sequence"`` mode's pointer, which
the server keeps and passes in as ``next_in_sequence``.

A failure answer (``error``, ``sse_error``, ``drop``) followed by a ``then`` list is a retry
sequence: attempt 0 gets the failure, attempt *k* the *k*-th turn of the chain
``[answer, *then]``, except that the first turn of the chain that is not a failure answers every
later attempt. A client that sends no attempt header is always on attempt 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ATTEMPT_HEADER", "FAILURE_KEYS", "attempt", "block_text", "first_user_text",
           "is_failure", "last_user_text", "message_text", "pick", "position", "when_holds"]

ATTEMPT_HEADER = "x-stainless-retry-count"
FAILURE_KEYS = ("error", "sse_error", "drop")


def is_failure(turn: dict) -> bool:
    """Whether ``turn`` fails the request (``error``, ``sse_error`` or ``drop``)."""
    return any(key in turn for key in FAILURE_KEYS)


# ----------------------------------------------------------------------- the request


def block_text(block: Any) -> str:
    """The text of a content block: a text block's text, a tool result's content."""
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        return ""
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "\n".join(t for t in (block_text(b) for b in content) if t)
    return ""


def message_text(message: Any) -> str:
    """The text of a message: its string content, or its blocks' texts joined by newlines."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(t for t in (block_text(b) for b in content) if t)
    return ""


def _user_messages(body: Mapping[str, Any]) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    return [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]


def first_user_text(body: Mapping[str, Any]) -> str:
    """The text of the conversation's first user message (its task)."""
    users = _user_messages(body)
    return message_text(users[0]) if users else ""


def last_user_text(body: Mapping[str, Any]) -> str:
    """The text of the last user message (a trailing assistant prefill is skipped)."""
    users = _user_messages(body)
    return message_text(users[-1]) if users else ""


def position(body: Mapping[str, Any]) -> int:
    """A request's place in its conversation: how many assistant messages it carries."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def _tool_results(body: Mapping[str, Any]) -> list[dict]:
    """The ``tool_result`` blocks of the last user message."""
    users = _user_messages(body)
    content = users[-1].get("content") if users else None
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]


def attempt(headers: Mapping[str, str]) -> int:
    """The attempt number the client sent (0 when it sent none or something else)."""
    raw = headers.get(ATTEMPT_HEADER, "0").strip()
    return int(raw) if raw.isdigit() else 0


# ----------------------------------------------------------------------- choosing


def when_holds(when: Mapping[str, Any], body: Mapping[str, Any]) -> bool:
    """Whether every condition of a rule's ``when`` holds for the request ``body``."""
    if "position" in when and position(body) != when["position"]:
        return False
    if "first_user" in when and first_user_text(body) != when["first_user"]:
        return False
    if "last_user" in when and last_user_text(body) != when["last_user"]:
        return False
    if "last_user_contains" in when and when["last_user_contains"] not in last_user_text(body):
        return False
    results = _tool_results(body)
    if "tool_result_contains" in when:
        needle = when["tool_result_contains"]
        if not any(needle in block_text(r) for r in results):
            return False
    if "tool_result_is_error" in when:
        errors = [r.get("is_error") is True for r in results]
        if not errors or any(errors) != when["tool_result_is_error"]:
            return False
    return True


def _in_chain(answer: dict, attempt_number: int) -> dict | None:
    """The turn of ``[answer, *then]`` for an attempt; ``None`` when the chain is used up."""
    chain = [answer, *answer.get("then", ())]
    for index, turn in enumerate(chain):
        if index == attempt_number or not is_failure(turn):
            return turn
    return None


def pick(script: Mapping[str, Any], body: Mapping[str, Any], attempt_number: int,
         next_in_sequence: Callable[[], dict | None]) -> dict | None:
    """The turn answering a valid request; ``None`` when nothing in the script answers it.

    The first rule whose ``when`` holds answers; else, by ``select``, the turn at the request's
    position (``"conversation"``) or the next turn of the sequence; else ``default``.
    """
    for rule in script.get("rules", ()):
        if when_holds(rule["when"], body):
            return _in_chain(rule, attempt_number) or script.get("default")
    if script.get("select") == "conversation":
        turns = script["turns"]
        at = position(body)
        if at < len(turns):
            return _in_chain(turns[at], attempt_number) or script.get("default")
        return script.get("default")
    turn = next_in_sequence()
    return turn if turn is not None else script.get("default")
