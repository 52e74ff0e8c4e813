"""Bringing vcrpy cassettes in: a YAML cassette of model calls becomes a signed deja cassette.

::

    from recorder.vcr_import import import_vcr

    result = import_vcr("tests/cassettes/agent.yaml", "cassettes/agent.jsonl")
    print(result.interactions, result.model_calls, result.path)

A team that tests with vcrpy already has recordings of its Anthropic and OpenAI calls.
Each interaction of such a cassette is handed to a :class:`recorder.RecordSession`
exactly as a live exchange is (``end_http``), so the import writes the lines a recording
would have written: model calls classified by their provider, with usage, cost and stop
reason; other requests as HTTP lines; secrets (``x-api-key``, ``authorization``, key
shapes, ``[tool.deja.redact]``) redacted by the same rules; bodies stored as received, a
compressed one included. The result replays bit for bit like any recorded run.

What vcrpy does not keep, the import cannot invent: a line's time ``t`` is the response's
``date`` header when it has one (else the time of the import), and its duration ``ms`` is
null. The run records no command (``argv`` is empty) and names its source in the
header's ``imported`` field.

vcrpy's own loader reads the file (its safe YAML loader, its request and response forms),
so every cassette vcrpy itself can play back is read the same way here, the older httpx
form (``status_code`` and ``content``) included. vcrpy is imported only when a cassette is
read: ``import recorder`` stays light.

YAML aliases (``*name``, a reference to an ``&name`` anchor) let a file of a kilobyte
stand for gigabytes: nine levels of lists of nine references each (a "billion laughs")
build nothing big in memory, but every reference becomes bytes of its own once written to
a cassette. Before vcrpy's loader builds anything, the file's node graph is measured with
every alias expanded (:func:`expanded_size`); a file that would grow past
:data:`MAX_EXPANSION` times its own size (plus :data:`EXPANSION_ALLOWANCE`) is refused with
:class:`YamlExpansion`. Anchors that vcrpy's own dumper writes for a shared list or mapping
stay well within that.
"""

from __future__ import annotations

import dataclasses
import email.utils
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recorder.canonical import content_encoded
from recorder.capture.exchange import HttpRequest, HttpResponse, Redaction
from recorder.capture.session import Timing
from recorder.cassette import Fsync
from recorder.cassette.keys import Keyring
from recorder.cassette.schema import Kind
from recorder.errors import (
    CannotConvert,
    DejaError,
    NotAVcrCassette,
    VcrImportError,
    YamlExpansion,
)
from recorder.harness.guards import Budgets
from recorder.harness.settings import resolve as resolve_settings
from recorder.record import RecordSession

__all__ = ["EXPANSION_ALLOWANCE", "MAX_EXPANSION", "CannotConvert", "ImportResult",
           "Interaction", "NotAVcrCassette", "VcrImportError", "YamlExpansion",
           "expanded_size", "import_vcr", "read_vcr"]

# A file's content with its aliases expanded may be this many times its own size, plus
# the allowance; a vcrpy cassette without aliases is smaller expanded than on disk.
MAX_EXPANSION = 10
EXPANSION_ALLOWANCE = 1 << 20


@dataclasses.dataclass(frozen=True)
class Interaction:
    """One request and its response, as vcrpy recorded them; ``t`` from the response's
    ``date`` header (None: it has none)."""

    index: int
    request: HttpRequest
    response: HttpResponse
    t: float | None


@dataclasses.dataclass(frozen=True)
class ImportResult:
    """What an import wrote."""

    path: Path
    run_id: str
    interactions: int
    model_calls: int
    http_calls: int
    end: dict[str, Any]


# -------------------------------------------------------------------------------- reading


def _text(value: Any) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _header_pairs(headers: Any) -> list[tuple[str, str]]:
    """vcrpy's headers (a mapping of a name to a value or a list of values) as pairs."""
    if headers is None:
        return []
    if not isinstance(headers, Mapping):
        raise TypeError(f"headers must be a mapping, not {type(headers).__name__}")
    out: list[tuple[str, str]] = []
    for name, value in headers.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        out.extend((_text(name), _text(v)) for v in values if v is not None)
    return out


def _bytes(body: Any, what: str) -> bytes:
    if body is None:
        return b""
    if isinstance(body, str):
        return body.encode("utf-8")
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    if isinstance(body, list):  # an iterator body, kept as its chunks
        return b"".join(_bytes(chunk, what) for chunk in body)
    raise TypeError(f"{what} is a {type(body).__name__}, not text or bytes")


