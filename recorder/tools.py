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
        sig = inspect.signature(fn)
        takes_key = "idempotency_key" in sig.parameters
        spec = session.ToolSpec(name or fn.__name__, encode, decode, side_effect, settle,
                                takes_key)

        def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
            call = _bound_args(sig, args, kwargs)
            call.pop("idempotency_key", None)
            return call

        def with_key(kwargs: dict[str, Any], key: str | None) -> dict[str, Any]:
            if takes_key and key is not None:
                return {**kwargs, "idempotency_key": key}
            return kwargs

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                current = session.active()
                if current is None:
                    return await fn(*args, **kwargs)

                async def invoke(key: str | None) -> Any:
                    token = intents._key.set(key)
                    try:
                        return await fn(*args, **with_key(kwargs, key))
                    finally:
                        intents._key.reset(token)

                return await current.call_tool_async(spec, arguments(args, kwargs), invoke)
            async_wrapper.__deja_tool__ = spec  # type: ignore[attr-defined]
            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            current = session.active()
            if current is None:
                return fn(*args, **kwargs)

            def invoke(key: str | None) -> Any:
                token = intents._key.set(key)
                try:
                    return fn(*args, **with_key(kwargs, key))
                finally:
                    intents._key.reset(token)

            return current.call_tool(spec, arguments(args, kwargs), invoke)
        wrapper.__deja_tool__ = spec  # type: ignore[attr-defined]
        return wrapper

    if func is not None:
        return wrap(func)
    return wrap
