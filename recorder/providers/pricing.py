"""Dollar cost of a model turn from its usage, by a price table per model.

Prices are US dollars per million tokens, one rate per kind of token a provider bills:

- ``input``: prompt tokens read without the cache;
- ``output``: generated tokens (thinking and reasoning tokens included);
- ``cache_write``: prompt tokens written to the cache with the default (5-minute) lifetime;
- ``cache_write_1h``: prompt tokens written to the cache with a 1-hour lifetime;
- ``cache_read``: prompt tokens read from the cache.

A usage (:data:`recorder.providers.USAGE_KEYS`) counts them apart, by Anthropic's rule:
``input_tokens`` excludes the cache reads (``cache_read_input_tokens``) and the cache
writes (``cache_creation_input_tokens``, all lifetimes). Of the writes, those made with
the 1-hour lifetime are ``cache_creation_1h_input_tokens`` (:data:`CACHE_WRITE_1H`), or
``cache_creation.ephemeral_1h_input_tokens`` in a usage as Anthropic sends it; the rest
are charged as 5-minute writes. An OpenAI or a Gemini usage is normalised to the same
names (its cached prompt tokens are cache reads; it reports no writes), so every provider
is priced by one rule.

The bundled prices (:data:`DEFAULT_PRICES`) are the standard, pay-as-you-go rates the
providers published on their pricing pages, as of :data:`PRICES_AS_OF`:

- Anthropic, https://docs.claude.com/en/docs/about-claude/pricing: base input, 5-minute
  cache writes (1.25x input), 1-hour cache writes (2x input), cache hits (0.1x input),
  output. Long-context (over 200K input tokens), batch and regional rates are not
  applied.
- OpenAI, https://platform.openai.com/docs/pricing (the Standard tier): input, cached
  input (as ``cache_read``), output. OpenAI charges nothing extra to write its cache, so
  ``cache_write`` is the input rate; a model with no cached-input discount has
  ``cache_read`` at the input rate too.
- Google Gemini, https://ai.google.dev/gemini-api/docs/pricing (the paid tier, text,
  image and video input, prompts up to 200K tokens): input, context caching (as
  ``cache_read``), output (thinking tokens included). Gemini bills cache storage by the
  hour rather than per write, so ``cache_write`` is the input rate; a model without
  context caching has ``cache_read`` at the input rate. Audio input, prompts over 200K
  tokens, batch and image output rates are not applied.

A model is looked up by exact name, then by the longest table key that prefixes it (so
dated snapshots such as ``claude-sonnet-4-5-20250929`` find ``claude-sonnet-4-5``).
Override or extend the table with ``record(prices=...)`` or ``[tool.deja.prices]``: a
model maps to ``[input, output]``, ``[input, output, cache_write, cache_read]`` or
``[..., cache_write_1h]``, or to a table of those names. A rate left out follows
Anthropic's multipliers of the input rate (writes 1.25x, 1-hour writes 2x, reads 0.1x).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from recorder.errors import ConfigError

__all__ = ["CACHE_WRITE_1H", "DEFAULT_PRICES", "PRICES_AS_OF", "Price", "PriceTable"]

PRICES_AS_OF = "2026-02"

# deja's name for the part of ``cache_creation_input_tokens`` written with a 1-hour lifetime.
CACHE_WRITE_1H = "cache_creation_1h_input_tokens"

# Anthropic's multipliers of the input rate, for a rate a price leaves out.
_WRITE, _WRITE_1H, _READ = 1.25, 2.0, 0.1


@dataclass(frozen=True)
class Price:
    """The rates of one model, dollars per million tokens (see the module docstring)."""

    input: float
    output: float
    cache_write: float | None = None  # None: 1.25x input
    cache_read: float | None = None  # None: 0.1x input
    cache_write_1h: float | None = None  # None: 2x input

    @property
    def write_rate(self) -> float:
        return self.input * _WRITE if self.cache_write is None else self.cache_write

    @property
    def write_1h_rate(self) -> float:
        return self.input * _WRITE_1H if self.cache_write_1h is None else self.cache_write_1h

    @property
    def read_rate(self) -> float:
        return self.input * _READ if self.cache_read is None else self.cache_read

    def cost(self, usage: Mapping[str, Any]) -> float:
        """The dollars ``usage`` costs, rounded to 8 places (a hundred-millionth of a
        dollar: finer than any provider bills)."""
        writes = _count(usage, "cache_creation_input_tokens")
        split = usage.get("cache_creation")
        split = split if isinstance(split, Mapping) else {}
        one_hour = _count(usage, CACHE_WRITE_1H) or _count(split, "ephemeral_1h_input_tokens")
        five_min = (max(writes - one_hour, 0) if writes
                    else _count(split, "ephemeral_5m_input_tokens"))
        dollars = (_count(usage, "input_tokens") * self.input
                   + _count(usage, "output_tokens") * self.output
                   + five_min * self.write_rate + one_hour * self.write_1h_rate
                   + _count(usage, "cache_read_input_tokens") * self.read_rate)
        return round(dollars / 1_000_000, 8)


def _count(usage: Mapping[str, Any], key: str) -> int | float:
    """A token count of ``usage``: a non-negative number, else none (0)."""
    value = usage.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return value if value > 0 and math.isfinite(value) else 0


# Anthropic, dollars per million tokens.
#  model                 input   output  5m write  1h write  cache read
_ANTHROPIC = (
    ("claude-opus-4-6",    5.00,  25.00,    6.25,    10.00,     0.50),
    ("claude-opus-4-5",    5.00,  25.00,    6.25,    10.00,     0.50),
    ("claude-opus-4-1",   15.00,  75.00,   18.75,    30.00,     1.50),
    ("claude-opus-4",     15.00,  75.00,   18.75,    30.00,     1.50),
    ("claude-sonnet-4-6",  3.00,  15.00,    3.75,     6.00,     0.30),
    ("claude-sonnet-4-5",  3.00,  15.00,    3.75,     6.00,     0.30),
    ("claude-sonnet-4",    3.00,  15.00,    3.75,     6.00,     0.30),
    ("claude-haiku-4-5",   1.00,   5.00,    1.25,     2.00,     0.10),
    ("claude-3-opus",     15.00,  75.00,   18.75,    30.00,     1.50),
    ("claude-3-7-sonnet",  3.00,  15.00,    3.75,     6.00,     0.30),
    ("claude-3-5-sonnet",  3.00,  15.00,    3.75,     6.00,     0.30),
    ("claude-3-5-haiku",   0.80,   4.00,    1.00,     1.60,     0.08),
    ("claude-3-haiku",     0.25,   1.25,    0.30,     0.50,     0.03),
)

# OpenAI (Standard tier), dollars per million tokens; None: no cached-input discount.
# A variant priced apart from its family (gpt-5-pro, o3-pro, ...) needs its own row, or
# the longest prefix would price it as the family.
#  model                    input   cached   output
_OPENAI = (
    ("gpt-5.2",              1.75,   0.175,   14.00),
    ("gpt-5.2-pro",         21.00,   None,   168.00),
    ("gpt-5.1",              1.25,   0.125,   10.00),
    ("gpt-5.1-codex-mini",   0.25,   0.025,    2.00),
    ("gpt-5",                1.25,   0.125,   10.00),
    ("gpt-5-mini",           0.25,   0.025,    2.00),
    ("gpt-5-nano",           0.05,   0.005,    0.40),
    ("gpt-5-pro",           15.00,   None,   120.00),
    ("gpt-4.1",              2.00,   0.50,     8.00),
    ("gpt-4.1-mini",         0.40,   0.10,     1.60),
    ("gpt-4.1-nano",         0.10,   0.025,    0.40),
    ("gpt-4o",               2.50,   1.25,    10.00),
    ("gpt-4o-2024-05-13",    5.00,   None,    15.00),
    ("gpt-4o-mini",          0.15,   0.075,    0.60),
    ("o1",                  15.00,   7.50,    60.00),
    ("o1-mini",              1.10,   0.55,     4.40),
    ("o1-pro",             150.00,   None,   600.00),
    ("o3",                   2.00,   0.50,     8.00),
    ("o3-mini",              1.10,   0.55,     4.40),
    ("o3-pro",              20.00,   None,    80.00),
    ("o3-deep-research",    10.00,   2.50,    40.00),
    ("o4-mini",              1.10,   0.275,    4.40),
)

# Google Gemini (paid tier, prompts up to 200K tokens), dollars per million tokens; None:
# no context caching. A variant priced apart from its family (an image or audio model)
# needs its own row, as for OpenAI.
#  model                    input   cached   output
_GEMINI = (
    ("gemini-3-pro",         2.00,   0.20,    12.00),
    ("gemini-3-flash",       0.50,   0.05,     3.00),
    ("gemini-2.5-pro",       1.25,   0.125,   10.00),
    ("gemini-2.5-flash",     0.30,   0.03,     2.50),
    ("gemini-2.5-flash-lite", 0.10,  0.01,     0.40),
    ("gemini-2.0-flash",     0.10,   0.025,    0.40),
    ("gemini-2.0-flash-lite", 0.075, None,     0.30),
)

DEFAULT_PRICES: dict[str, Price] = {
    **{model: Price(inp, out, cache_write=w5, cache_read=r, cache_write_1h=w1)
       for model, inp, out, w5, w1, r in _ANTHROPIC},
    **{model: Price(inp, out, cache_write=inp, cache_read=inp if cached is None else cached,
                    cache_write_1h=inp)
       for model, inp, cached, out in (*_OPENAI, *_GEMINI)},
}
"""The bundled prices, by model name or prefix (see the module docstring for sources)."""


class PriceTable:
    """:data:`DEFAULT_PRICES` with a run's overrides (``record(prices=...)``,
    ``[tool.deja.prices]``) on top; an override replaces a model's price whole."""

    def __init__(self, overrides: Mapping[str, Any] | None = None) -> None:
        self._prices = dict(DEFAULT_PRICES)
        for model, value in (overrides or {}).items():
            if not isinstance(model, str) or not model:
                raise ConfigError(f"a price is keyed by a model name (or prefix), not "
                                  f"{model!r}")
            self._prices[model] = _price(model, value)
        self._keys = sorted(self._prices, key=len, reverse=True)

    def lookup(self, model: str | None) -> Price | None:
        """The price of ``model``: its exact entry, else the longest key that prefixes it
        (None: not priced)."""
        if not model:
            return None
        if model in self._prices:
            return self._prices[model]
        for key in self._keys:
            if model.startswith(key):
                return self._prices[key]
        return None

    def cost(self, model: str | None, usage: Mapping[str, Any] | None) -> float | None:
        """The dollars ``usage`` cost on ``model`` (None: the model has no price, or there
        is no usage)."""
        price = self.lookup(model)
        if price is None or not usage:
            return None
        return price.cost(usage)