def _request(raw: Any) -> HttpRequest:
    from vcr.request import Request

    if not isinstance(raw, Mapping):
        raise TypeError("it has no request mapping")
    request = Request._from_dict(dict(raw))
    if not request.method or not request.uri:
        raise ValueError("its request has no method or uri")
    return HttpRequest(method=str(request.method).upper(), url=str(request.uri),
                       headers=_header_pairs(request.headers),
                       body=_bytes(request.body_bytes, "the request body"))


def _response(raw: Any) -> HttpResponse:
    from vcr.filters import decode_response
    from vcr.serializers.compat import convert_body_to_bytes, convert_to_bytes

    if not isinstance(raw, Mapping):
        raise TypeError("it has no response mapping")
    raw = dict(raw)
    if "status_code" in raw:  # the older httpx form: a decoded body, as vcrpy plays it
        raw = decode_response(convert_body_to_bytes({
            "headers": raw.get("headers") or {}, "body": {"string": raw.get("content")},
            "status": {"code": raw["status_code"], "message": ""}}))
    else:
        raw = convert_to_bytes(raw)
    status = raw.get("status")
    code = status.get("code") if isinstance(status, Mapping) else None
    if isinstance(code, bool) or not isinstance(code, int) or not 100 <= code <= 599:
        raise ValueError(f"its response status code is {code!r}, not an HTTP status")
    body = raw.get("body")
    headers = _header_pairs(raw.get("headers"))
    data = _bytes(body.get("string") if isinstance(body, Mapping) else body, "the response body")
    # vcrpy keeps what the client handed it, which requests and aiohttp decode: stored as
    # the wire had it (recorder.capture.vcr), so that any client replays it
    return HttpResponse(status=code, reason=_text(status.get("message") or ""),
                        headers=headers, body=content_encoded(data, headers))


def _date(headers: list[tuple[str, str]]) -> float | None:
    """The time a response's ``date`` header gives (None: it has none, or not a date)."""
    for name, value in headers:
        if name.lower() == "date":
            try:
                return email.utils.parsedate_to_datetime(value).timestamp()
            except (TypeError, ValueError):
                return None
    return None


def read_vcr(path: str | Path, redaction: Redaction | None = None) -> list[Interaction]:
    """The interactions of the vcrpy cassette at ``path``, in their recorded order.

    Raises :class:`NotAVcrCassette` for a file that is not one (or holds no interaction)
    and :class:`CannotConvert` for an interaction that cannot be read, naming it by its
    index and URI (``redaction`` redacts the URI in the message).
    """
    from vcr.serializers import yamlserializer

    yaml_error = yamlserializer.yaml.YAMLError  # PyYAML's, as vcrpy's loader raises them
    path = Path(path)
    shown = redaction or Redaction.of()
    try:
        text = path.read_text(encoding="utf-8")
        _check_expansion(path, text, yamlserializer.yaml)
        data = yamlserializer.deserialize(text)
    except UnicodeDecodeError:
        raise NotAVcrCassette(f"{path} is not text (a vcrpy cassette is YAML)") from None
    except OSError as exc:
        raise NotAVcrCassette(f"cannot read {path}: {exc.strerror or exc}") from None
    except (yaml_error, ValueError, RecursionError) as exc:  # a tag vcrpy's loader refuses
        raise NotAVcrCassette(f"{path} is not a vcrpy cassette: it does not load as YAML "
                              f"({type(exc).__name__}: {shown.text(str(exc))})") from None
    if isinstance(data, list) and data and isinstance(data[0], Mapping) \
            and "request" in data[0]:
        raise NotAVcrCassette(f"{path} is a vcrpy cassette of the format before vcrpy 1.0; "
                              "convert it with python -m vcr.migration first")
    interactions = data.get("interactions") if isinstance(data, Mapping) else None
    if not isinstance(interactions, list):
        raise NotAVcrCassette(f"{path} is not a vcrpy cassette: it has no 'interactions' "
                              "list (a vcrpy cassette is a mapping with 'version' and "
                              "'interactions')")
    if not interactions:
        raise NotAVcrCassette(f"{path} is a vcrpy cassette with no interactions: there is "
                              "nothing to import")
    out = []
    for index, item in enumerate(interactions):
        raw = item.get("request") if isinstance(item, Mapping) else None
        method, uri = (raw.get("method"), raw.get("uri")) if isinstance(raw, Mapping) \
            else (None, None)
        where = (f"interaction {index} ({method} {shown.url(str(uri))})" if uri
                 else f"interaction {index}")
        try:
            request = _request(raw)
            response = _response(item.get("response") if isinstance(item, Mapping) else None)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            detail = shown.text(f"missing {exc}" if isinstance(exc, KeyError) else str(exc))
            raise CannotConvert(f"{path}: {where} cannot be imported: {detail}. Fix or "
                                "remove that interaction and import again") from None
        out.append(Interaction(index, request, response, _date(response.headers)))
    return out


