"""Patching a library the moment the program imports it, and not before.

A session patches some libraries while it is active (the SDKs' retry sleeps in a replay,
the MCP SDK's client). Importing them up front costs a fresh process most of its start-up
(the Anthropic and OpenAI SDKs together take over a second), which a run that never uses
them should not pay. :func:`when_imported` runs a callback at once when the module is
already imported, else right after the program first imports it, through a finder at the
front of ``sys.meta_path`` that wraps the module's own loader; the finder is removed when
the block ends or once it has fired.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["when_imported"]


class _ThenLoader(importlib.abc.Loader):
    """A module's own loader, and something to do once the module has run."""

    def __init__(self, loader: Any, then: Callable[[], None], done: Callable[[], None]) -> None:
        self._loader, self._then, self._done = loader, then, done

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._done()
        self._then()

    def __getattr__(self, name: str) -> Any:  # resource readers and the like: the loader's
        return getattr(self._loader, name)


class _WhenImported(importlib.abc.MetaPathFinder):
    """Runs ``then`` once, right after the module ``name`` is first imported. It stays in
    place until the module has run: a lookup alone (``importlib.util.find_spec``, which
    FastMCP makes of ``mcp`` before importing it) imports nothing."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self._name, self._then = name, then
        self._looking = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self._name or getattr(self._looking, "on", False):
            return None
        self._looking.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._looking.on = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenLoader(spec.loader, self._then, self.remove)
        return spec

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)


@contextlib.contextmanager
def when_imported(name: str, then: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``then()`` runs once ``name`` is imported: now if it is already,
    else right after its first import (a module that is never imported costs nothing).
    ``then`` runs under the import lock of ``name``; it may patch the module, which is in
    ``sys.modules`` by then."""
    if name in sys.modules:
        then()
        yield
        return
    hook = _WhenImported(name, then)
    sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        hook.remove()
