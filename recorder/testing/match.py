"""Which answer of a stub script (:mod:`recorder.testing.script`) a request gets.

Everything here is a function of the script and the request alone: its endpoint, its
conversation and its ``x-stainless-retry-count`` header, which the anthropic and openai SDKs
set on every attempt (0 for the first, 1 for its first retry, ...). A conversation is read
the same way whichever API asks (:func:`conversation`): an Anthropic ``messages`` list as it
is; an OpenAI Chat Completions ``messages`` list with its ``tool`` messages as the
``tool_result`` blocks of a user message (``system`` and ``developer`` messages are not
turns); a Responses API ``input`` (a string, or items: messages, ``function_call`` items as
the assistant's, and ``function_call_output`` items as tool results), continued from the
position a stub reply's id records when the request names it as ``previous_response_id``;
a Gemini ``contents`` list (``model`` turns as the assistant's, ``functionCall`` parts as
tool uses, ``functionResponse`` parts as tool results of their response's JSON text).

Nothing is remembered between requests, so any number of runs, forks, resumes and replays of
a conversation, in any order and at the same time, get the same answer at the same place. The
one exception is the ``"sequence"`` mode's pointer, which the server keeps and passes in as
``next_in_sequence``.

A failure answer (``error``, ``sse_error``, ``drop``) followed by a ``then`` list is a retry
sequence: attempt 0 gets the failure, attempt *k* the *k*-th turn of the chain
``[answer, *then]``, except that the first turn of the chain that is not a failure answers every
later attempt. A client that sends no attempt header is always on attempt 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ATTEMPT_HEADER", "FAILURE_KEYS", "GEMINI_GENERATE", "GEMINI_STREAM",
           "RESPONSE_ID_PREFIX", "attempt", "block_text", "conversation", "first_user_text",
           "is_failure", "last_user_text", "message_text", "pick", "position",
           "response_id_position", "streams", "when_holds"]

ATTEMPT_HEADER = "x-stainless-retry-count"
# Gemini's endpoints, by the end of their path (``.../models/{model}:generateContent``).
GEMINI_GENERATE = ":generateContent"
GEMINI_STREAM = ":streamGenerateContent"
FAILURE_KEYS = ("error", "sse_error", "drop")
# A stub Responses reply's id, ``resp_<position>_<random>``: the position it answered, so
# that a request continuing it by ``previous_response_id`` has its place with no memory.
RESPONSE_ID_PREFIX = "resp_"


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
    if kind in ("text", "input_text", "output_text"):
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


def _add(turns: list[dict], role: str, content: Any) -> None:
    """Append to ``turns``, merging into the last turn when it has the same role."""
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else \
        [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": blocks})


def _chat_turns(messages: list) -> list[dict]:
    turns: list[dict] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if role == "tool":
            _add(turns, "user", [{"type": "tool_result", "tool_use_id": m.get("tool_call_id"),
                                  "content": m.get("content")}])
        elif role in ("user", "assistant"):
            _add(turns, role, m.get("content"))
    return turns


def _input_turns(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": [{"type": "text", "text": items}]}]
    turns: list[dict] = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        kind, role = item.get("type"), item.get("role")
        if kind == "function_call_output":
            _add(turns, "user", [{"type": "tool_result", "tool_use_id": item.get("call_id"),
                                  "content": item.get("output")}])
        elif role == "user":
            _add(turns, "user", item.get("content"))
        elif role == "assistant" or kind in ("function_call", "reasoning"):
            _add(turns, "assistant", item.get("content") if kind in (None, "message") else [])
    return turns


def _gemini_block(part: Any) -> dict | None:
    """A Gemini part as a content block: text, a ``functionCall`` as ``tool_use``, a
    ``functionResponse`` as a ``tool_result`` of its response's JSON text (a thought, or
    a part of another kind, is no block)."""
    if not isinstance(part, dict) or part.get("thought"):
        return None
    if isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    call = part.get("functionCall")
    if isinstance(call, dict):
        return {"type": "tool_use", "id": call.get("id"), "name": call.get("name"),
                "input": call.get("args")}
    result = part.get("functionResponse")
    if isinstance(result, dict):
        response = result.get("response")
        return {"type": "tool_result", "tool_use_id": result.get("id") or result.get("name"),
                "content": response if isinstance(response, str) else
                json.dumps(response, ensure_ascii=False)}
    return None


def _gemini_turns(contents: list) -> list[dict]:
    turns: list[dict] = []
    for content in contents:
        if not isinstance(content, dict):
            continue
        parts = content.get("parts")
        blocks = [b for b in map(_gemini_block, parts if isinstance(parts, list) else [])
                  if b is not None]
        _add(turns, "assistant" if content.get("role") == "model" else "user", blocks)
    return turns


def conversation(body: Mapping[str, Any]) -> list[dict]:
    """The request's conversation as user and assistant messages of content blocks (tool
    results as ``tool_result`` blocks), whichever API it is in; Anthropic messages are
    returned as they are."""
    if isinstance(body.get("contents"), list) and "messages" not in body:
        return _gemini_turns(body["contents"])
    messages = body.get("messages")
    if isinstance(messages, list):
        if any(isinstance(m, dict) and (m.get("role") not in ("user", "assistant")
                                        or "tool_calls" in m) for m in messages):
            return _chat_turns(messages)
        return [m for m in messages if isinstance(m, dict)]
    if "input" in body:
        return _input_turns(body.get("input"))
    return []


def response_id_position(response_id: Any) -> int | None:
    """The position a stub Responses reply answered, read from its id (None: not one)."""
    if not isinstance(response_id, str) or not response_id.startswith(RESPONSE_ID_PREFIX):
        return None
    head = response_id[len(RESPONSE_ID_PREFIX):].partition("_")[0]
    return int(head) if head.isdigit() else None


def _user_messages(body: Mapping[str, Any]) -> list[dict]:
    return [m for m in conversation(body) if m.get("role") == "user"]


def first_user_text(body: Mapping[str, Any]) -> str:
    """The text of the conversation's first user message (its task)."""
    users = _user_messages(body)
    return message_text(users[0]) if users else ""


