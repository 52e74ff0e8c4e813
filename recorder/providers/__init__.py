"""Providers: what each model API's wire format means, behind one small seam.

Recording, replay, editing, diffing and the viewer all need to know things about a model
API's wire format: which endpoints are model calls, what part of a request identifies it,
how a response is streamed, where its usage, stop reason and id are, which request headers
change from one run to the next. Each of those questions is asked of a :class:`Provider`,
found by the endpoint (:func:`for_url`), by its name (:func:`get`) or for a recorded line
(:func:`for_line`), so that a new API is one new module registered with :func:`register`
and nothing else changes.

Built in: :mod:`recorder.providers.anthropic` (the Messages API),
:mod:`recorder.providers.openai` (Chat Completions and the Responses API) and
:mod:`recorder.providers.gemini` (Google's Gemini API, ``generateContent``).

This package sits below capture, cassette reading and replay: it imports only
:mod:`recorder.errors`, :mod:`recorder.canonical` and its own modules.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypedDict
from urllib.parse import urlsplit

from recorder.canonical import Parts, Texts, model_fingerprint
from recorder.errors import ConfigError
from recorder.providers.pricing import CACHE_WRITE_1H, PriceTable

__all__ = ["BUILT_IN", "CACHE_WRITE_1H", "PLACEHOLDER_KEY", "USAGE_KEYS", "VOLATILE_HEADERS",
           "VOLATILE_HEADER_PREFIXES", "Conversation", "Headers", "Provider", "Summary",
           "data_lines", "default", "endpoints", "for_line", "for_url", "get", "history_field",
           "model_provider",
           "names", "placeholder_keys", "register", "sse_events", "string_spans",
           "token_counts", "unregister", "volatile_header"]

Headers = Iterable[Sequence[str]]  # (name, value) pairs, as received or as stored

# Request headers that change between two runs of the same code and say nothing about the
# call: the HTTP plumbing, and what the Stainless-generated SDKs add (their ``x-stainless-``
# telemetry and a fresh ``idempotency-key`` per request). Every request drops them.
VOLATILE_HEADER_PREFIXES: tuple[str, ...] = ("x-stainless-",)
VOLATILE_HEADERS: frozenset[str] = frozenset({"user-agent", "content-length", "host",
                                              "accept-encoding", "connection",
                                              "idempotency-key"})

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


class Provider(ABC):
    """One model API's wire format, as deja reads and writes it.

    An abstract base class rather than a Protocol: most answers are the same for every
    HTTP+JSON API (a stream is ``text/event-stream``, a JSON body is the message, the
    fingerprint hashes the semantic request, cost comes from the price table), so they
    are written once here and a provider overrides only where its format differs; and
    :func:`register` can check that what it is given is one.

    A subclass sets :attr:`name` and :attr:`endpoints` and writes the abstract methods.
    """

    name: str = ""
    endpoints: tuple[str, ...] = ()  # path suffixes of the POST requests that are model calls
    # The environment variables its SDKs read their API key from; an offline replay sets
    # a placeholder in each one left unset (:func:`placeholder_keys`).
    key_env: tuple[str, ...] = ()  # where its SDK looks for an API key: alternatives
    volatile_headers: frozenset[str] = VOLATILE_HEADERS
    volatile_header_prefixes: tuple[str, ...] = VOLATILE_HEADER_PREFIXES
    # Response message fields that differ between any two runs of the same behaviour.
    volatile_message_keys: tuple[str, ...] = ("id",)

    # -- requests

    def is_model_call(self, method: str, url: str) -> bool:
        """Is ``method url`` one of this provider's model calls?"""
        if method.upper() != "POST":
            return False
        path = urlsplit(url).path.rstrip("/")
        return any(path.endswith(suffix) for suffix in self.endpoints)

    def semantic_request(self, body: Any) -> Any:
        """The part of a (redacted, parsed) request body that identifies the call: what a
        replay matches on. The whole body unless the format carries per-call noise."""
        return body

    def fingerprint(self, method: str, url: str, body: Any, parts: Parts | None = None,
                    texts: Texts | None = None) -> str:
        """What a replayed model call is matched by (see
        :func:`recorder.canonical.model_fingerprint`; ``parts`` remembers the digests of
        history, ``texts`` are the body's parts as received)."""
        semantic = self.semantic_request(body)
        return model_fingerprint(method, url, semantic, parts,
                                 texts if semantic is body else None)

    def history_field(self, body: Any) -> str | None:
        """The field of request ``body`` that holds its conversation as a list, which the
        next request of the conversation sends again with more items at its end: a cassette
        stores that request as the items it adds to this one. None when ``body`` holds no
        such list (it is stored whole). This default reads the Messages API's shape."""
        if isinstance(body, dict) and isinstance(body.get("messages"), list):
            return "messages"
        return None

    def request_model(self, body: Any, url: str = "") -> Any:
        """The model a request asks for (None when it names none); ``url``: where it was
        sent, for a format that names the model there (Gemini)."""
        return body.get("model") if isinstance(body, dict) else None

    def request_max_tokens(self, body: Any) -> Any:
        """The ceiling on output tokens a request asks for (None when it sets none)."""
        return body.get("max_tokens") if isinstance(body, dict) else None

    def with_max_tokens(self, body: dict[str, Any], limit: int) -> dict[str, Any]:
        """``body`` with its output-token ceiling lowered to ``limit`` (the budget's
        ``clamp`` mode)."""
        return {**body, "max_tokens": limit}

    def request_streams(self, body: Any, url: str = "") -> bool:
        """Does the request ask for a streamed response? (``url`` as for
        :meth:`request_model`.)"""
        return bool(body.get("stream")) if isinstance(body, dict) else False

    def is_volatile_header(self, name: str) -> bool:
        """Is request header ``name`` one that changes between runs (not stored)?"""
        return _volatile(name, self.volatile_headers, self.volatile_header_prefixes)

    # -- responses

    def is_stream(self, headers: Headers) -> bool:
        """Is a response with these headers a stream (rather than one JSON body)?"""
        return any(k.lower() == "content-type" and "event-stream" in v for k, v in headers)

    def stream_pieces(self, body: bytes) -> list[list[tuple[int, int]]]:
        """Where a stream delivers text in pieces: for each piece-wise value (a content
        block's text, a tool call's arguments), the byte spans in ``body`` of its pieces,
        in order, each the inside of a JSON string as received. Redaction joins each
        value's pieces to find a secret cut across them. None here (no stream format)."""
        return []

    @abstractmethod
    def assemble(self, text: str) -> dict[str, Any]:
        """The message a recorded stream delivers, as the SDK would build it."""

    @abstractmethod
    def synthesize(self, message: dict[str, Any]) -> str:
        """A complete, valid stream that delivers ``message``."""

    def message(self, headers: Headers, text: str) -> Any:
        """The message a response body holds: assembled when the response is a stream,
        else the parsed JSON. Raises ``ValueError`` when the body is neither."""
        if self.is_stream(headers):
            return self.assemble(text)
        try:
            return json.loads(text)
        except RecursionError:  # stored raw, as received: it has no message to show
            raise ValueError("the body is nested too deeply to read as JSON") from None

    @abstractmethod
    def usage(self, message: Any) -> dict[str, int]:
        """The token counts of a complete message, in deja's names (see :class:`Summary`);
        only non-negative 64-bit integers count."""

    @abstractmethod
    def stop_reason(self, message: Any) -> Any:
        """Why the model stopped (None when the message does not say)."""

    @abstractmethod
    def summarize(self, status: int, headers: Headers, body: bytes) -> Summary:
        """Id, model, usage, stop reason or API error of a complete response body, JSON or
        stream. Never raises: the body is stored exactly either way."""

    def summarize_parsed(self, status: int, headers: Headers, body: bytes, doc: Any) -> Summary:
        """:meth:`summarize` of a JSON body ``body`` that a reader already parsed into
        ``doc``: a provider may read ``doc`` rather than parse ``body`` again."""
        return self.summarize(status, headers, body)

    def conversation(self, request: Any, message: Any = None) -> Conversation:
        """The call as a conversation (see :class:`Conversation`): ``request`` is the
        parsed request body, ``message`` the response message (:meth:`message`). This
        default reads the Messages API's shape, which is already deja's."""
        body = request if isinstance(request, dict) else {}
        messages = body.get("messages")
        return {"system": body.get("system"),
                "messages": [m for m in messages if isinstance(m, dict)]
                if isinstance(messages, list) else [],
                "reply": message if isinstance(message, dict) else None,
                "settings": {k: v for k, v in body.items() if k not in ("system", "messages")}}

    def cost(self, model: Any, usage: dict[str, int] | None, prices: PriceTable) -> float | None:
        """The dollar cost of ``usage`` for ``model`` by ``prices`` (None: not priced)."""
        return prices.cost(model, usage)


