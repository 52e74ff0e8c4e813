"""The form in which an agent sends a response's items back: the same items, their objects'
keys in another order.

An SDK sends back the answer it parsed in its own field order, not the order the API wrote
it in (the anthropic SDK writes a text block ``{"text", "type"}`` where the API wrote
``{"type", "text"}``; the openai SDK puts a chat message's ``content`` before its
``role``), and it may write a field the answer left out as ``null``, or leave out one the
answer gave as ``null``. What it sends is still that answer. A *shape* says how: a table
from the keys of an object of the answer, in their order, to the keys of the object sent,
in theirs (a key the answer lacks is ``null``; a key left out is dropped). It is the same
for every answer of a run, so a cassette stores it once and later requests refer to it.

On disk a shape is a list of ``[keys of the answer, keys as sent]`` pairs; an object whose
keys no pair names is sent as it is. A shape is used only when it gives back the JSON text
that was sent, byte for byte (:func:`fits`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

Shape = dict[tuple[str, ...], tuple[str, ...]]


def learn(answer: Any, sent: Any) -> Shape | None:
    """The shape that turns ``answer`` into ``sent`` (None: ``sent`` is not ``answer``
    with its keys reordered, or ``null`` fields added or left out). Every object's key
    order is kept, the ones sent as they are too, so that two objects with the same keys
    sent in two orders are found out (no shape says both)."""
    shape: Shape = {}
    return shape if _walk(answer, sent, shape) else None


def _walk(answer: Any, sent: Any, shape: Shape) -> bool:
    if isinstance(answer, dict):
        if not isinstance(sent, dict):
            return False
        if any(k not in answer and v is not None for k, v in sent.items()) or any(
                k not in sent and v is not None for k, v in answer.items()):
            return False
        keys, order = tuple(answer), tuple(sent)
        if shape.setdefault(keys, order) != order:
            return False
        return all(_walk(answer[k], sent[k], shape) for k in order if k in answer)
    if isinstance(answer, list):
        return (isinstance(sent, list) and len(answer) == len(sent)
                and all(_walk(a, s, shape) for a, s in zip(answer, sent, strict=True)))
    return True  # a scalar: the text comparison (fits) checks it


def merged(earlier: Shape | None, learned: Shape) -> Shape:
    """``learned`` and what ``earlier`` says besides (where they agree or it says more),
    without the objects sent as they are: a run's shape grows as it meets new objects."""
    out = {k: v for k, v in (earlier or {}).items() if learned.get(k, v) == v}
    out.update(learned)
    return {k: v for k, v in out.items() if k != v}


def apply(value: Any, shape: Shape) -> Any:
    """``value`` in ``shape``'s form."""
    if isinstance(value, dict):
        order = shape.get(tuple(value))
        if order is None:
            return {k: apply(v, shape) for k, v in value.items()}
        return {k: apply(value[k], shape) if k in value else None for k in order}
    if isinstance(value, list):
        return [apply(v, shape) for v in value]
    return value


def fits(answer: Any, shape: Shape, sent_text: str) -> bool:
    """Does ``answer`` in ``shape``'s form have exactly the JSON text ``sent_text``?"""
    try:
        return text(apply(answer, shape)) == sent_text
    except (ValueError, TypeError, RecursionError):
        return False


def text(value: Any) -> str:
    """Compact JSON text, as the cassette compares items."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def stored(shape: Shape) -> list[list[list[str]]]:
    """A shape as a cassette line holds it."""
    return [[list(keys), list(order)] for keys, order in shape.items()]


def loaded(pairs: Any) -> Shape:
    """A shape from a cassette line (a ``ValueError`` for anything else)."""
    if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(_keys(k) for k in p) for p in pairs):
        raise ValueError("a shape is a list of [keys, keys] pairs")
    return {tuple(keys): tuple(order) for keys, order in pairs}


def _keys(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(k, str) for k in value)


def of(items: Any, shapes: Mapping[int, Shape]) -> Shape:
    """Reader side: the shape a stored delta names, inline (``"shape": [...]``) or as the
    seq of the line that holds it (``"shape": 7``)."""
    return shapes[items] if isinstance(items, int) else loaded(items)
