"""Parsing and shape checks for cassette lines read from disk.

Python's ``json`` accepts more than deja ever writes: ``NaN`` and ``Infinity``, lone
surrogates in strings (which cannot be encoded back to UTF-8, so no signature can be
computed over them), nesting deep enough to exhaust the interpreter's stack, a key twice
in one object (Python keeps the last value and other readers the first, so a second value
rides along outside the signature), and any type in any field. A cassette is untrusted
input, so each line is parsed strictly and the fields that readers rely on are checked for
type before anything else looks at them: a file that breaks a rule is refused with
:class:`CorruptCassette` naming the line, never with a traceback from deep inside a reader.
"""

from __future__ import annotations

import binascii
import json
import re
from pathlib import Path
from typing import Any

from recorder._fastjson import LINE_DEPTH, UNDECIDED, orjson_read, text_nests_deeper
from recorder.cassette import _headers
from recorder.cassette.format import FEATURES
from recorder.cassette.schema import Kind
from recorder.errors import CorruptCassette, UnsupportedFormat

MAX_DEPTH = LINE_DEPTH  # the recorder keeps bodies and values within it

_OPTIONAL = type(None)
_NUMBER = (int, float)
_MAYBE_NUMBER = (int, float, _OPTIONAL)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON deja writes")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        keys = [k for k, _ in pairs]
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"key {twice!r} appears twice in one object; deja never writes that")
    return obj


_DECODER = json.JSONDecoder(parse_constant=_no_constants, object_pairs_hook=_no_duplicates)


_TOO_DEEP = f"nests deeper than {MAX_DEPTH} levels; deja never writes such a line"


class BadLine(ValueError):
    """Why a line cannot be read, as the end of a sentence that names the line."""


