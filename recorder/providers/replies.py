"""What a model response gives its conversation: the items an agent sends back after it.

An agent's next request repeats the response it got, as items of its history list: the
Messages API's assistant message, Chat Completions' ``choices[0].message``, every item of a
Responses ``output``, Gemini's ``candidates[0].content``. A cassette stores such a request
as a reference to the response (:mod:`recorder.cassette._delta`), so the rule that says
which items a response gives is part of the cassette format: it reads the response body
alone (never the URL or the provider a line names), and it never changes for a shape it
already reads. Shapes are tried in this order:

1. a body whose ``type`` is ``"message"`` with a ``role`` and a list ``content``: one item,
   ``{"role", "content"}`` (the Messages API; the only shape ``deja/2`` read before);
2. a body with a list ``choices`` whose first holds a ``message`` object: that message;
3. a body whose ``object`` is ``"response"`` with a list ``output``: its items;
4. a body with a list ``candidates`` whose first holds a ``content`` object: that content.
"""

from __future__ import annotations

from typing import Any

__all__ = ["replied"]


def replied(doc: Any) -> list[Any] | None:
    """The items response body ``doc`` (parsed JSON, or a stream assembled into its
    message) gives its conversation, in order; None when it is none of the shapes above."""
    if not isinstance(doc, dict):
        return None
    if doc.get("type") == "message":
        role, content = doc.get("role"), doc.get("content")
        if isinstance(role, str) and isinstance(content, list):
            return [{"role": role, "content": content}]
        return None
    first = _first(doc.get("choices"))
    if first is not None:
        message = first.get("message")
        return [message] if isinstance(message, dict) else None
    if doc.get("object") == "response":
        output = doc.get("output")
        return list(output) if isinstance(output, list) and output else None
    first = _first(doc.get("candidates"))
    if first is not None:
        content = first.get("content")
        return [content] if isinstance(content, dict) else None
    return None


def _first(items: Any) -> dict[str, Any] | None:
    """The first item of a list, when it is an object."""
    if isinstance(items, list) and items and isinstance(items[0], dict):
        return items[0]
    return None
