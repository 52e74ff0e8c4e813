"""recorder.imports.when_imported: a callback run when a module is first imported, not
when it is merely looked up, and once."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from recorder.imports import when_imported


@pytest.fixture
def module(tmp_path: Path) -> Iterator[str]:
    """A module no one has imported, on the path for the test."""
    name = f"deja_when_imported_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_a_lookup_before_the_import_does_not_use_the_hook_up(module: str) -> None:
    """FastMCP looks ``mcp`` up (importlib.util.find_spec) before it imports it: the
    callback must still run at the import itself."""
    ran: list[str] = []
    with when_imported(module, lambda: ran.append(sys.modules[module].__name__)):
        assert importlib.util.find_spec(module) is not None
        assert ran == [] and module not in sys.modules
        importlib.import_module(module)
        assert ran == [module]
        importlib.reload(sys.modules[module])  # a later load is not a first import
    assert ran == [module]


def test_an_imported_module_runs_the_callback_at_once(module: str) -> None:
    importlib.import_module(module)
    ran: list[bool] = []
    with when_imported(module, lambda: ran.append(True)):
        assert ran == [True]


def test_no_hook_is_left_behind(module: str) -> None:
    before = list(sys.meta_path)
    with when_imported(module, lambda: None):
        assert len(sys.meta_path) == len(before) + 1
    assert sys.meta_path == before
