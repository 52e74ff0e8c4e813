"""The providers deja knows, found by endpoint, by name or for a recorded line.

Separate from :mod:`recorder.providers.base` so that a format or carriage module imports
the base alone and the registry imports the built-in modules, never the other way round.

Besides the built-in providers, a package can add its own through the ``deja.providers``
entry point group: each entry names a callable that returns a :class:`Provider` (or a
``Provider`` itself), registered the first time the registry is asked anything, in every
process deja runs in (a recording, a replay, ``deja proxy``, the viewer)::

    [project.entry-points."deja.providers"]
    toy = "toy_deja:provider"

A plugin that fails to load is logged and left out; a built-in provider's name or
endpoint is not taken over by one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from recorder.errors import ConfigError
from recorder.providers.base import (
    PLACEHOLDER_KEY,
    VOLATILE_HEADER_PREFIXES,
    VOLATILE_HEADERS,
    Carriage,
    Format,
    Headers,
    Provider,
    is_volatile,
)

__all__ = ["BUILT_IN", "ENTRY_POINTS", "PLACEHOLDER_KEY", "default", "endpoints", "for_line",
           "for_url", "formats", "get", "history_field", "load_plugins", "model_provider", "names",
           "placeholder_keys", "register", "stream_carriage", "unregister", "volatile_header"]

ENTRY_POINTS = "deja.providers"  # the entry point group of provider plugins

log = logging.getLogger("deja.providers")

_lock = threading.Lock()
_plugins_loaded = False
_plugin_lock = threading.RLock()
_providers: dict[str, Provider] = {}
_DEFAULT = "anthropic"
# (method, url) -> its provider: a run calls a handful of URLs thousands of times, and a
# cassette's reader asks for every model line. Cleared whenever the registry changes.
_by_url: dict[tuple[str, str], Provider | None] = {}
_BY_URL_MAX = 1024

# The providers every deja reads: a line of theirs may leave its provider out (the reader
# finds it by the URL); any other provider's lines always name it.
BUILT_IN = frozenset({"anthropic", "openai"})


def register(provider: Provider, *, replace: bool = False) -> Provider:
    """Make ``provider`` known: its endpoints become model calls for recording and replay.

    A name already registered is refused unless ``replace``; so is an endpoint another
    provider already answers for.
    """
    if not isinstance(provider, Provider):
        raise ConfigError(f"register() takes a recorder.providers.Provider, not "
                          f"{type(provider).__name__}; build one as Provider(name, format, "
                          "carriage)")
    if not provider.name or not provider.endpoints:
        raise ConfigError(f"provider {provider.name or type(provider).__name__!r} needs a "
                          "name and a carriage with at least one endpoint (a path suffix "
                          "such as '/v1/messages')")
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


def placeholder_keys(environ: Mapping[str, str]) -> dict[str, str]:
    """What an offline replay adds to ``environ`` so that an agent that builds its client
    the usual way (``anthropic.Anthropic()``) replays in CI, where no key is set: for each
    registered provider whose API key ``environ`` leaves unset, :data:`PLACEHOLDER_KEY`
    (and what else its carriage needs, :meth:`Carriage.placeholders`)."""
    _plugins()
    added: dict[str, str] = {}
    for provider in list(_providers.values()):
        for var, value in provider.carriage.placeholders(environ).items():
            added.setdefault(var, value)
    return added


def base_url_env(url: str) -> dict[str, str]:
    """The environment that points every registered provider's SDK at the server ``url``
    (one that speaks each API at its usual paths, as ``deja stub`` does): each carriage's
    base-URL variables (:attr:`Carriage.base_url_env`). A ``/v1`` that ends ``url`` is
    the OpenAI SDK's, given only where a carriage asks for it."""
    _plugins()
    base = url.rstrip("/")
    base = base.removesuffix("/v1")
    out: dict[str, str] = {}
    for provider in list(_providers.values()):
        for var, suffix in provider.carriage.base_url_env.items():
            out.setdefault(var, base + suffix)
    return out


def answer_meta_keys() -> frozenset[str]:
    """The response fields any registered format says tell how an answer was produced,
    not what it says (:attr:`Format.answer_meta_keys`)."""
    return frozenset(key for fmt in formats() for key in fmt.answer_meta_keys)


