"""A provider = a wire **format** carried by a **carriage**: the two halves of the seam.

A :class:`Format` is what a model API's messages look like: which part of a request
identifies the call, where the conversation, the model and the output ceiling are, how a
response's events fold into a message (and a message into events), its usage, stop reason
and errors, and the call read as a conversation in deja's shape. A :class:`Carriage` is how
those messages travel: which endpoints are model calls, which request headers change from
one run to the next (auth, telemetry), what the URL says (Gemini and Bedrock name the model
and streaming there), and how a stream is framed on the wire. A format reads a stream as
its *text*, the events as the format writes them (an SSE body as it is); a carriage turns
a body as received into that text and back, so that a binary framing (AWS's event stream)
fits the same format as a text one. The Messages format is carried by Anthropic's API and
by Amazon Bedrock; each is one :class:`Provider`.

Everything outside this package asks a :class:`Provider` (found through
:mod:`recorder.providers.registry`) and never reads a wire format itself.
"""

from __future__ import annotations

import functools
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict
from urllib.parse import urlsplit

from recorder import _fastjson
from recorder.canonical import Parts, Texts, model_fingerprint
from recorder.providers._sse import data_lines, sse_blocks, sse_event, sse_events
from recorder.providers.pricing import PriceTable

__all__ = ["PLACEHOLDER_KEY", "USAGE_KEYS", "VOLATILE_HEADERS", "VOLATILE_HEADER_PREFIXES",
           "Carriage", "Conversation", "Format", "Headers", "Provider", "Summary",
           "data_lines", "is_volatile", "sse_blocks", "sse_event", "sse_events", "string_spans",
           "token_counts"]

Headers = Iterable[Sequence[str]]  # (name, value) pairs, as received or as stored

# Request headers that change between two runs of the same code and say nothing about the
# call: the HTTP plumbing, and what the Stainless-generated SDKs add (their ``x-stainless-``
# telemetry and a fresh ``idempotency-key`` per request). Every request drops them.
VOLATILE_HEADER_PREFIXES: tuple[str, ...] = ("x-stainless-",)
VOLATILE_HEADERS: frozenset[str] = frozenset({"user-agent", "content-length", "host",
                                              "accept-encoding", "connection",
                                              "idempotency-key"})

# What an offline replay puts in an API key variable left unset: the SDKs refuse to build a
# client without a key, though a replay sends nothing to the network.
PLACEHOLDER_KEY = "deja-replay-placeholder-key"

# deja's names for token counts, whatever a provider's wire format calls them.
USAGE_KEYS = ("input_tokens", "output_tokens", "cache_creation_input_tokens",
              "cache_read_input_tokens")


class Summary(TypedDict, total=False):
    """What a complete model response says; every key is optional (an unreadable body
    gives an empty summary). ``usage`` uses deja's token names: ``input_tokens``,
    ``output_tokens``, ``cache_creation_input_tokens``, ``cache_read_input_tokens``."""

    message_id: Any
    model: Any
    stop_reason: Any
    usage: dict[str, int]
    error: dict[str, Any]


class Conversation(TypedDict):
    """A model call read as a conversation, in deja's (the Messages API's) shape whatever
    the provider's, so that the viewer and ``deja diff`` read every provider alike.

    ``system`` is the system prompt (None: the request has none apart from its turns);
    ``messages`` the request's turns in order, each ``{"role", "content", ...}`` with
    ``content`` a string or a list of blocks (``text``, ``thinking``, ``image``,
    ``tool_use`` with a parsed ``input``, ``tool_result`` with ``tool_use_id``; a block
    of any other type as it is); ``reply`` the response message as one such turn (None:
    no message); ``settings`` the rest of the request (model, tools, parameters). Fields a
    turn has besides these are kept, so that nothing the call said is left out; ids that
    differ between any two runs of the same behaviour (a Responses item's ``id``) are not.
    """

    system: Any
    messages: list[dict[str, Any]]
    reply: dict[str, Any] | None
    settings: dict[str, Any]


