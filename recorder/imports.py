"""Importing what is used when it is first used.

**A package's names** (:func:`import_on_first_use`): ``recorder`` and ``replayer`` import
each name of their ``__all__`` from its module when it is first used, so a command or a
program that needs one part of deja does not pay for importing the rest.

**Patching a library** the moment the program imports it, and not before.

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
import importlib
import importlib.abc
import importlib.util
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["import_on_first_use", "when_imported"]


def import_on_first_use(package: str, modules: Mapping[str, Sequence[str]],
                        rest: str | None = None) -> None:
    """Give the package ``package`` the names its ``modules`` define (a module to the names
    taken from it; ``rest``: the module of the other names of the package's ``__all__``),
    each imported from its module when it is first used.

    The package's modules are its attributes as before (``recorder.providers.register``
    after ``import recorder``): one not imported yet is imported when first used. A
    function named like the module it is defined in (``recorder.record``) stays the
    package's attribute when that module is imported: the import system would set the
    attribute to the module then.
    """
    where = {name: module for module, names in modules.items() for name in names}
    if rest is not None:
        where.update((name, rest) for name in sys.modules[package].__all__ if name not in where)
    shadowed = frozenset(name for name, module in where.items() if module == f"{package}.{name}")

    class Package(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name in where:
                value = getattr(importlib.import_module(where[name]), name)
            elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}"):
                value = importlib.import_module(f"{package}.{name}")
            else:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            self.__dict__[name] = value
            return value

        def __setattr__(self, name: str, value: Any) -> None:
            if name in shadowed and isinstance(value, types.ModuleType):
                return
            super().__setattr__(name, value)

        def __dir__(self) -> list[str]:
            return sorted({*super().__dir__(), *where})

    sys.modules[package].__class__ = Package


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