def decode(raw: bytes) -> Any:
    """One line as JSON, strictly; :class:`BadLine` says why not (``is not UTF-8 ...``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLine(f"is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if text_nests_deeper(raw, MAX_DEPTH):  # before json, which recurses on the C stack
        raise BadLine(_TOO_DEEP)
    try:
        doc = _DECODER.decode(text)
    except RecursionError:
        raise BadLine(_TOO_DEEP) from None
    except ValueError as exc:
        raise BadLine(f"is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text) and _lone_surrogate(doc):
        raise BadLine("holds a lone surrogate in a string (\\udXXX with no pair), which is "
                      "no text: deja never writes one")
    return doc


# \ud800-\udfff written as an escape: the only way a surrogate gets into valid UTF-8 JSON
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(doc: Any) -> bool:
    """A string in ``doc`` (a key or a value) that is no UTF-8 text: a surrogate the
    escape after it does not pair."""
    stack = [doc]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def decode_trusted(raw: bytes, path: Path, where: str, seq: int | None) -> Any:
    """A line whose signature holds (bytes deja's writer made: UTF-8, strict JSON, no key
    twice): parsed by orjson, which refuses ``NaN`` and a lone surrogate as the strict
    decoder does (a key twice it reads as :mod:`json` does, the last one kept). A line
    orjson is not given (one with a run of digits that may be an integer beyond 64 bits,
    which a tool's result may hold) or does not read goes through the strict decoder, as
    a line that does not verify does: a signature is only as sound as the key."""
    if text_nests_deeper(raw, MAX_DEPTH):
        return parse_line(raw, path, where, seq)
    doc = orjson_read(raw)  # json's reading of it, faster
    if doc is not UNDECIDED:
        return doc
    return parse_line(raw, path, where, seq)


def parse_line(raw: bytes, path: Path, where: str, seq: int | None) -> Any:
    """One line as JSON, strictly: refused with CorruptCassette naming ``where``."""
    try:
        return decode(raw)
    except BadLine as exc:
        raise CorruptCassette(f"{path}: {where} {exc}", path=path, seq=seq) from None


# The header fields readers use, with the types deja writes.
_HEADER = {
    "run": (str,), "created": (str, _OPTIONAL), "argv": (list, _OPTIONAL),
    "cwd": (str, _OPTIONAL), "cassette": (str, _OPTIONAL), "entry": (str, _OPTIONAL),
    "labels": (dict, _OPTIONAL),
    "parent": (dict, _OPTIONAL), "key_id": (str,), "fsync": (str, _OPTIONAL),
    "redact": (dict, _OPTIONAL), "budgets": (dict, _OPTIONAL), "loop": (dict, _OPTIONAL),
    "breaker": (dict, _OPTIONAL), "versions": (dict, _OPTIONAL), "features": (list,),
}

# Per kind: fields every line of that kind has, and fields that have a type when present.
_COMMON = {"fp": (str,), "t": _MAYBE_NUMBER, "ms": _MAYBE_NUMBER, "within": (str,),
           "call": (str,),
           "error": (dict, _OPTIONAL), "cost_usd": _MAYBE_NUMBER,
           "usage": (dict, _OPTIONAL), "edited": (bool,)}
_Fields = dict[str, tuple[type, ...]]
_REQUIRED: dict[str, _Fields] = {
    Kind.MODEL: {"request": (dict,)},
    Kind.HTTP: {"method": (str,), "url": (str,), "request": (dict,)},
    Kind.TOOL: {"name": (str,)},
    Kind.MCP: {"mcp": (dict,)},
    Kind.INTENT: {"name": (str,)},
    Kind.OUTCOME: {"name": (str,), "intent": (int,), "key": (str,)},
    Kind.EFFECT: {"name": (str,)},
    Kind.CONTROL: {"event": (str,)},
    Kind.END: {"status": (str,)},
}
_OPTIONAL_BY_KIND: dict[str, _Fields] = {
    Kind.MODEL: {"url": (str, int), "request_headers": (list, int), "provider": (str,),
                 "response": (dict,), "like": (int,), "sent": (str,)},
    Kind.HTTP: {"response": (dict,)},
    Kind.TOOL: {"observed": (str,), "call_id": (str,), "is_error": (bool,), "mcp": (dict,)},
    Kind.MCP: {"params": (dict,)},
    Kind.CONTROL: {"detail": (dict, _OPTIONAL)},
    Kind.END: {"totals": (dict, _OPTIONAL), "reason": (str, _OPTIONAL),
               "exit_code": (int, _OPTIONAL)},
}
# every field of a kind that has a type, required or not: one lookup a field
_TYPES_OF = {kind: {**_COMMON, **_OPTIONAL_BY_KIND.get(kind, {}), **required}
             for kind, required in _REQUIRED.items()}
_MCP_PART: tuple[_Fields, _Fields] = ({"server": (dict,), "method": (str,)},
                                       {"notifications": (list,), "destructive": (bool,)})
_MCP_SERVER: tuple[_Fields, _Fields] = (
    {"transport": (str,)}, {"command": (list,), "url": (str,), "name": (str,), "version": (str,)})
_RESPONSE = {"status": (int,), "headers": (list,), "body": (str,), "reason": (str,),
             "encoding": (str, _OPTIONAL), "headers_base": (int, _OPTIONAL)}
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a header name (RFC 9110, 5.6.2)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # in a header value: no line, no NUL


def _kind_name(value: tuple[type, ...]) -> str:
    names = [t.__name__ for t in value if t is not _OPTIONAL]
    return " or ".join({"int": "an integer", "float": "a number", "str": "a string",
                        "list": "a list", "dict": "an object", "bool": "true/false"}.get(n, n)
                       for n in names) + (" or null" if _OPTIONAL in value else "")


def _check_fields(obj: dict[str, Any], required: _Fields, optional: _Fields, what: str,
                  path: Path, seq: int | None) -> None:
    for name in required:
        if name not in obj:
            raise CorruptCassette(f"{path}: {what} has no '{name}' field", path=path, seq=seq)
    for name, value in obj.items():  # a line has fewer fields than the tables name
        types = optional.get(name) or required.get(name)
        if types is None:
            continue
        kind = type(value)
        if kind in types and (kind is not int or -2**63 <= value < 2**63):
            continue  # what JSON parses to, at once (_is, inline: this runs for every field)
        if not _is(value, types):
            big = isinstance(value, int) and not isinstance(value, bool) and not _fits(value)
            got = f"{value}, beyond any number deja writes" if big else type(value).__name__
            raise CorruptCassette(f"{path}: {what}: '{name}' must be {_kind_name(types)}, "
                                  f"not {got}", path=path, seq=seq)


def _fits(value: int) -> bool:
    """What the index's integer columns hold (compared: ``in range(...)`` scans an int
    subclass, a writer's IntEnum, one number at a time)."""
    return -2**63 <= value < 2**63


def _is(value: Any, types: tuple[type, ...]) -> bool:
    """``value`` is one of ``types`` (``True`` is no int here; a writer's ``str`` enum is
    a string) and an integer fits the index's columns."""
    kind = type(value)
    if kind in types:  # what JSON parses to, at once
        return kind is not int or _fits(value)
    if kind is bool:
        return False
    return isinstance(value, types) and (not isinstance(value, int) or _fits(value))


def _counts(counts: dict[str, Any], nested: tuple[str, ...] | None) -> bool:
    """Token counts and totals: numbers (or null), or objects of them one level down (any
    field of a usage, whose fields are the provider's; only ``nested`` of the totals)."""
    return all(_is(v, _MAYBE_NUMBER) or (
        isinstance(v, dict) and (nested is None or k in nested)
        and all(_is(w, _MAYBE_NUMBER) for w in v.values())) for k, v in counts.items())


def check_header(header: dict[str, Any], path: Path) -> None:
    """The header's fields have the types deja writes (``key_id`` may be missing: the
    trust decision says what that means)."""
    fields = {k: v for k, v in _HEADER.items() if k != "key_id"}
    _check_fields(header, {}, fields, "the header", path, None)
    if "key_id" in header and not isinstance(header["key_id"], str):
        raise CorruptCassette(f"{path}: the header: 'key_id' must be a string, not "
                              f"{type(header['key_id']).__name__}", path=path, seq=None)
    _check_features(header.get("features"), path)
    argv = header.get("argv")
    if argv is not None and not all(isinstance(a, str) for a in argv):
        raise CorruptCassette(f"{path}: the header: 'argv' must be a list of strings",
                              path=path, seq=None)
    parent = header.get("parent")
    if parent is not None:
        _check_fields(parent, {}, {"run": (str,), "step": (int,), "prefix_sig": (str,),
                                   "path": (str,)}, "the header's parent", path, None)


def _check_features(features: Any, path: Path) -> None:
    """The optional features a cassette says it uses are strings this deja reads."""
    if features is None:
        return
    if not all(isinstance(f, str) for f in features):
        raise CorruptCassette(f"{path}: the header: 'features' must be a list of strings",
                              path=path, seq=None)
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise UnsupportedFormat(
            f"{path}: the cassette uses format features this deja does not read "
            f"({', '.join(unknown)}; it reads {', '.join(FEATURES)}); upgrade deja to read it",
            path=path)


def _check_mcp(part: dict[str, Any], what: str, path: Path, seq: int) -> None:
    """An MCP exchange's part of a line: its server and method, its notifications."""
    _check_fields(part, *_MCP_PART, f"{what} mcp", path, seq)
    _check_fields(part["server"], *_MCP_SERVER, f"{what} mcp server", path, seq)
    command = part["server"].get("command")
    if command is not None and not all(isinstance(a, str) for a in command):
        raise CorruptCassette(f"{path}: {what}: an MCP server's command must be a list of "
                              "strings", path=path, seq=seq)
    for note in part.get("notifications") or ():
        if not (isinstance(note, dict) and isinstance(note.get("method"), str)
                and isinstance(note.get("params", {}), dict)):
            raise CorruptCassette(f"{path}: {what}: an MCP notification is not an object with "
                                  "a method and params", path=path, seq=seq)


def _check_headers(response: dict[str, Any], line: dict[str, Any], what: str, path: Path,
                   seq: int) -> None:
    """Response headers are [name, value] pairs of strings; against a base line (named by
    ``headers_base``, or by the line's ``like``) also ``null`` (that line's), or edits of
    its headers (numbers and strings, :mod:`recorder.cassette._headers`)."""
    shared = isinstance(response.get("headers_base"), int) or isinstance(line.get("like"), int)
    headers = response.get("headers") or ()
    edits = shared and _headers.is_edits(headers)
    for item in headers:
        if isinstance(item, list) and len(item) == 2 and all(isinstance(p, str) for p in item):
            _check_header(item[0], item[1], what, path, seq)
            continue
        if edits and isinstance(item, str):
            _check_header(None, item, what, path, seq)
            continue
        if (item is None and shared and not edits) or (edits and isinstance(item, int)
                                                       and not isinstance(item, bool)):
            continue
        raise CorruptCassette(f"{path}: {what}: a response header is not a [name, value] "
                              "pair of strings (null or an edit only with a headers_base)",
                              path=path, seq=seq)


def _check_header(name: str | None, value: str, what: str, path: Path, seq: int) -> None:
    """A header an HTTP client could have received: its name a token, its value without
    a line break or another control character (served, such a value would end the header
    block or write a header of its own)."""
    if name is not None and not _TOKEN.fullmatch(name):
        raise CorruptCassette(f"{path}: {what}: response header name {name[:40]!r} is no "
                              "HTTP header name", path=path, seq=seq)
    if _CONTROL.search(value):
        raise CorruptCassette(f"{path}: {what}: response header {name or '(an edit)'!r} holds "
                              "a line break or a control character", path=path, seq=seq)


def _check_response(response: dict[str, Any], what: str, path: Path, seq: int) -> None:
    """A response an HTTP client could have received: a status of 100-599 (RFC 9110: any
    other is invalid), no body on a status that has none, a reason phrase on one line, a
    body encoding deja writes."""
    status = response["status"]
    if not 100 <= status <= 599:
        raise CorruptCassette(f"{path}: {what}: response status {status} is no HTTP status "
                              "(100-599)", path=path, seq=seq)
    if (status < 200 or status in (204, 304)) and (response.get("body") or "body_json" in response):
        raise CorruptCassette(f"{path}: {what}: a {status} response has no body, and this "
                              "one holds one", path=path, seq=seq)
    if response.get("encoding") not in (None, "base64"):
        raise CorruptCassette(f"{path}: {what}: response body encoding "
                              f"{str(response['encoding'])[:40]!r} is not one deja writes",
                              path=path, seq=seq)
    reason = response.get("reason")
    if isinstance(reason, str) and _CONTROL.search(reason):
        raise CorruptCassette(f"{path}: {what}: its reason phrase holds a line break or a "
                              "control character", path=path, seq=seq)


def _check_base64(body: str, what: str, path: Path, seq: int) -> None:
    """A body stored as base64 (bytes that are not UTF-8) decodes: every reader decodes
    it, the replay to serve it."""
    try:
        binascii.a2b_base64(body)
    except (binascii.Error, ValueError):
        raise CorruptCassette(f"{path}: {what} response: its body is not base64, as its "
                              "encoding says", path=path, seq=seq) from None


_DELTA: tuple[_Fields, _Fields] = ({"base": (int,), "keep": (int,)}, {
    "reply": (int,), "set": (dict,), "unset": (list,), "shape": (list, int)})


def _check_delta(request: dict[str, Any], what: str, path: Path, seq: int) -> None:
    """A request stored as a delta (:mod:`recorder.cassette._delta`) names earlier lines
    (its base, the reply it resends) and how much of its base it keeps."""
    _check_fields(request, *_DELTA, f"{what} request", path, seq)
    for name in ("base", "reply"):
        if not 0 <= request.get(name, 0) < seq:
            raise CorruptCassette(f"{path}: {what}: its request's '{name}' names seq "
                                  f"{request[name]}, not a line before it", path=path, seq=seq)
    if request["keep"] < 0:
        raise CorruptCassette(f"{path}: {what}: its request keeps {request['keep']} items of "
                              "its base", path=path, seq=seq)


def check_line(line: dict[str, Any], path: Path, seq: int) -> None:
    """The fields of observation ``seq`` that readers use have the types deja writes."""
    kind: str = line["kind"]  # one of KINDS: the reader checked it
    what = f"seq {seq} ({kind})"
    _check_fields(line, _REQUIRED[kind], _TYPES_OF[kind], what, path, seq)
    if kind == Kind.MODEL and "body" not in line["request"]:
        _check_delta(line["request"], what, path, seq)
    response = line.get("response")
    if isinstance(response, dict):
        required: _Fields = {"status": (int,)}
        if kind == Kind.HTTP or "body_json" not in response:
            required["body"] = (str,)
        _check_fields(response, required, _RESPONSE, f"{what} response", path, seq)
        _check_response(response, what, path, seq)
        _check_headers(response, line, what, path, seq)
        if response.get("encoding") == "base64" and "body" in response:
            _check_base64(response["body"], what, path, seq)
    error = line.get("error")
    if isinstance(error, dict):
        _check_fields(error, {}, {"type": (str,), "module": (str,), "message": (str,),
                                  "code": (int,)}, f"{what} error", path, seq)
    if isinstance(line.get("mcp"), dict):
        _check_mcp(line["mcp"], what, path, seq)
    for name, label, nested in (("usage", "usage counts", None),
                                ("totals", "the totals", ("replayed",))):
        counts = line.get(name)
        if isinstance(counts, dict) and not _counts(counts, nested):
            raise CorruptCassette(f"{path}: {what}: {label} must be numbers", path=path,
                                  seq=seq)