def is_volatile(name: str, exact: frozenset[str], prefixes: tuple[str, ...]) -> bool:
    """Is header ``name`` among ``exact`` or does it start with one of ``prefixes``?"""
    lowered = name.lower()
    return lowered in exact or lowered.startswith(prefixes)


# ---------------------------------------------------------------------- the format


class Format(ABC):
    """One model API's messages: what they mean, whatever carries them.

    An abstract base class rather than a Protocol: several answers are the same for most
    JSON APIs (the fingerprint hashes the semantic request, a conversation in the Messages
    API's shape, cost from the price table), so they are written once here and a format
    overrides only where it differs. A stream is read and written as its *text* (the
    events as this format writes them; see the module docstring).
    """

    # Response message fields that differ between any two runs of the same behaviour.
    volatile_message_keys: tuple[str, ...] = ("id",)
    # Response message fields that say how an answer was produced, not what it says:
    # token counts and the model snapshot that served it. Two live answers that differ
    # only in these say the same (deja drift).
    answer_meta_keys: tuple[str, ...] = ("usage", "model")

    # -- requests

    def semantic_request(self, body: Any) -> Any:
        """The part of a (redacted, parsed) request body that identifies the call: what a
        replay matches on. The whole body unless the format carries per-call noise."""
        return body

    def history_field(self, body: Any) -> str | None:
        """The field of request ``body`` that holds its conversation as a list, which the
        next request of the conversation sends again with more items at its end: a cassette
        stores that request as the items it adds to this one. None when ``body`` holds no
        such list (it is stored whole). This default reads the Messages API's shape."""
        if isinstance(body, dict) and isinstance(body.get("messages"), list):
            return "messages"
        return None

    def request_model(self, body: Any) -> Any:
        """The model a request body asks for (None when it names none)."""
        return body.get("model") if isinstance(body, dict) else None

    def request_max_tokens(self, body: Any) -> Any:
        """The ceiling on output tokens a request asks for (None when it sets none)."""
        return body.get("max_tokens") if isinstance(body, dict) else None

    def with_max_tokens(self, body: dict[str, Any], limit: int) -> dict[str, Any]:
        """``body`` with its output-token ceiling lowered to ``limit`` (the budget's
        ``clamp`` mode)."""
        return {**body, "max_tokens": limit}

    def request_streams(self, body: Any) -> bool:
        """Does the request body ask for a streamed response?"""
        return bool(body.get("stream")) if isinstance(body, dict) else False

    # -- what changes from one run to the next

    def volatile_request_fields(self) -> tuple[str, ...]:
        """The request fields that change from one run of a program to the next without
        changing what the call means (a user id for abuse tracking, a prompt-cache marker
        that moves along the conversation), as a replay policy's JSON pointers: ``*``
        stands for any key or list index, ``**`` for any depth. A replay leaves them out of
        the match when its policy takes the providers' declarations
        (``ReplayPolicy(providers=True)``, what deja's own configuration builds). None by
        default."""
        return ()

    def is_request_id(self, holder: str | None, obj: Mapping[str, Any], key: str) -> bool:
        """Is the string ``obj[key]`` an id minted anew in every run that only pairs one
        part of the request with another (a tool call with its result)? ``holder`` is the
        key ``obj`` sits under in its parent (a list's key, for its items; None at the
        top). No id is, by default."""
        return False

    def stable_request_ids(self, body: Any) -> Any:
        """A copy of request ``body`` with each id :meth:`is_request_id` names renamed by
        its order of first appearance (``id#1``, ``id#2`` ...), the same id the same name
        wherever it appears: two runs whose calls and results pair alike read the same
        whatever ids they were given, and a result paired with another call still
        differs."""
        names: dict[str, str] = {}

        def walk(value: Any, holder: str | None) -> Any:
            if isinstance(value, list):
                return [walk(item, holder) for item in value]
            if not isinstance(value, dict):
                return value
            out = {}
            for key, item in value.items():
                if isinstance(item, str) and self.is_request_id(holder, value, key):
                    out[key] = names.setdefault(item, f"id#{len(names) + 1}")
                else:
                    out[key] = walk(item, key)
            return out

        return walk(body, None)

    # -- responses

    def stream_pieces(self, text: bytes) -> list[list[tuple[int, int]]]:
        """Where a stream's text delivers values in pieces: for each piece-wise value (a
        content block's text, a tool call's arguments), the byte spans in ``text`` of its
        pieces, in order, each the inside of a JSON string as received. Redaction joins
        each value's pieces to find a secret cut across them. None by default."""
        return []

    @abstractmethod
    def assemble(self, text: str) -> dict[str, Any]:
        """The message a recorded stream's text delivers, as the SDK would build it."""

    @abstractmethod
    def synthesize(self, message: dict[str, Any]) -> str:
        """The text of a complete, valid stream that delivers ``message``."""

    def from_json(self, doc: Any) -> Any:
        """The message a JSON response body ``doc`` holds (itself, by default)."""
        return doc

    @abstractmethod
    def usage(self, message: Any) -> dict[str, int]:
        """The token counts of a complete message, in deja's names (see :class:`Summary`);
        only non-negative 64-bit integers count."""

    @abstractmethod
    def stop_reason(self, message: Any) -> Any:
        """Why the model stopped (None when the message does not say)."""

    @abstractmethod
    def summarize_json(self, status: int, doc: Any) -> Summary:
        """Id, model, usage, stop reason or API error of a parsed JSON response body.
        Never raises."""

    @abstractmethod
    def summarize_stream(self, text: str) -> Summary:
        """The same of a stream's text, read event by event so that a stream cut short
        still says what it said. Never raises."""

    def conversation(self, request: Any, message: Any = None) -> Conversation:
        """The call as a conversation (see :class:`Conversation`): ``request`` is the
        parsed request body, ``message`` the response message. This default reads the
        Messages API's shape, which is already deja's."""
        body = request if isinstance(request, dict) else {}
        messages = body.get("messages")
        return {"system": body.get("system"),
                "messages": [m for m in messages if isinstance(m, dict)]
                if isinstance(messages, list) else [],
                "reply": message if isinstance(message, dict) else None,
                "settings": {k: v for k, v in body.items() if k not in ("system", "messages")}}

    def turn_unfinished(self, stop_reason: Any) -> bool:
        """Does a reply that stopped for ``stop_reason`` leave the turn unfinished, the
        agent owing the model another request (with tool results, or to resume a paused
        turn)? No by default: a format whose stop reason does not say (Gemini ends a reply
        that calls functions with ``STOP``) leaves it to the reply's tool calls
        (:func:`recorder.providers.conversation.reply_unfinished`)."""
        return False

    def tool_result_slots(self, body: Any) -> list[tuple[dict[str, Any], str]]:
        """Where request ``body`` holds each tool result its conversation reads, in the
        conversation's order: the object and the key of the result's content as sent (a
        ``tool_result`` block and ``content``). The proxy reads what the agent sent there
        and a fork at a tool step puts its edit there. None by default: a format that
        does not say has its results read from the conversation, and not edited."""
        return []

    def cost(self, model: Any, usage: dict[str, int] | None, prices: PriceTable) -> float | None:
        """The dollar cost of ``usage`` for ``model`` by ``prices`` (None: not priced)."""
        return prices.cost(model, usage)