_FIELDS = tuple(f.name for f in fields(Price))  # input, output, cache_write, cache_read, 1h
_SHAPE = ("[input, output] (optionally then cache_write, cache_read, cache_write_1h) or a "
          "table of " + ", ".join(_FIELDS) + ", in dollars per million tokens")


def _price(model: str, value: Any) -> Price:
    """A :class:`Price` from an override: a Price, a list of rates or a table of them."""
    if isinstance(value, Price):
        rates = {f: getattr(value, f) for f in _FIELDS}
    elif isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in _FIELDS)
        if unknown:
            raise ConfigError(f"price for {model!r}: unknown field(s) {', '.join(unknown)}; "
                              f"give {_SHAPE}")
        missing = [f for f in ("input", "output") if f not in value]
        if missing:
            raise ConfigError(f"price for {model!r} has no {' or '.join(missing)} rate; "
                              f"give {_SHAPE}")
        rates = dict(value)
    elif isinstance(value, list | tuple) and 2 <= len(value) <= len(_FIELDS):
        rates = dict(zip(_FIELDS, value, strict=False))
    else:
        raise ConfigError(f"price for {model!r} must be {_SHAPE}, not {value!r}")
    checked: dict[str, Any] = {}
    for name, rate in rates.items():
        if rate is None and name not in ("input", "output"):
            continue  # the default multiple of the input rate
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            raise ConfigError(f"price for {model!r}: {name} must be a number of dollars per "
                              f"million tokens, not {rate!r}")
        if rate < 0:
            raise ConfigError(f"price for {model!r}: {name} is negative ({rate!r}); a rate "
                              "is dollars per million tokens, 0 or more")
        if not math.isfinite(rate):
            raise ConfigError(f"price for {model!r}: {name} is {rate!r}; a rate is a finite "
                              "number of dollars per million tokens")
        checked[name] = float(rate)
    return Price(**checked)
