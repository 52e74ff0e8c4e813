"""Providers: what each model API's wire format means, and how it travels, behind one seam.

Recording, replay, editing, diffing, export and the viewer all need to know things about
a model API: which endpoints are model calls, what part of a request identifies it, how a
response is streamed, where its usage, stop reason and id are, which request headers
change from one run to the next. Each of those questions is asked of a :class:`Provider`,
found by the endpoint (:func:`for_url`), by its name (:func:`get`) or for a recorded line
(:func:`for_line`). A provider is a :class:`Format` (what the messages mean) carried by a
:class:`Carriage` (endpoints, auth headers, stream framing): see
:mod:`recorder.providers.base`. The registry (:mod:`recorder.providers.registry`) holds
them; a new API is a format module, or a carriage module for a format deja knows, and one
:func:`register` call.

Built in: the Messages format (:mod:`recorder.providers.anthropic`) over Anthropic's API
and over Amazon Bedrock (:mod:`recorder.providers.bedrock`, AWS's binary event stream);
OpenAI's Chat Completions and Responses (:mod:`recorder.providers.openai`); Google's
Gemini API (:mod:`recorder.providers.gemini`).

This package sits below capture, cassette reading and replay: it imports only
:mod:`recorder.errors`, :mod:`recorder.canonical` and its own modules.
"""

from __future__ import annotations

from recorder.providers.base import (
    USAGE_KEYS,
    VOLATILE_HEADER_PREFIXES,
    VOLATILE_HEADERS,
    Carriage,
    Conversation,
    Format,
    Headers,
    Provider,
    Summary,
    data_lines,
    sse_events,
    string_spans,
    token_counts,
)
from recorder.providers.pricing import CACHE_WRITE_1H
from recorder.providers.registry import (
    BUILT_IN,
    PLACEHOLDER_KEY,
    answer_meta_keys,
    base_url_env,
    default,
    endpoints,
    for_line,
    for_url,
    formats,
    get,
    history_field,
    model_provider,
    names,
    placeholder_keys,
    register,
    stream_carriage,
    unregister,
    volatile_header,
)
from recorder.providers.replies import replied

__all__ = ["BUILT_IN", "CACHE_WRITE_1H", "PLACEHOLDER_KEY", "USAGE_KEYS", "VOLATILE_HEADERS",
           "VOLATILE_HEADER_PREFIXES", "Carriage", "Conversation", "Format", "Headers", "Provider",
           "Summary", "answer_meta_keys", "base_url_env", "data_lines", "default", "endpoints",
           "for_line", "for_url", "formats", "get", "history_field", "model_provider", "names",
           "placeholder_keys", "register", "replied", "sse_events", "stream_carriage",
           "string_spans", "token_counts", "unregister", "volatile_header"]