# ---------------------------------------------------------------------- the carriage


class Carriage:
    """How a format's messages travel over HTTP: the endpoints that are model calls, the
    API key's variables, the request headers that change between runs, and a stream's
    framing. This base is a JSON API whose streams are text (``text/event-stream``): its
    stream text is the body itself. A carriage that frames streams otherwise (or names the
    model in the URL) overrides those methods.
    """

    def __init__(self, endpoints: tuple[str, ...] = (), *, key_env: tuple[str, ...] = (),
                 base_url_env: Mapping[str, str] | None = None,
                 volatile_headers: frozenset[str] = VOLATILE_HEADERS,
                 volatile_header_prefixes: tuple[str, ...] = VOLATILE_HEADER_PREFIXES) -> None:
        self.endpoints = endpoints  # path suffixes of the POST requests that are model calls
        # the environment variables its SDKs read a base URL from, each with what follows a
        # server's address there (OpenAI's SDK names the version: /v1)
        self.base_url_env: Mapping[str, str] = dict(base_url_env or {})
        # the environment variables its SDKs read an API key from: alternatives, the first
        # the one an offline replay sets a placeholder in (:meth:`placeholders`)
        self.key_env = key_env
        self.volatile_headers = volatile_headers
        self.volatile_header_prefixes = volatile_header_prefixes

    def placeholders(self, environ: Mapping[str, str]) -> dict[str, str]:
        """What an offline replay sets in ``environ`` so that the SDK builds its client:
        :data:`PLACEHOLDER_KEY` in the first key variable when none of them is set (they
        are alternatives: Gemini's SDK reads ``GEMINI_API_KEY`` or ``GOOGLE_API_KEY``)."""
        if self.key_env and not any(environ.get(var) for var in self.key_env):
            return {self.key_env[0]: PLACEHOLDER_KEY}
        return {}

    def is_model_call(self, method: str, url: str) -> bool:
        """Is ``method url`` one of this carriage's model calls?"""
        if method.upper() != "POST":
            return False
        path = urlsplit(url).path.rstrip("/")
        return any(path.endswith(suffix) for suffix in self.endpoints)

    def is_volatile_header(self, name: str) -> bool:
        """Is request header ``name`` one that changes between runs (not stored)?"""
        return is_volatile(name, self.volatile_headers, self.volatile_header_prefixes)

    def request_model(self, url: str) -> str | None:
        """The model ``url`` names (None: the body says)."""
        return None

    def price_names(self, model: str) -> tuple[str, ...]:
        """The names to look ``model`` up by in a price table, in order: the model itself
        here; a carriage whose model ids wrap the format's names (Bedrock's) adds those."""
        return (model,)

    def request_streams(self, url: str) -> bool | None:
        """Does ``url`` ask for a stream (None: the body says)?"""
        return None

    def is_stream(self, headers: Headers) -> bool:
        """Is a response with these headers a stream (rather than one JSON body)?"""
        return any(k.lower() == "content-type" and "event-stream" in v for k, v in headers)

    def view(self, body: bytes) -> bytes:
        """A stream's text as bytes, from its body as received: the body itself here."""
        return body

    def text(self, body: bytes) -> str:
        """A stream's text, from its body as received. Raises ``ValueError`` (a
        ``UnicodeDecodeError``) when the body has none."""
        return self.view(body).decode("utf-8")

    def frame(self, text: str) -> bytes:
        """The body that carries a stream's ``text``."""
        return text.encode("utf-8")

    def restream(self, body: bytes, view: bytes) -> bytes:
        """``body`` with its stream's text replaced by ``view`` (the same events, edited:
        a redacted secret), as this framing carries it."""
        return view