def _volatile(name: str, exact: frozenset[str], prefixes: tuple[str, ...]) -> bool:
    lowered = name.lower()
    return lowered in exact or lowered.startswith(prefixes)


def volatile_header(name: str, provider: str | None = None) -> bool:
    """Is request header ``name`` one that changes between runs, and so is not stored? By
    the rules of the model call's ``provider``; for any other request, by those every
    request follows (:data:`VOLATILE_HEADERS`, :data:`VOLATILE_HEADER_PREFIXES`)."""
    if provider is not None:
        return get(provider).is_volatile_header(name)
    return _volatile(name, VOLATILE_HEADERS, VOLATILE_HEADER_PREFIXES)


def sse_events(text: str) -> Iterator[tuple[str, str]]:
    """(event, data) pairs of a ``text/event-stream`` body: the framing every SSE API
    shares, whatever its events mean."""
    for block in text.replace("\r\n", "\n").split("\n\n"):
        event, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if data:
            yield event, "\n".join(data)


def data_lines(body: bytes) -> Iterator[tuple[int, bytes]]:
    """(offset, payload) of each ``data:`` line of an event stream's raw bytes."""
    pos = 0
    for line in body.splitlines(keepends=True):
        if line.startswith(b"data:"):
            start = 5 + (1 if line[5:6] == b" " else 0)
            yield pos + start, line[start:].rstrip(b"\r\n")
        pos += len(line)


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


