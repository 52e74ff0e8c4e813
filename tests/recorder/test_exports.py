"""The public surface of ``recorder`` and ``replayer``: ``__all__`` and import weight."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = ("recorder", "replayer")
HEAVY = ("streamlit", "duckdb", "vcr")
ROOT = Path(__file__).resolve().parents[2]


def _isort_key(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps ``__all__`` in: CONSTANTS, then Classes, then the rest."""
    if name.isupper() and len(name) > 1:
        return 0, name
    if name[:1].isupper():
        return 1, name
    return 2, name


@pytest.mark.parametrize("package", PACKAGES)
def test_all_is_sorted_and_resolvable(package: str) -> None:
    module = importlib.import_module(package)
    names = list(module.__all__)
    assert names, f"{package}.__all__ is empty"
    assert len(set(names)) == len(names), f"{package}.__all__ has duplicates"
    assert names == sorted(names, key=_isort_key), f"{package}.__all__ is not sorted"
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"
    namespace: dict[str, object] = {}
    exec(f"from {package} import *", namespace)  # what a star import really gives
    assert set(names) <= set(namespace)


@pytest.mark.parametrize("package", PACKAGES)
def test_import_stays_light(package: str) -> None:
    code = (
        f"import json, sys\nimport {package}\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True)
    assert json.loads(out.stdout) == [], f"import {package} pulled in {out.stdout.strip()}"


def test_the_heavy_check_can_see_a_heavy_import() -> None:
    """The check above is meaningful: a module that is imported does show in sys.modules."""
    code = "import json, sys, vcr\nprint(json.dumps('vcr' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True)
    assert json.loads(out.stdout) is True


def _fresh(code: str) -> object:
    done = subprocess.run([sys.executable, "-c", f"import json, sys\n{code}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.mark.parametrize(("package", "name", "module", "not_yet"), [
    ("recorder", "Budgets", "recorder.harness.guards", "recorder.record"),
    ("replayer", "fork", "replayer.fork", "replayer.resume")])
def test_a_name_is_imported_from_its_module_on_first_use(package: str, name: str, module: str,
                                                         not_yet: str) -> None:
    """Importing a package imports none of its modules (but the one that does this); a
    name brings in its own module, not the others."""
    loaded = _fresh(f"import {package}\n"
                    f"before = sorted(m for m in sys.modules if m.startswith('{package}.'))\n"
                    f"{package}.{name}\n"
                    "print(json.dumps([before, sorted(sys.modules)]))")
    assert loaded[0] == (["recorder.imports"] if package == "recorder" else [])
    assert module in loaded[1] and not_yet not in loaded[1]


# The functions named like the module they are defined in.
SHADOWED = {"recorder": ("record", "ask"), "replayer": ("replay", "fork", "resume")}


@pytest.mark.parametrize(("package", "first"), [
    (package, first) for package, names in SHADOWED.items()
    for first in (package, *(f"{package}.{name}" for name in names))])
def test_a_function_named_like_its_module_stays_the_function(package: str, first: str) -> None:
    """``recorder.record``, ``replayer.fork`` and the others are the functions, whichever
    is imported first: the package, or the module the function is defined in (which the
    import system would otherwise bind to the package's attribute of the same name)."""
    names = SHADOWED[package]
    out = _fresh(f"import {first}\nimport {package}\n"
                 f"print(json.dumps([[type(getattr({package}, n)).__name__,"
                 f" getattr({package}, n).__name__] for n in {names!r}]))")
    assert out == [["function", name] for name in names]


def test_a_module_of_the_package_is_its_attribute_as_before() -> None:
    """``import recorder`` then ``recorder.providers.register`` (the documented way to
    add a provider) works without importing ``recorder.providers`` by name."""
    out = _fresh("import recorder, replayer\n"
                 "print(json.dumps([recorder.providers.register.__name__,"
                 " replayer.diff.compare.__name__, hasattr(recorder, 'no_such_module')]))")
    assert out == ["register", "compare", False]