# ---------------------------------------------------------------------- the provider


class Provider:
    """A :class:`Format` over a :class:`Carriage`, known by ``name``: what every reader
    outside this package asks. Each answer comes from the half that knows it."""

    def __init__(self, name: str, format: Format, carriage: Carriage) -> None:
        self.name = name
        self.format = format
        self.carriage = carriage

    def __repr__(self) -> str:
        return (f"Provider({self.name!r}, {type(self.format).__name__}, "
                f"{type(self.carriage).__name__})")

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.carriage.endpoints

    @property
    def key_env(self) -> tuple[str, ...]:
        return self.carriage.key_env

    @property
    def volatile_message_keys(self) -> tuple[str, ...]:
        return self.format.volatile_message_keys

    # -- requests

    def is_model_call(self, method: str, url: str) -> bool:
        """Is ``method url`` one of this provider's model calls?"""
        return self.carriage.is_model_call(method, url)

    def is_volatile_header(self, name: str) -> bool:
        """Is request header ``name`` one that changes between runs (not stored)?"""
        return self.carriage.is_volatile_header(name)

    def semantic_request(self, body: Any) -> Any:
        """See :meth:`Format.semantic_request`."""
        return self.format.semantic_request(body)

    def fingerprint(self, method: str, url: str, body: Any, parts: Parts | None = None,
                    texts: Texts | None = None) -> str:
        """What a replayed model call is matched by (see
        :func:`recorder.canonical.model_fingerprint`): the semantic request, its history
        (the field :meth:`Format.history_field` names) hashed by parts; ``parts`` remembers
        the digests of history, ``texts`` are the body's parts as received."""
        semantic = self.format.semantic_request(body)
        return model_fingerprint(method, url, semantic, parts,
                                 texts if semantic is body else None,
                                 history=self.format.history_field(semantic))

    def history_field(self, body: Any) -> str | None:
        """See :meth:`Format.history_field`."""
        return self.format.history_field(body)

    def request_model(self, body: Any, url: str = "") -> Any:
        """The model a request asks for (None when it names none); ``url``: where it was
        sent, for a carriage that names the model there (Gemini, Bedrock)."""
        named = self.carriage.request_model(url) if url else None
        return named if named is not None else self.format.request_model(body)

    def request_streams(self, body: Any, url: str = "") -> bool:
        """Does the request ask for a streamed response? (``url`` as for
        :meth:`request_model`.)"""
        said = self.carriage.request_streams(url) if url else None
        return said if said is not None else self.format.request_streams(body)

    def request_max_tokens(self, body: Any) -> Any:
        """See :meth:`Format.request_max_tokens`."""
        return self.format.request_max_tokens(body)

    def with_max_tokens(self, body: dict[str, Any], limit: int) -> dict[str, Any]:
        """See :meth:`Format.with_max_tokens`."""
        return self.format.with_max_tokens(body, limit)

    # -- responses

    def is_stream(self, headers: Headers) -> bool:
        """Is a response with these headers a stream (rather than one JSON body)?"""
        return self.carriage.is_stream(headers)

    def stream_pieces(self, view: bytes) -> list[list[tuple[int, int]]]:
        """See :meth:`Format.stream_pieces` (``view``: a stream's text, as bytes)."""
        return self.format.stream_pieces(view)

    def stream_text(self, body: bytes) -> str:
        """A stream's text, the events its format reads, from its body as received
        (:meth:`Carriage.text`). Raises ``ValueError`` when the body has none."""
        return self.carriage.text(body)

    def assemble(self, body: bytes | str) -> dict[str, Any]:
        """The message a recorded stream delivers (``body`` as received; text is taken
        as its UTF-8 bytes). Raises ``ValueError`` when its events are not what the
        format sends (a block index that is a list, a delta that is a number, a tool
        input nested deeper than Python reads ...): an upstream or a cassette may hold
        anything."""
        raw = body.encode("utf-8") if isinstance(body, str) else body
        try:
            return self.format.assemble(self.carriage.text(raw))
        except (TypeError, KeyError, AttributeError, IndexError, RecursionError) as exc:
            raise ValueError(f"the stream's events are not the ones its format sends "
                             f"({type(exc).__name__}: {exc})") from exc

    def synthesize(self, message: dict[str, Any]) -> bytes:
        """The body of a complete, valid stream that delivers ``message``."""
        return self.carriage.frame(self.format.synthesize(message))

    def message(self, headers: Headers, body: bytes | str) -> Any:
        """The message a response body holds: assembled when the response is a stream,
        else the parsed JSON. Raises ``ValueError`` when the body is neither."""
        if self.carriage.is_stream(headers):
            return self.assemble(body)
        try:
            return self.format.from_json(json.loads(body))
        except RecursionError:  # stored raw, as received: it has no message to show
            raise ValueError("the body is nested too deeply to read as JSON") from None

    def usage(self, message: Any) -> dict[str, int]:
        """See :meth:`Format.usage`."""
        return self.format.usage(message)

    def stop_reason(self, message: Any) -> Any:
        """See :meth:`Format.stop_reason`."""
        return self.format.stop_reason(message)

    def summarize(self, status: int, headers: Headers, body: bytes) -> Summary:
        """Id, model, usage, stop reason or API error of a complete response body, JSON or
        stream. Never raises: the body is stored exactly either way."""
        try:
            if self.carriage.is_stream(headers):
                return _flat(self.format.summarize_stream(self.carriage.text(body)))
            text = body.decode("utf-8")
            doc = _fastjson.loads_utf8(body, text) if text else None
        except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep
            return {}
        return _flat(self.format.summarize_json(status, doc))

    def summarize_parsed(self, status: int, headers: Headers, body: bytes, doc: Any) -> Summary:
        """:meth:`summarize` of a JSON body ``body`` that a reader already parsed into
        ``doc``."""
        if self.carriage.is_stream(headers):
            return self.summarize(status, headers, body)
        return _flat(self.format.summarize_json(status, doc))

    def conversation(self, request: Any, message: Any = None) -> Conversation:
        """See :meth:`Format.conversation`."""
        return self.format.conversation(request, message)

    def turn_unfinished(self, stop_reason: Any) -> bool:
        """See :meth:`Format.turn_unfinished`."""
        return self.format.turn_unfinished(stop_reason)

    def tool_result_slots(self, body: Any) -> list[tuple[dict[str, Any], str]]:
        """See :meth:`Format.tool_result_slots`."""
        return self.format.tool_result_slots(body)

    def cost(self, model: Any, usage: dict[str, int] | None, prices: PriceTable) -> float | None:
        """The dollar cost of ``usage`` for ``model`` (None: not priced), by the first of
        the carriage's names for the model that ``prices`` has (:meth:`Carriage.price_names`)."""
        for name in self.carriage.price_names(model) if isinstance(model, str) else (model,):
            cost = self.format.cost(name, usage, prices)
            if cost is not None:
                return cost
        return None


