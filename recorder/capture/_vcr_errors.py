"""The exception a vcrpy stub raises where a replayed exchange failed before a response.

A line of a failed exchange names the class of what was raised (``type``, ``module``) and
its message. The stub raises the same class when it is one the replaying client could
have raised there itself (a builtin ``OSError``, an ``http.client`` error, urllib3's own
errors for urllib3, aiohttp's for aiohttp), so that the client turns it into what it
turned it into live (requests makes a urllib3 ``NewConnectionError`` its
``ConnectionError``, and a ``TimeoutError`` its ``ReadTimeout``), built with the recorded
message; else the nearest class above it that builds with the message; else a
``ConnectionError`` (aiohttp's ``ClientConnectionError`` for aiohttp).

A cassette is untrusted input: the class is looked up by name in a module the process has
already imported, from a fixed list, and must be an exception of the client's; nothing is
imported or run because a line names it.
"""

from __future__ import annotations

import http.client
import re
import sys
from typing import Any

__all__ = ["replayed"]

_MODULES = ("builtins", "http.client", "ssl", "urllib3.exceptions",
            "aiohttp.client_exceptions")


def replayed(error: dict[str, Any], client: str) -> Exception:
    """The exception to raise for the recorded ``error`` in ``client``'s stub
    (``"urllib3"``, ``"aiohttp"`` or ``"http.client"``)."""
    message = str(error.get("message") or "the recorded call failed before a response")
    bases, fallback = _client_errors(client)
    name, module_name = str(error.get("type")), str(error.get("module"))
    module = sys.modules.get(module_name) if module_name in _MODULES else None
    found = getattr(module, name, None) if module is not None and "." not in name else None
    if isinstance(found, type) and issubclass(found, bases):
        for cls in found.__mro__:
            if not issubclass(cls, bases):
                break
            built = _with_errno(cls, message) or _built(cls, message)
            if built is not None:
                return built
    return fallback(message)


_ERRNO = re.compile(r"\[Errno (-?\d+)\] (.*)", re.DOTALL)


def _with_errno(cls: type, message: str) -> Exception | None:
    """An ``OSError`` whose recorded text is ``[Errno N] why``, made with its number (what
    a program that reads ``errno`` reads), when that gives back the same text."""
    found = _ERRNO.fullmatch(message)
    if found is None or not issubclass(cls, OSError):
        return None
    try:
        exc = cls(int(found.group(1)), found.group(2))
    except Exception:  # noqa: BLE001 - a constructor that wants other arguments
        return None
    return exc if str(exc) == message else None


def _client_errors(client: str) -> tuple[tuple[type, ...], type[Exception]]:
    """The classes of the errors ``client`` raises where a call fails, and what it raises
    for one of another client's."""
    if client == "aiohttp":
        aiohttp = sys.modules.get("aiohttp")
        if aiohttp is not None:
            return (OSError, aiohttp.ClientError), aiohttp.ClientConnectionError
    bases: tuple[type, ...] = (OSError, http.client.HTTPException)
    urllib3 = sys.modules.get("urllib3.exceptions")
    if client == "urllib3" and urllib3 is not None:
        bases += (urllib3.HTTPError,)
    return bases, ConnectionError


def _built(cls: type, message: str) -> Exception | None:
    """``cls`` made with ``message`` (after up to two ``None`` for what comes before it:
    urllib3's ``NewConnectionError(conn, message)``), one whose text can be read and is
    the message when its arguments can make it so (the recorded text names the
    connection already); None when it does not build so."""
    for leading in range(3):
        try:
            exc = cls(*([None] * leading), message)
            if str(exc) != message:
                exc.args = (message,)
                if str(exc) != message:
                    exc = cls(*([None] * leading), message)
                    str(exc)
        except Exception:  # noqa: BLE001 - a constructor that wants other arguments
            continue
        if isinstance(exc, Exception):
            return exc
    return None