def names() -> tuple[str, ...]:
    """The names of the registered providers."""
    _plugins()
    return tuple(_providers)


def formats() -> tuple[Format, ...]:
    """The registered providers' formats, each kind once (Anthropic's and Bedrock's are
    one format: asking both would read a stream twice)."""
    _plugins()
    kinds: dict[type[Format], Format] = {}
    for provider in tuple(_providers.values()):
        kinds.setdefault(type(provider.format), provider.format)
    return tuple(kinds.values())


def endpoints() -> tuple[tuple[str, str], ...]:
    """(path suffix, provider name) of every endpoint whose exchanges are model turns."""
    _plugins()
    return tuple((suffix, p.name) for p in _providers.values() for suffix in p.endpoints)


def get(name: str) -> Provider:
    """The provider registered as ``name``."""
    _plugins()
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
    _plugins()
    found = next((p for p in tuple(_providers.values()) if p.is_model_call(method, url)), None)
    if len(_by_url) >= _BY_URL_MAX:
        _by_url.clear()
    _by_url[key] = found
    return found


def model_provider(method: str, url: str) -> str | None:
    """The provider name of a model endpoint, or None when ``url`` is not a model call."""
    provider = for_url(method, url)
    return provider.name if provider is not None else None


def for_line(obs: Mapping[str, Any]) -> Provider:
    """The provider that reads a recorded (expanded) line: the one it names, else the
    default (an HTTP line, or a provider this process has not registered)."""
    name = obs.get("provider")
    if isinstance(name, str) and name not in _providers:
        _plugins()
    provider = _providers.get(name) if isinstance(name, str) else None
    return provider if provider is not None else default()


def history_field(body: Any) -> str | None:
    """The field of a model request ``body`` that holds its growing conversation, as the
    first registered provider that finds one says (:meth:`Format.history_field`); None
    when none does. Asked of the body alone, as the cassette writer stores it: keeping a
    list as the items it adds to an earlier request's is exact whatever the list means, so
    a field found by another provider's rule costs nothing but the saving."""
    for provider in tuple(_providers.values()):
        field = provider.history_field(body)
        if field is not None:
            return field
    return None


def stream_carriage(headers: Headers) -> Carriage | None:
    """The carriage of the first registered provider that takes a response with these
    headers for a stream (None: no stream any of them frames). Asked of any response, a
    model call's or not: redaction reads a stream's text through it."""
    pairs = [tuple(pair) for pair in headers]
    return next((p.carriage for p in tuple(_providers.values())
                 if p.carriage.is_stream(pairs)), None)


def volatile_header(name: str, provider: str | None = None) -> bool:
    """Is request header ``name`` one that changes between runs, and so is not stored? By
    the rules of the model call's ``provider``; for any other request, by those every
    request follows (:data:`VOLATILE_HEADERS`, :data:`VOLATILE_HEADER_PREFIXES`)."""
    if provider is not None:
        return get(provider).is_volatile_header(name)
    return is_volatile(name, VOLATILE_HEADERS, VOLATILE_HEADER_PREFIXES)


def _plugins() -> None:
    """Load the plugins once, the first time the registry is asked."""
    if not _plugins_loaded:
        load_plugins()


def load_plugins() -> list[str]:
    """Register the providers of the ``deja.providers`` entry points not registered yet
    (again: a package installed since the last look); the names registered. Called the
    first time the registry is asked anything; call it again after installing one."""
    global _plugins_loaded
    from importlib.metadata import entry_points

    with _plugin_lock:
        _plugins_loaded = True
        return [name for entry in entry_points(group=ENTRY_POINTS)
                if entry.name not in _providers and (name := _load(entry)) is not None]


def _load(entry: Any) -> str | None:
    """Register the provider of one entry point; its name (None: it failed, logged)."""
    try:
        made = entry.load()
        provider = made if isinstance(made, Provider) else made()
        register(provider)
    except Exception as exc:  # noqa: BLE001 (a broken plugin is left out, and said)
        log.warning("provider plugin %s (%s) not loaded: %s: %s", entry.name, entry.value,
                    type(exc).__name__, exc)
        return None
    return str(provider.name)


def _register_builtins() -> None:
    from recorder.providers import anthropic, bedrock, gemini, openai

    for module in (anthropic, openai, gemini, bedrock):
        register(module.provider())


_register_builtins()