# ---------------------------------------------------------------------- the registry

_lock = threading.Lock()
_providers: dict[str, Provider] = {}
_DEFAULT = "anthropic"
# (method, url) -> its provider: a run calls a handful of URLs thousands of times, and a
# cassette's reader asks for every model line. Cleared whenever the registry changes.
_by_url: dict[tuple[str, str], Provider | None] = {}
_BY_URL_MAX = 1024


def register(provider: Provider, *, replace: bool = False) -> Provider:
    """Make ``provider`` known: its endpoints become model calls for recording and replay.

    A name already registered is refused unless ``replace``; so is an endpoint another
    provider already answers for.
    """
    if not isinstance(provider, Provider):
        raise ConfigError(f"register() takes a recorder.providers.Provider, not "
                          f"{type(provider).__name__}; subclass Provider and pass an instance")
    if not provider.name or not provider.endpoints:
        raise ConfigError(f"provider {type(provider).__name__} needs a name and at least "
                          "one endpoint (a path suffix such as '/v1/messages')")
    with _lock:
        if provider.name in _providers and not replace:
            raise ConfigError(f"a provider named {provider.name!r} is already registered; "
                              "pass replace=True to replace it")
        for other in _providers.values():
            if other.name == provider.name:
                continue
            taken = set(other.endpoints) & set(provider.endpoints)
            if taken:
                raise ConfigError(f"provider {provider.name!r}: endpoint "
                                  f"{sorted(taken)[0]!r} already belongs to {other.name!r}; "
                                  "unregister that provider first")
        _providers[provider.name] = provider
        _by_url.clear()
    return provider