# ---------------------------------------------------------------------- shared readers


_STRING = b'"((?:[^"\\\\]|\\\\.)*)"'


@functools.lru_cache(maxsize=64)
def _key_pattern(key: str) -> re.Pattern[bytes]:
    return re.compile(b'"' + re.escape(key.encode()) + b'"\\s*:\\s*' + _STRING)


def string_spans(data: bytes, key: str, values: Sequence[str]) -> list[tuple[int, int]] | None:
    """The spans in ``data`` (raw JSON) of the string values of ``key``, when they are
    exactly ``values`` in this order (None otherwise: the line is read some other way)."""
    pattern = _key_pattern(key)
    found = [m.span(1) for m in pattern.finditer(data)]
    if len(found) != len(values):
        return None
    for (start, end), value in zip(found, values, strict=True):
        try:
            if json.loads(b'"' + data[start:end] + b'"') != value:
                return None
        except ValueError:
            return None
    return found


def token_counts(usage: Any, keys: Sequence[str] = USAGE_KEYS) -> dict[str, int]:
    """The counts among ``usage``'s ``keys``: a body is whatever the upstream sent, and a
    count that is no non-negative 64-bit integer (a string, true, 10**30) is no count."""
    if not isinstance(usage, dict):
        return {}
    return {k: usage[k] for k in keys if type(usage.get(k)) is int and 0 <= usage[k] < 2**63}


def _flat(summary: Summary) -> Summary:
    """``summary`` as a line holds it: an id, model or stop reason, or an error's type or
    message, that a response body gave as a list or an object (a body may put anything
    where a string belongs, nested as deep as it likes) is kept as its JSON text."""
    for key in ("message_id", "model", "stop_reason"):
        value = summary.get(key)
        if isinstance(value, (dict, list)):
            summary[key] = _as_text(value)
    error = summary.get("error")
    if isinstance(error, dict) and any(isinstance(v, (dict, list)) for v in error.values()):
        summary["error"] = {k: _as_text(v) if isinstance(v, (dict, list)) else v
                            for k, v in error.items()}
    return summary


def _as_text(value: Any) -> str | None:
    try:
        return _fastjson.dumps_compact(value)
    except (ValueError, RecursionError):
        return None

