"""Providers: what each model API's wire format means, behind one small seam."""

from __future__ import annotations

from urllib.parse import urlsplit

# (path suffix, provider) of the endpoints whose exchanges are model turns.
MODEL_ENDPOINTS = (
    ("/v1/messages", "anthropic"),
    ("/v1/chat/completions", "openai"),
    ("/v1/responses", "openai"),
)


def model_provider(method: str, url: str) -> str | None:
    """The provider of a model endpoint, or None when ``url`` is not a model call."""
    if method.upper() != "POST":
        return None
    path = urlsplit(url).path.rstrip("/")
    for suffix, provider in MODEL_ENDPOINTS:
        if path.endswith(suffix):
            return provider
    return None