def unregister(name: str) -> None:
    """Forget the provider ``name`` (the built-in default stays)."""
    if name == _DEFAULT:
        raise ConfigError(f"the {_DEFAULT!r} provider is the default reader of every "
                          "cassette and cannot be unregistered; register a replacement "
                          "with replace=True instead")
    with _lock:
        _providers.pop(name, None)
        _by_url.clear()


# What an offline replay puts in an API key variable left unset: the SDKs refuse to build a
# client without a key, though a replay sends nothing to the network.
PLACEHOLDER_KEY = "deja-replay-placeholder-key"


def placeholder_keys(environ: Mapping[str, str]) -> dict[str, str]:
    """:data:`PLACEHOLDER_KEY` for each registered provider whose API key ``environ``
    leaves unset or empty, so that an agent that builds its client the usual way
    (``anthropic.Anthropic()``) replays in CI, where no key is set. A provider's
    :attr:`Provider.key_env` are alternatives (Gemini's SDK reads ``GEMINI_API_KEY`` or
    ``GOOGLE_API_KEY``): when one is set none is added, else the first is."""
    return {provider.key_env[0]: PLACEHOLDER_KEY for provider in list(_providers.values())
            if provider.key_env and not any(environ.get(var) for var in provider.key_env)}


def names() -> tuple[str, ...]:
    """The names of the registered providers."""
    return tuple(_providers)


def endpoints() -> tuple[tuple[str, str], ...]:
    """(path suffix, provider name) of every endpoint whose exchanges are model turns."""
    return tuple((suffix, p.name) for p in _providers.values() for suffix in p.endpoints)


def get(name: str) -> Provider:
    """The provider registered as ``name``."""
    try:
        return _providers[name]
    except KeyError:
        raise ConfigError(f"no provider named {name!r} is registered (known: "
                          f"{', '.join(sorted(_providers))}); register it with "
                          "recorder.providers.register") from None


def default() -> Provider:
    """The provider that reads what names no registered provider: Anthropic's format,
    which every cassette written before providers had names was in."""
    return _providers[_DEFAULT]


def for_url(method: str, url: str) -> Provider | None:
    """The provider of a model endpoint, or None when ``method url`` is not a model call."""
    key = (method, url)
    try:
        return _by_url[key]
    except KeyError:
        pass
    found = next((p for p in tuple(_providers.values()) if p.is_model_call(method, url)), None)
    if len(_by_url) >= _BY_URL_MAX:
        _by_url.clear()
    _by_url[key] = found
    return found


def history_field(body: Any) -> str | None:
    """The field of a model request ``body`` that holds its growing conversation, as the
    first registered provider that finds one says (:meth:`Provider.history_field`); None
    when none does. Asked of the body alone, as the cassette writer stores it: keeping a
    list as the items it adds to an earlier request's is exact whatever the list means, so
    a field found by another provider's rule costs nothing but the saving."""
    for provider in tuple(_providers.values()):
        field = provider.history_field(body)
        if field is not None:
            return field
    return None


def model_provider(method: str, url: str) -> str | None:
    """The provider name of a model endpoint, or None when ``url`` is not a model call."""
    provider = for_url(method, url)
    return provider.name if provider is not None else None


def for_line(obs: Mapping[str, Any]) -> Provider:
    """The provider that reads a recorded (expanded) line: the one it names, else the
    default (an HTTP line, or a provider this process has not registered)."""
    name = obs.get("provider")
    provider = _providers.get(name) if isinstance(name, str) else None
    return provider if provider is not None else default()


# The providers every deja reads: a line of theirs may leave its provider out (the reader
# finds it by the URL); any other provider's lines always name it.
BUILT_IN = frozenset({"anthropic", "openai"})


def _register_builtins() -> None:
    from recorder.providers.anthropic import AnthropicProvider
    from recorder.providers.gemini import GeminiProvider
    from recorder.providers.openai import OpenAIProvider

    register(AnthropicProvider())
    register(OpenAIProvider())
    register(GeminiProvider())


_register_builtins()
