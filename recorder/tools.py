"""``@recorder.tool``: tool calls as observations.

While a run is recorded, each call logs the tool's name, its arguments and its result or
raised error. While a run is replayed, the recorded result is returned (or the recorded
error raised) and the function itself is not called. With no session active the function
runs as if undecorated.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

from recorder import intents
from recorder.capture import session
from recorder.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])


def _bound_args(sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict:
    bound = sig.bind(*args, **kwargs)
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            out[name] = list(value)
        else:
            out[name] = value
    return out


class _Call:
    """What both wrappers of a tool share: its spec, and how a call's arguments are stored
    and its idempotency key passed."""

    def __init__(self, fn: Callable[..., Any], name: str | None, side_effect: bool,
                 settle: Callable[[intents.Intent], intents.Settled] | None,
                 encode: Callable[[Any], Any] | None,
                 decode: Callable[[Any], Any] | None) -> None:
        self.signature = inspect.signature(fn)
        self.takes_key = "idempotency_key" in self.signature.parameters
        self.spec = session.ToolSpec(name or fn.__name__, encode, decode, side_effect, settle,
                                     self.takes_key)

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, as logged (the key is the run's, not an argument)."""
        call = _bound_args(self.signature, args, kwargs)
        call.pop("idempotency_key", None)
        return call

    def with_key(self, kwargs: dict[str, Any], key: str | None) -> dict[str, Any]:
        if self.takes_key and key is not None:
            return {**kwargs, "idempotency_key": key}
        return kwargs


@overload
def tool(func: F) -> F: ...
@overload
def tool(*, name: str | None = None, side_effect: bool = False,
         settle: Callable[[intents.Intent], intents.Settled] | None = None,
         encode: Callable[[Any], Any] | None = None,
         decode: Callable[[Any], Any] | None = None) -> Callable[[F], F]: ...


def tool(func: Callable[..., Any] | None = None, *, name: str | None = None,
         side_effect: bool = False,
         settle: Callable[[intents.Intent], intents.Settled] | None = None,
         encode: Callable[[Any], Any] | None = None,
         decode: Callable[[Any], Any] | None = None) -> Any:
    """Record (or, on replay, serve) every call of a sync or async tool function.

    ``encode``/``decode`` convert a result that is not JSON-like to and from a JSON form.
    ``side_effect=True`` writes an intent line (forced to disk) before the body runs and an
    outcome line after, and gives the body an idempotency key; ``settle`` decides, when a
    crashed run is resumed, whether an intent without an outcome took effect
    (see :mod:`recorder.intents`).
    """
    if settle is not None and not side_effect:
        raise ConfigError("settle= only applies to side_effect=True tools")

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        call = _Call(fn, name, side_effect, settle, encode, decode)
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                current = session.active()
                if current is None:
                    return await fn(*args, **kwargs)

                async def invoke(key: str | None) -> Any:
                    with intents.key_in_effect(key):
                        return await fn(*args, **call.with_key(kwargs, key))

                return await current.call_tool_async(call.spec, call.arguments(args, kwargs),
                                                      invoke)
            # functions take new attributes at run time; the type of one does not say so
            async_wrapper.__deja_tool__ = call.spec  # type: ignore[attr-defined]
            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            current = session.active()
            if current is None:
                return fn(*args, **kwargs)

            def invoke(key: str | None) -> Any:
                with intents.key_in_effect(key):
                    return fn(*args, **call.with_key(kwargs, key))

            return current.call_tool(call.spec, call.arguments(args, kwargs), invoke)
        # functions take new attributes at run time; the type of one does not say so
        wrapper.__deja_tool__ = call.spec  # type: ignore[attr-defined]
        return wrapper

    if func is not None:
        return wrap(func)
    return wrap
