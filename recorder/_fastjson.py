"""orjson on the hot paths of replay and recording, where it gives exactly what the
standard library gives.

A replay parses each line it serves again and writes a JSON response body back as the
text received (:func:`recorder.cassette.compact.restore_body`); a recording reads each
model response body for its usage and keeps it as JSON when its compact form is its text.
These steps are much of what deja adds to a call, and orjson does each several times
faster than :mod:`json`:

- **Parsing** a line the loader has already checked: for every document both read, orjson
  and :mod:`json` give equal values (keys in order, the last of a duplicated key, floats
  rounded the same), but for an integer beyond 64 bits, which orjson reads as a float: a
  line with 19 digits in a row anywhere is read by :mod:`json`. What orjson refuses
  (``NaN``, an infinity, an escaped lone surrogate, very deep nesting) is read by
  :mod:`json` too. A response body read for its usage (:func:`loads_utf8`) that has more
  than a few hundred brackets is read by :mod:`json` as well: :mod:`json` may find it too
  deep where orjson does not (a cassette's lines are checked for depth as they load). So
  is a stream's event (:func:`loads_text`).
- **Writing** a body back: orjson's compact output is :func:`compact.json_text`'s, byte for
  byte, for every character and integer, and for every float but those between 1e-5 and
  1e-10 (``1e-05`` in :mod:`json`, ``0.00001`` in orjson). However a line writes such a
  float (deja writes ``1e-05``; a ``deja/1`` line, signed as parsed, may say ``1e-5`` or
  ``0.00001``), its bytes hold a digit followed by ``e-`` or ``E-``, or ``0.0000``: such a
  line, and one orjson did not read itself (an infinity or ``NaN`` from :mod:`json`), is
  written by :mod:`json`.

- **Depth**: a cassette's reader refuses a line nested deeper than :data:`LINE_DEPTH`
  levels (its readers recurse), so the recorder keeps every line within it. Counting
  brackets bounds the depth of a text from above at C speed; when the count is higher,
  :func:`nests_deeper` has orjson write the document inside enough lists to reach its own
  limit, which it refuses to pass (a document orjson cannot write for another reason is
  walked instead), and :func:`text_nests_deeper` has orjson read the text first.

``tests/replayer/test_fastjson.py`` checks these claims over every character and hundreds
of thousands of floats, against the orjson installed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

_SMALL_DECIMAL = b"0.0000"
_EXPONENTS = (b"e-", b"E-")
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_MAY_NOT_FIT_64_BITS = b"0" * 19  # 19 digits in a row, once every digit reads 0
# A text with at most this many brackets is nested too shallow for the json module to run
# out of stack reading it from any call stack less than 500 frames deep (orjson reads
# 1,024 levels; json, on Python 3.11, as many as the recursion limit leaves it).
SHALLOW = 400
UNDECIDED = object()  # :func:`compact_doc`: orjson cannot tell, json must


def _fits_64_bits(data: bytes) -> bool:
    """No 19 digits in a row: every integer ``data`` holds fits 64 bits."""
    return _MAY_NOT_FIT_64_BITS not in data.translate(_DIGITS_AS_ZERO)


def read(data: bytes) -> tuple[Any, bool]:
    """``json.loads(data)``, faster; and whether orjson read it."""
    doc = orjson_read(data)
    if doc is not UNDECIDED:
        return doc, True
    return json.loads(data), False


def orjson_read(data: bytes) -> Any:
    """``data`` read by orjson where that gives what :mod:`json` gives of its UTF-8 text
    (see the module), else :data:`UNDECIDED`: :mod:`json` must read it (or refuse it:
    orjson refuses what is not UTF-8, as decoding does)."""
    if _fits_64_bits(data):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return UNDECIDED


def _shallow(data: bytes) -> bool:
    """At most :data:`SHALLOW` brackets: nested less deep than :mod:`json` reads."""
    return data.count(b"[") + data.count(b"{") <= SHALLOW


def loads_utf8(data: bytes, text: str) -> Any:
    """``json.loads(text)`` of ``text``, the UTF-8 decoding of ``data``, faster (a body
    :mod:`json` may find too deep, as :mod:`json` reads it)."""
    if isinstance(data, bytes) and _fits_64_bits(data) and _shallow(data):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


def loads(data: bytes) -> Any:
    """``json.loads(data)``, faster."""
    return read(data)[0]


def parts_reader(whole: str) -> Callable[[str], Any]:
    """:func:`loads_text` for texts cut out of ``whole`` (a stream's events, joined
    lines of it), with what it checks of each checked once of ``whole`` where it can be:
    a part has no lone surrogate nor an integer beyond 64 bits that ``whole`` does not.
    A part :mod:`json` may find too deep is read by :mod:`json`, as in :func:`loads_utf8`."""
    try:
        data = whole.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, which json reads and orjson does not
        return json.loads
    if not _fits_64_bits(data):
        return json.loads

    def read(part: str) -> Any:
        if part.count("[") + part.count("{") <= SHALLOW:
            try:
                return orjson.loads(part)
            except orjson.JSONDecodeError:
                pass
        return json.loads(part)

    return read


def loads_text(text: str) -> Any:
    """``json.loads(text)``, faster (a stream's events are read one by one, most of them
    small); a text :mod:`json` may find too deep is read by :mod:`json`, as in
    :func:`loads_utf8`."""
    return parts_reader(text)(text)


def exact_for(data: bytes, start: int = 0, end: int | None = None) -> bool:
    """Whether no float below 1e-4 is written in ``data[start:end]`` (then orjson writes
    what :func:`dumps_compact` writes for every document orjson read from it)."""
    end = len(data) if end is None else end
    if data.find(_SMALL_DECIMAL, start, end) >= 0:
        return False
    for marker in _EXPONENTS:  # a number's exponent follows a digit; a word's hyphen, not
        at = data.find(marker, start, end)
        while at >= 0:
            if at > start and 0x30 <= data[at - 1] <= 0x39:
                return False
            at = data.find(marker, at + 2, end)
    return True


def compact_doc(text: str, depth: int | None = None) -> Any:
    """The document ``text`` holds when :func:`dumps_compact` of it gives ``text`` back
    exactly (and, with ``depth``, it nests at most ``depth`` levels deep), else None;
    :data:`UNDECIDED` when orjson cannot tell (not JSON it reads, a small float, a large
    integer): :mod:`json` then decides."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return UNDECIDED
    if not (exact_for(data) and _fits_64_bits(data)):
        return UNDECIDED
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return UNDECIDED
    pad = 0
    if depth is not None and openers(data) > depth:
        if depth < _DUMPS_DEPTH:  # checked as it is written: within ``pad`` lists orjson
            pad = _DUMPS_DEPTH - depth  # stops past ``depth``
        elif nests_deeper(doc, depth):
            return None
    try:
        again = orjson.dumps(_chain(pad, doc))[pad:-pad] if pad else orjson.dumps(doc)
    except TypeError as exc:  # orjson refuses to nest 255 levels: json decides then
        return None if pad and str(exc) == _TOO_DEEP else UNDECIDED
    return doc if again == data else None


