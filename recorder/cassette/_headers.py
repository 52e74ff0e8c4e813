"""A model line's response headers as the edits that make them from an earlier line's.

Most response headers repeat from one call to the next (the server, the content type, the
organisation and the rate limits), and a few change every call (the request id, the date,
the length). A line stores what differs, as a list of edits applied in order to the
headers of the line it names (its ``headers_base``, or its ``like``), a cursor moving
through them:

- a number n >= 0: the next n headers, as they are;
- a number -n < 0: the next n headers are left out;
- a string: the next header with this value (its name kept);
- a ``[name, value]`` pair: a header that is not there, put in here.

The headers after the last edit are kept as they are. The list starts with a number (0 if
need be), which tells it from the older form: a list as long as the base's, ``null`` for a
header that is the same (:func:`is_edits`). Header order and repeated names are kept
exactly.
"""

from __future__ import annotations

from typing import Any

from recorder import _fastjson

Pair = list[str]


def is_edits(headers: Any) -> bool:
    """Is a stored ``headers`` list edits (rather than the older same-length form)?"""
    return (isinstance(headers, list) and bool(headers) and isinstance(headers[0], int)
            and not isinstance(headers[0], bool))


def edits(base: list[Pair], headers: list[Pair]) -> list[Any]:
    """The edits that make ``headers`` from ``base``."""
    out: list[Any] = []
    copied = at = 0
    for name, value in headers:
        if at >= len(base) or base[at][0] != name:
            found = _next(base, at, name)
            if found is None:
                copied = _flush(out, copied)
                out.append([name, value])
                continue
            copied = _flush(out, copied)
            out.append(at - found)
            at = found
        if base[at][1] == value:
            copied += 1
        else:
            copied = _flush(out, copied)
            out.append(value)
        at += 1
    if at < len(base):
        _flush(out, copied)
        out.append(at - len(base))
    if not out or not is_edits(out):
        out.insert(0, 0)
    return out


def _next(base: list[Pair], start: int, name: str) -> int | None:
    """The first header named ``name`` in ``base`` from ``start`` on."""
    for index in range(start, len(base)):
        if base[index][0] == name:
            return index
    return None


def _flush(out: list[Any], copied: int) -> int:
    if copied:
        out.append(copied)
    return 0


def applied(base: list[Pair], script: list[Any]) -> list[Pair]:
    """The headers ``script`` makes from ``base`` (a ``ValueError`` when it does not fit
    them: a base that is not the one it was made against)."""
    out: list[Pair] = []
    at = 0
    for step in script:
        if isinstance(step, bool):
            raise ValueError("a header edit is not true or false")
        if isinstance(step, int):
            if step >= 0:
                out.extend(base[at:at + step])
            at += abs(step)
        elif isinstance(step, str):
            if at >= len(base):
                raise ValueError("a header edit names a header its base does not have")
            out.append([base[at][0], step])
            at += 1
        else:
            out.append(step)
        if at > len(base):
            raise ValueError("the header edits go past their base's headers")
    out.extend(base[at:])
    return out


def gives(base: list[Pair], script: list[Any], headers: list[Pair]) -> bool:
    """Does ``script`` make exactly ``headers`` from ``base``? (The writer checks before it
    stores edits, so that a reader rebuilds what was received.)"""
    try:
        return applied(base, script) == headers
    except (ValueError, IndexError, TypeError):
        return False


def size(script: list[Any]) -> int:
    """What ``script`` costs on disk, in bytes."""
    return len(_fastjson.dumps_compact_fast(script))