def last_user_text(body: Mapping[str, Any]) -> str:
    """The text of the last user message (a trailing assistant prefill is skipped)."""
    users = _user_messages(body)
    return message_text(users[-1]) if users else ""


def position(body: Mapping[str, Any]) -> int:
    """A request's place in its conversation: how many assistant messages it carries (and,
    continuing a stub Responses reply, how many came before that reply, and the reply)."""
    before = response_id_position(body.get("previous_response_id"))
    here = sum(1 for m in conversation(body) if m.get("role") == "assistant")
    return here + (before + 1 if before is not None else 0)


def _tool_results(body: Mapping[str, Any]) -> list[dict]:
    """The ``tool_result`` blocks of the last user message."""
    users = _user_messages(body)
    content = users[-1].get("content") if users else None
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]


def streams(body: Mapping[str, Any], endpoint: str | None = None) -> bool:
    """Does the request ask for a stream? Its body says (``"stream": true``), or for
    Gemini its endpoint (``:streamGenerateContent``)."""
    return body.get("stream") is True or endpoint == GEMINI_STREAM


def attempt(headers: Mapping[str, str]) -> int:
    """The attempt number the client sent (0 when it sent none or something else)."""
    raw = headers.get(ATTEMPT_HEADER, "0").strip()
    return int(raw) if raw.isdigit() else 0


# ----------------------------------------------------------------------- choosing


def when_holds(when: Mapping[str, Any], body: Mapping[str, Any],
               endpoint: str | None = None) -> bool:
    """Whether every condition of a rule's ``when`` holds for the request ``body`` sent to
    ``endpoint`` (its path, e.g. ``/v1/responses``; None: not known, and a rule that names
    one does not hold)."""
    if "endpoint" in when and endpoint != when["endpoint"]:
        return False
    if "stream" in when and streams(body, endpoint) != when["stream"]:
        return False
    if "previous_response_id" in when and \
            body.get("previous_response_id") != when["previous_response_id"]:
        return False
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
         next_in_sequence: Callable[[], dict | None],
         endpoint: str | None = None) -> dict | None:
    """The turn answering a valid request (sent to ``endpoint``); ``None`` when nothing in
    the script answers it.

    The first rule whose ``when`` holds answers; else, by ``select``, the turn at the request's
    position (``"conversation"``) or the next turn of the sequence; else ``default``.
    """
    for rule in script.get("rules", ()):
        if when_holds(rule["when"], body, endpoint):
            return _in_chain(rule, attempt_number) or script.get("default")
    if script.get("select") == "conversation":
        turns = script["turns"]
        at = position(body)
        if at < len(turns):
            return _in_chain(turns[at], attempt_number) or script.get("default")
        return script.get("default")
    turn = next_in_sequence()
    return turn if turn is not None else script.get("default")