def _check_expansion(path: Path, text: str, yaml: Any) -> None:
    """Refuse ``text`` when its aliases expand it past the limit (see the module's notes);
    composing the node graph builds no Python value, so no tag runs here."""
    limit = MAX_EXPANSION * len(text) + EXPANSION_ALLOWANCE
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for node in yaml.compose_all(text, Loader=loader):
        size = expanded_size(node, limit)
        if size > limit:
            raise YamlExpansion(
                f"{path} is refused: its YAML aliases (*name, references to &name anchors) "
                f"expand its {len(text):,} characters to more than {limit:,} (a \"billion "
                "laughs\" file, which would fill the disk). Nothing was written; if it is a "
                "cassette you trust, write it out again without anchors and aliases and "
                "import that")


def expanded_size(root: Any, limit: int | None = None) -> int:
    """The characters of a composed YAML node graph with every alias expanded (each
    scalar's text, one for each collection), counted once per node and summed along
    references, so a bomb is measured without being built; stops early past ``limit``.
    A node that contains itself expands without end: ``limit + 1`` (or -1 without one)."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # collections whose members are being counted
    stack: list[tuple[Any, bool]] = [(root, False)]
    endless = (limit + 1) if limit is not None else -1
    while stack:
        node, done = stack.pop()
        key = id(node)
        members = _members(node)
        if done:
            total = 1
            for member in members or ():
                total += sizes[id(member)]
            sizes[key] = total
            open_.discard(key)
            if limit is not None and total > limit:
                return total
            continue
        if key in sizes:
            continue
        if key in open_:
            return endless
        if members is None:
            sizes[key] = len(str(node.value)) + 1
            continue
        open_.add(key)
        stack.append((node, True))
        stack.extend((m, False) for m in members if id(m) not in sizes)
    return sizes[id(root)]


def _members(node: Any) -> list[Any] | None:
    """A collection node's members (a mapping's keys and values), None for a scalar."""
    value = node.value
    if not isinstance(value, list):
        return None
    if value and isinstance(value[0], tuple):
        return [part for pair in value for part in pair]
    return value


# -------------------------------------------------------------------------------- writing


class _ImportSession(RecordSession):
    """A recording fed from a vcrpy cassette: its lines are a live recording's, except
    the durations, which vcrpy does not keep (null, never a made-up 0)."""

    def _write_exchange(self, obs: dict[str, Any], request_body: Any) -> None:
        obs["ms"] = None
        super()._write_exchange(obs, request_body)


def import_vcr(source: str | Path, output: str | Path, *,
               labels: dict[str, Any] | None = None, overwrite: bool = False,
               keyring: Keyring | None = None, run_id: str | None = None) -> ImportResult:
    """Write the vcrpy cassette ``source`` as a signed deja cassette at ``output`` (a file,
    or a directory for ``<run id>.jsonl``); ``labels`` label the run, ``run_id`` names it
    (default: a new id).

    Redaction and prices follow ``[tool.deja]`` as a recording's do; the guards are off
    (nothing is sent). A cassette that cannot be read raises :class:`NotAVcrCassette` or
    :class:`CannotConvert` before anything is written; an interaction the recorder refuses
    raises :class:`CannotConvert` and removes the partial output. An existing ``output``
    is :class:`recorder.errors.PathTaken` unless ``overwrite``.
    """
    source = Path(source)
    interactions = read_vcr(source, resolve_settings().redaction)
    session = _ImportSession(
        output, labels=labels, fsync=Fsync.EXIT, overwrite=overwrite, keyring=keyring,
        run_id=run_id, argv=[], budgets=Budgets(), loop_guard=False, breaker=False,
        header={"imported": {"from": "vcrpy", "cassette": source.name,
                             "interactions": len(interactions)}})
    session.start(intercept=False)
    model_calls = http_calls = 0
    for item in interactions:
        t = item.t if item.t is not None else time.time()
        try:
            line = session.end_http(item.request, item.response, Timing(t, 0.0))
        except DejaError as exc:
            session.abandon()
            session.path.unlink(missing_ok=True)
            url = session.redaction.url(item.request.url)
            raise CannotConvert(f"{source}: interaction {item.index} "
                                f"({item.request.method} {url}) cannot be imported: {exc}. "
                                "Nothing was written") from None
        if line["kind"] == Kind.MODEL:
            model_calls += 1
        else:
            http_calls += 1
    end = session.close()
    return ImportResult(path=session.path, run_id=session.run_id,
                        interactions=len(interactions), model_calls=model_calls,
                        http_calls=http_calls, end=end)
