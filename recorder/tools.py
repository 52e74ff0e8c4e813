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

from . import session

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
         encode: Callable[[Any], Any] | None = None,
         decode: Callable[[Any], Any] | None = None) -> Callable[[F], F]: ...


def tool(func: Callable[..., Any] | None = None, *, name: str | None = None,
         side_effect: bool = False, encode: Callable[[Any], Any] | None = None,
         decode: Callable[[Any], Any] | None = None) -> Any:
    """Record (or, on replay, serve) every call of a sync or async tool function.

    ``encode``/``decode`` convert a result that is not JSON-like to and from a JSON form.
    ``side_effect=True`` forces the tool's line to disk before the result is returned.
    """
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        spec = session.ToolSpec(name or fn.__name__, encode, decode, side_effect)
        sig = inspect.signature(fn)
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                current = session.active()
                if current is None:
                    return await fn(*args, **kwargs)
                call = _bound_args(sig, args, kwargs)
                return await current.call_tool_async(spec, call, lambda: fn(*args, **kwargs))
            async_wrapper.__deja_tool__ = spec  # type: ignore[attr-defined]
            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            current = session.active()
            if current is None:
                return fn(*args, **kwargs)
            return current.call_tool(spec, _bound_args(sig, args, kwargs),
                                     lambda: fn(*args, **kwargs))
        wrapper.__deja_tool__ = spec  # type: ignore[attr-defined]
        return wrapper

    if func is not None:
        return wrap(func)
    return wrap
