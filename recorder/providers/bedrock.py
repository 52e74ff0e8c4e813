"""Amazon Bedrock as a carriage: Claude's Messages format over Bedrock's endpoints.

The anthropic SDK's Bedrock client (``anthropic.AnthropicBedrock``) sends a Messages
request to ``POST /model/{model id}/invoke`` (``/invoke-with-response-stream`` for a
stream) at ``bedrock-runtime.{region}.amazonaws.com``: the model and streaming are named
in the URL, not the body, which says ``anthropic_version`` instead. Each request is signed
with AWS SigV4 (``authorization``, ``x-amz-date``, ``x-amz-content-sha256``, and
``x-amz-security-token`` with temporary credentials), or carries a Bedrock API key as a
bearer token: headers that differ on every run and are not stored. A streamed answer is
AWS's binary event stream (``application/vnd.amazon.eventstream``): frames with a CRC,
each chunk carrying one Messages event as base64 JSON. The carriage reads a body as the
text of those events, so the Messages format (:mod:`recorder.providers.anthropic`)
assembles, summarises and redacts it as it does Anthropic's own stream, and frames a
synthesised stream back into event-stream frames (:mod:`recorder.providers._eventstream`).

Only Claude's model ids (``anthropic.claude-...``, a cross-region profile such as
``us.anthropic.claude-...``) and ARNs (an inference profile names no family) are model
calls here: another family's invoke endpoint speaks another format and is recorded as
plain HTTP.

An offline replay with no AWS credentials set gets placeholder ones
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), so the client signs as usual; not a
placeholder Bedrock API key, which the client refuses beside credentials given in code.
It still needs a region (``AWS_REGION``), which it reads before it sends anything. Any
region replays: a replay matches a model call by its path, not its host.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

from recorder.providers import _eventstream
from recorder.providers.anthropic import MessagesFormat
from recorder.providers.base import (
    PLACEHOLDER_KEY,
    VOLATILE_HEADER_PREFIXES,
    VOLATILE_HEADERS,
    Carriage,
    Headers,
    Provider,
)

__all__ = ["BedrockCarriage", "model_of_url", "provider"]

# A Claude model id on Bedrock: an optional geography (a cross-region profile), the
# vendor, Anthropic's name, a version
_CLAUDE_ID = re.compile(r"(?:[a-z]{2,6}\.)?anthropic\.(claude-[a-z0-9.-]+?)(?:-v\d+(?::\d+)?)?")
INVOKE = "/invoke"
STREAM = "/invoke-with-response-stream"
EVENT_STREAM = "application/vnd.amazon.eventstream"


def provider() -> Provider:
    """The Messages format over Amazon Bedrock."""
    return Provider("bedrock", MessagesFormat(), BedrockCarriage())


def model_of_url(url: str) -> str | None:
    """The model id a Bedrock invoke URL names (``/model/anthropic.claude-x:0/invoke``
    names ``anthropic.claude-x:0``); None when the URL is no invoke URL."""
    path = urlsplit(url).path.rstrip("/")
    for suffix in (STREAM, INVOKE):
        if path.endswith(suffix):
            head = path[:-len(suffix)]
            at = head.rfind("/model/")
            if at >= 0 and "/" not in head[at + len("/model/"):]:
                return unquote(head[at + len("/model/"):]) or None
    return None


class BedrockCarriage(Carriage):
    """Bedrock's invoke endpoints, SigV4 or bearer auth, the binary event stream."""

    def __init__(self) -> None:
        super().__init__(
            (INVOKE, STREAM),
            # a Bedrock API key, else AWS credentials (the SDK reads those through boto3):
            # when one is set, a replay adds no placeholder
            key_env=("AWS_BEARER_TOKEN_BEDROCK", "AWS_ACCESS_KEY_ID", "AWS_PROFILE"),
            base_url_env={"ANTHROPIC_BEDROCK_BASE_URL": ""},
            volatile_headers=VOLATILE_HEADERS | {
                "authorization", "x-amz-date", "x-amz-content-sha256",
                "x-amz-security-token", "amz-sdk-invocation-id", "amz-sdk-request"},
            volatile_header_prefixes=VOLATILE_HEADER_PREFIXES)

    def placeholders(self, environ: Mapping[str, str]) -> dict[str, str]:
        """Placeholder AWS credentials when none is set (see the module docstring)."""
        if any(environ.get(var) for var in self.key_env):
            return {}
        return {"AWS_ACCESS_KEY_ID": PLACEHOLDER_KEY, "AWS_SECRET_ACCESS_KEY": PLACEHOLDER_KEY}

    def is_model_call(self, method: str, url: str) -> bool:
        if method.upper() != "POST":
            return False
        model = model_of_url(url)
        return model is not None and (model.startswith("arn:") or "anthropic." in model)

    def request_model(self, url: str) -> str | None:
        return model_of_url(url)

    def price_names(self, model: str) -> tuple[str, ...]:
        """The Bedrock id (an override keyed by it wins), then Anthropic's name for the
        model, which Bedrock bills at Anthropic's rates: ``us.anthropic.claude-sonnet-4-
        20250514-v1:0`` is priced as ``claude-sonnet-4-20250514``. An inference profile's
        ARN names no model: it is priced only by an override keyed by the ARN."""
        name = _CLAUDE_ID.fullmatch(model)
        return (model, name.group(1)) if name else (model,)

    def request_streams(self, url: str) -> bool | None:
        return urlsplit(url).path.rstrip("/").endswith(STREAM)

    def is_stream(self, headers: Headers) -> bool:
        return any(k.lower() == "content-type" and v.startswith(EVENT_STREAM)
                   for k, v in headers)

    def view(self, body: bytes) -> bytes:
        return _eventstream.text_view(body).encode("utf-8")

    def text(self, body: bytes) -> str:
        return _eventstream.text_view(body)

    def frame(self, text: str) -> bytes:
        return _eventstream.from_text(text)

    def restream(self, body: bytes, view: bytes) -> bytes:
        """The frames of ``body`` with the edited events; frames written anew (without
        Bedrock's padding) if the edit changed how many events there are."""
        try:
            return _eventstream.restream(body, view.decode("utf-8"))
        except ValueError:
            return _eventstream.from_text(view.decode("utf-8", "replace"))

