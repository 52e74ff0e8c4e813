"""Dollar cost of a model turn from its usage, by a price table per model.

Prices are US dollars per million tokens: input, output, cache write, cache read. A model
is looked up by exact name, then by the longest table key that prefixes it (so dated
snapshots such as ``claude-sonnet-4-5-20250929`` find ``claude-sonnet-4-5``). Override or
extend the table with ``record(prices=...)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from recorder.errors import ConfigError


@dataclass(frozen=True)
class Price:
    input: float
    output: float
    cache_write: float | None = None
    cache_read: float | None = None

    def cost(self, usage: Mapping[str, Any]) -> float:
        tokens_in = usage.get("input_tokens") or 0
        tokens_out = usage.get("output_tokens") or 0
        write = usage.get("cache_creation_input_tokens") or 0
        read = usage.get("cache_read_input_tokens") or 0
        cw = self.cache_write if self.cache_write is not None else self.input * 1.25
        cr = self.cache_read if self.cache_read is not None else self.input * 0.1
        dollars = (tokens_in * self.input + tokens_out * self.output + write * cw + read * cr)
        return round(dollars / 1_000_000, 8)


DEFAULT_PRICES: dict[str, Price] = {
    "claude-opus-4-5": Price(5.0, 25.0),
    "claude-opus-4-1": Price(15.0, 75.0),
    "claude-opus-4": Price(15.0, 75.0),
    "claude-sonnet-4-5": Price(3.0, 15.0),
    "claude-sonnet-4": Price(3.0, 15.0),
    "claude-3-7-sonnet": Price(3.0, 15.0),
    "claude-haiku-4-5": Price(1.0, 5.0),
    "claude-3-5-haiku": Price(0.8, 4.0),
    "claude-3-haiku": Price(0.25, 1.25),
}


class PriceTable:
    def __init__(self, overrides: Mapping[str, Any] | None = None) -> None:
        self._prices = dict(DEFAULT_PRICES)
        for model, value in (overrides or {}).items():
            self._prices[model] = _price(model, value)
        self._keys = sorted(self._prices, key=len, reverse=True)

    def lookup(self, model: str | None) -> Price | None:
        if not model:
            return None
        if model in self._prices:
            return self._prices[model]
        for key in self._keys:
            if model.startswith(key):
                return self._prices[key]
        return None

    def cost(self, model: str | None, usage: Mapping[str, Any] | None) -> float | None:
        price = self.lookup(model)
        if price is None or not usage:
            return None
        return price.cost(usage)


def _price(model: str, value: Any) -> Price:
    if isinstance(value, Price):
        return value
    try:
        if isinstance(value, Mapping):
            price = Price(**{k: float(v) for k, v in value.items()})
        else:
            price = Price(*(float(v) for v in value))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"price for {model!r} must be (input, output[, cache_write, "
                          f"cache_read]) dollars per million tokens: {exc}") from None
    if min(p for p in (price.input, price.output) if p is not None) < 0:
        raise ConfigError(f"price for {model!r} is negative")
    return price
