"""Model endpoints deja recognises but has no provider module for, read as they always were.

The OpenAI chat completions and responses endpoints are model calls (recorded as ``model``
lines, replayed by fingerprint), and their responses are read the way deja read every
model response before providers had modules of their own: an event stream by the Anthropic
rules (an OpenAI stream then yields no usage), a JSON body by its shape (a chat
completion's ``prompt_tokens``, ``completion_tokens`` and first choice's
``finish_reason``). A real provider module registered under the same name with
``replace=True`` takes over from this one.
"""

from __future__ import annotations

from typing import Any

from recorder.providers import token_counts
from recorder.providers.anthropic import AnthropicProvider

__all__ = ["FallbackProvider"]


class FallbackProvider(AnthropicProvider):
    def __init__(self, name: str, endpoints: tuple[str, ...]) -> None:
        self.name = name
        self.endpoints = endpoints

    def usage(self, message: Any) -> dict[str, int]:
        usage = message.get("usage") if isinstance(message, dict) else None
        usage = usage if isinstance(usage, dict) else {}
        return token_counts({"input_tokens": usage.get("prompt_tokens", 0),
                             "output_tokens": usage.get("completion_tokens", 0)})

    def stop_reason(self, message: Any) -> Any:
        if isinstance(message, dict) and "choices" in message:  # a chat completion
            choice = (message.get("choices") or [{}])[0]
            return choice.get("finish_reason") if isinstance(choice, dict) else None
        return super().stop_reason(message)