def dumps_compact(doc: Any) -> str:
    """JSON text without spaces, non-ASCII kept (:func:`compact.json_text`)."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def dumps_compact_fast(doc: Any) -> str:
    """:func:`dumps_compact`, by orjson, for a document :func:`exact_for` vouched for
    (an integer beyond 64 bits, which orjson refuses, goes to :mod:`json`)."""
    try:
        return orjson.dumps(doc).decode()
    except TypeError:
        return dumps_compact(doc)


# -- depth

LINE_DEPTH = 200  # the deepest line a cassette's reader takes: deja's own lines nest a dozen
BODY_DEPTH = LINE_DEPTH - 10  # a request, response or value a line holds a few levels down


def openers(text: bytes | str) -> int:
    """How many ``[`` and ``{`` ``text`` holds, in strings or not: JSON text nests no deeper."""
    if isinstance(text, str):
        return text.count("[") + text.count("{")
    return text.count(b"[") + text.count(b"{")


def _chain(depth: int, inner: Any = None) -> Any:
    """``inner`` within ``depth`` lists (an empty list when None: ``depth`` levels)."""
    doc: Any = [] if inner is None else [inner]
    for _ in range(depth - 1):
        doc = [doc]
    return doc


def _dumps_limit() -> tuple[int, str]:
    """The deepest document this orjson writes, and its message for a deeper one; (0, "")
    when it writes any depth tried."""
    lo, hi = 1, 4096  # orjson writes ``lo`` levels, and not ``hi``
    try:
        orjson.dumps(_chain(hi))
        return 0, ""
    except TypeError as exc:
        message = str(exc)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            orjson.dumps(_chain(mid))
            lo = mid
        except TypeError:
            hi = mid
    return lo, message


_DUMPS_DEPTH, _TOO_DEEP = _dumps_limit()


def nests_deeper(doc: Any, limit: int) -> bool:
    """Whether ``doc``, JSON as parsed (lists, dicts and plain values), nests more than
    ``limit`` levels deep, its outermost list or dict the first. (orjson writes a tuple as
    a list but does not count it as a level: a tuple is no JSON a parser gives.)"""
    if 0 < limit < _DUMPS_DEPTH:
        try:
            orjson.dumps(_chain(_DUMPS_DEPTH - limit, doc))
            return False
        except TypeError as exc:  # orjson.JSONEncodeError
            if str(exc) == _TOO_DEEP:
                return True
    return _walk_deeper(doc, limit)  # an integer beyond 64 bits, a key not a string, ...


def text_nests_deeper(text: bytes, limit: int) -> bool:
    """Whether JSON text nests more than ``limit`` levels deep, checked before anything
    that recurses reads it: the bracket count, else orjson's reader (which stops on its
    own 1,024 levels down, where the json module's recursion is bounded only by the
    interpreter's limit and the C stack), else, for text orjson refuses (``NaN``, a lone
    surrogate escape), a walk of its bytes. (orjson's 1,024 levels take about 100 KB of C
    stack: a thread needs more than that, as it does for the json module's own limit.)"""
    if openers(text) <= limit:
        return False
    try:
        return nests_deeper(orjson.loads(text), limit)
    except orjson.JSONDecodeError as exc:
        if exc.msg == _TOO_DEEP_TO_READ:
            return True
    return _text_depth(text) > limit


_TOO_DEEP_TO_READ = "depth limit exceeded"  # orjson's message past its 1,024 levels


def _text_depth(text: bytes) -> int:
    """The nesting depth of JSON text, byte by byte (brackets in strings not counted)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _walk_deeper(doc: Any, limit: int) -> bool:
    stack = [(doc, 1)] if isinstance(doc, (dict, list, tuple)) else []
    while stack:
        node, depth = stack.pop()
        items = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((item, depth + 1) for item in items
                     if isinstance(item, (dict, list, tuple)))
    return False
