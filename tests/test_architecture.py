"""The layering of deja's packages, checked from the source so that it cannot drift.

Every rule here reads the modules' imports with ``ast`` (imports inside functions and under
``TYPE_CHECKING`` included), so a rule holds without anything being imported or run:

- the packages form layers, each importing only from the layers below it (``deja.proxy`` and
  ``deja.runs`` are layers of their own, below the viewer and the command line in ``deja``);
- the wheel installs four top-level packages, no generic name a project may already use;
- the stub server (``recorder.testing``) is a test fake that imports nothing else of deja;
- the cassette format and the providers know nothing of capture, the harness or recording;
- the durable-execution engine (DBOS) is imported by ``deja.runs.engine`` alone;
- a private module or name (``_x``) is used only inside the package that owns it;
- a package's ``__init__`` says what it exports in ``__all__``;
- the two HTTP servers (``deja.proxy``, ``deja.runs``) share one serving helper
  (``recorder.serving``): neither has a loopback check, a socket bind or a body reader of
  its own;
- a line's kind is compared with, and written as, a member of ``Kind``, not a bare
  string;
- a test file stays short enough to read.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first; a package imports only from its own layer's package and the layers below.
# Packages sharing a layer are siblings and do not import each other. Packages that do not
# exist yet are checked once they do.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("recorder",),
    ("replayer",),
    ("deja.proxy", "deja.runs"),
    ("viewer",),
    ("deja",),
)
PACKAGES = tuple(name for layer in LAYERS for name in layer
                 if ROOT.joinpath(*name.split(".")).is_dir())
LAYER_OF = {name: rank for rank, layer in enumerate(LAYERS) for name in layer}
TOP_LEVEL = ("recorder", "replayer", "viewer", "deja")  # what the design fixes, and deja itself
TEST_FAKE = "recorder.testing"
# What the cassette format and the providers must not know about.
FORMAT_PACKAGES = ("recorder.cassette", "recorder.providers")
ABOVE_FORMAT = ("recorder.capture", "recorder.harness", "recorder.record", "recorder.launch",
                "recorder.step_lines")
MAX_TEST_LINES = 800


@dataclass(frozen=True)
class Use:
    """One module of deja used by another: imported, or a private member reached through one."""

    importer: str  # dotted name of the module that imports
    target: str  # dotted name of what it uses: a module, or a module's (or class's) member
    line: int

    def where(self) -> str:
        return f"{self.importer}:{self.line} uses {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package)."""
    path = ROOT.joinpath(*module.split("."))
    return module if path.is_dir() else module.rpartition(".")[0]


def is_package(dotted: str) -> bool:
    return (ROOT.joinpath(*dotted.split(".")) / "__init__.py").is_file()


def is_module(dotted: str) -> bool:
    return is_package(dotted) or ROOT.joinpath(*dotted.split(".")).with_suffix(".py").is_file()


def source_files() -> list[Path]:
    return sorted({p for name in PACKAGES for p in ROOT.joinpath(*name.split(".")).rglob("*.py")})


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = package_of(importer).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def uses(path: Path) -> Iterator[Use]:
    """What the module at ``path`` uses of deja: its imports, and ``alias._private``."""
    importer = module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, str] = {}  # local name -> the deja module or member it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in TOP_LEVEL:
                    yield Use(importer, alias.name, node.lineno)
                    if alias.asname:
                        bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(importer, node)
            if source.split(".")[0] not in TOP_LEVEL:
                continue
            for alias in node.names:
                target = source if alias.name == "*" else f"{source}.{alias.name}"
                yield Use(importer, target, node.lineno)
                bound[alias.asname or alias.name] = target
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and is_private(node.attr)):
            yield Use(importer, f"{bound[node.value.id]}.{node.attr}", node.lineno)


ALL_USES = [use for path in source_files() for use in uses(path)]


def top(dotted: str) -> str:
    """The layer a module belongs to: the longest of ``LAYERS``' names it is inside."""
    return max((name for name in LAYER_OF if inside(dotted, name)), key=len)


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def owner_of_private(target: str) -> str | None:
    """The package a private module or name belongs to; ``None`` when nothing is private.

    ``recorder.cassette._delta`` and ``recorder.cassette._delta.encode`` belong to
    ``recorder.cassette``; ``recorder.intents._key`` and ``replayer.replay.Session._take``
    to ``recorder`` and ``replayer``, the packages of the modules that define them.
    """
    parts = target.split(".")
    for index, part in enumerate(parts):
        if is_private(part):
            prefix = ".".join(parts[:index])
            while prefix and not is_module(prefix):  # a class's member: up to its module
                prefix = prefix.rpartition(".")[0]
            return prefix if is_package(prefix) else prefix.rpartition(".")[0]
    return None


def report(found: list[str], rule: str) -> str:
    return f"{rule}:\n  " + "\n  ".join(sorted(set(found)))


# ----------------------------------------------------------------------- the rules


def test_the_checks_see_the_source() -> None:
    assert {"recorder", "replayer", "deja.proxy", "deja.runs", "viewer", "deja"} <= set(PACKAGES)
    assert top("deja.runs.engine") == "deja.runs" and top("deja.cli") == "deja"
    assert len(ALL_USES) > 100
    assert owner_of_private("recorder.cassette._delta.encode") == "recorder.cassette"
    assert owner_of_private("recorder.cassette.reader._x") == "recorder.cassette"
    assert owner_of_private("recorder.testing.server.StubServer._lock") == "recorder.testing"
    assert owner_of_private("recorder.cassette.reader.load") is None


def test_the_wheel_installs_four_top_level_packages() -> None:
    """``recorder``, ``replayer`` and ``viewer`` (the design's names) and ``deja``: nothing
    generic such as ``proxy`` or ``runs`` that would shadow a project's own package."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == list(TOP_LEVEL)
    assert config["tool"]["mypy"]["packages"] == list(TOP_LEVEL)
    beside = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert beside == set(TOP_LEVEL), f"a top-level package the wheel does not ship: {beside}"


def test_no_package_imports_a_layer_above_it_or_a_sibling() -> None:
    found = [
        use.where() for use in ALL_USES
        if top(use.target) != top(use.importer)
        and LAYER_OF[top(use.target)] >= LAYER_OF[top(use.importer)]
    ]
    assert not found, report(found, "imports of a package above or beside the importer's")


def test_the_stub_server_imports_nothing_else_of_deja() -> None:
    found = [
        use.where() for use in ALL_USES
        if inside(use.importer, TEST_FAKE) and not inside(use.target, TEST_FAKE)
    ]
    assert not found, report(found, f"{TEST_FAKE} importing the rest of deja")


def test_the_recorder_does_not_depend_on_its_test_fake() -> None:
    found = [
        use.where() for use in ALL_USES
        if top(use.importer) == "recorder" and not inside(use.importer, TEST_FAKE)
        and inside(use.target, TEST_FAKE)
    ]
    assert not found, report(found, f"the recorder importing {TEST_FAKE}")


def test_the_cassette_and_the_providers_know_nothing_of_capture_or_recording() -> None:
    found = [
        use.where() for use in ALL_USES
        if any(inside(use.importer, low) for low in FORMAT_PACKAGES)
        and any(inside(use.target, high) for high in ABOVE_FORMAT)
    ]
    assert not found, report(found, "the cassette or the providers importing what builds on them")


def engine_importers(path: Path) -> Iterator[str]:
    """Where the module at ``path`` imports the durable-execution engine (DBOS)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(name.split(".")[0] == "dbos" for name in names):
            yield f"{module_name(path)}:{node.lineno}"


def test_only_the_engine_module_imports_the_engine() -> None:
    """Every use of DBOS goes through ``deja.runs.engine``, so its moving API is in one place."""
    found = [where for path in source_files() for where in engine_importers(path)]
    assert found and all(where.startswith("deja.runs.engine:") for where in found), \
        report([w for w in found if not w.startswith("deja.runs.engine:")] or ["no import at all"],
               "imports of dbos outside deja.runs.engine")


def test_private_modules_and_names_stay_in_their_package() -> None:
    found = []
    for use in ALL_USES:
        owner = owner_of_private(use.target)
        if owner is not None and not inside(use.importer, owner):
            found.append(f"{use.where()} (private to {owner})")
    assert not found, report(found, "private modules or names used outside their package")


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """The module's statements, with those of an ``if TYPE_CHECKING:`` block (the names a
    package imports on first use, as type checkers see them)."""
    out: list[ast.stmt] = []
    for node in tree.body:
        lazy = isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        out.extend(node.body if lazy else [node])
    return out


def _bound_public_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The public names an ``__init__`` defines or re-exports (what ``__all__`` must hold),
    and those it imports of deja for its own use (what ``__all__`` may hold)."""
    defined: set[str] = set()
    imported: set[str] = set()
    for node in _top_level(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0]
                                                   in TOP_LEVEL):
            imported.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.asname for alias in node.names
                            if alias.asname and alias.name.split(".")[0] in TOP_LEVEL)
    # An imported name the module uses itself is its own; one it never uses is re-exported.
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    public = {name for name in defined | imported if not name.startswith("_")}
    internal = {name for name in imported & used if name not in defined}
    return public - internal, public


def _declared_all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(value))
    return None


INITS = [p for p in source_files() if p.name == "__init__.py"]


@pytest.mark.parametrize("init", INITS, ids=[module_name(p) for p in INITS])
def test_every_package_declares_what_it_exports(init: Path) -> None:
    tree = ast.parse(init.read_text())
    declared = _declared_all(tree)
    where = init.relative_to(ROOT)
    assert declared is not None, f"{where} has no __all__ (an empty package says __all__ = [])"
    assert len(declared) == len(set(declared)), f"{where}: a name twice in __all__"
    exported, bound = _bound_public_names(tree)
    assert exported <= set(declared) <= bound, (
        f"{where}: __all__ and the public names it binds differ: "
        f"only in __all__ {sorted(set(declared) - bound)}, "
        f"defined or re-exported but not in __all__ {sorted(exported - set(declared))}")


SERVERS = ("deja.proxy", "deja.runs")
SERVING = "recorder.serving"
SHARED = ("bind", "guarded_httptools", "is_loopback", "read_body")  # every server uses them


def serving_roles(path: Path) -> Iterator[str]:
    """Where the module at ``path`` does what :mod:`recorder.serving` does for every server:
    a function named as a loopback check or a bind, an address's ``.is_loopback`` asked, a
    socket bound (``.bind``, ``.setsockopt``), or an ASGI message's ``more_body`` read (a
    request body read piece by piece)."""
    module = module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        role = None
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                node.name.lstrip("_") in ("is_loopback", "loopback", "bind"):
            role = f"defines {node.name}"
        elif isinstance(node, ast.Attribute) and node.attr in ("is_loopback", "bind",
                                                               "setsockopt"):
            role = f"uses .{node.attr}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "get" and node.args and \
                isinstance(node.args[0], ast.Constant) and node.args[0].value == "more_body":
            role = "reads a request body"
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and \
                isinstance(node.slice, ast.Constant) and node.slice.value == "more_body":
            role = "reads a request body"
        if role is not None:
            yield f"{module}:{getattr(node, 'lineno', 0)} {role}"


def test_the_servers_share_one_serving_helper() -> None:
    """The proxy and the runs API check loopback, bind their socket and read a request
    body through ``recorder.serving`` alone, each answering its refusals its own way."""
    shared = ROOT.joinpath(*SERVING.split(".")).with_suffix(".py")
    roles = " ".join(serving_roles(shared))
    assert all(role in roles for role in ("defines is_loopback", "defines bind",
                                          "reads a request body")), roles
    found = [where for path in source_files()
             if any(inside(module_name(path), server) for server in SERVERS)
             for where in serving_roles(path)]
    assert not found, report(found, f"serving done again beside {SERVING}")
    for server in SERVERS:
        used = {use.target.rpartition(".")[2] for use in ALL_USES
                if inside(use.importer, server) and use.target.startswith(SERVING + ".")}
        assert set(SHARED) <= used, f"{server} does not use {SERVING}'s " \
                                    f"{sorted(set(SHARED) - used)}"


def test_no_test_file_is_over_800_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n for p in sorted((ROOT / "tests").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_TEST_LINES
    }
    assert not long, f"test files over {MAX_TEST_LINES} lines (split them by topic): {long}"


SESSION_CLASSES = {"Session", "RecordSession", "ReplaySession", "ContinuationSession"}
SESSION_PACKAGES = ("recorder", "replayer")  # where sessions are defined and composed


def _session_type_tests(tree: ast.AST) -> Iterator[int]:
    """Lines that test a value against a session class (``isinstance(s, RecordSession)``,
    ``type(s) is ReplaySession``) or probe a session for a flag (``getattr(s, "serving")``)."""
    def names(node: ast.AST) -> set[str]:
        return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                if isinstance(n, ast.Name | ast.Attribute)}

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("isinstance", "issubclass") and len(node.args) == 2 \
                    and names(node.args[1]) & SESSION_CLASSES:
                yield node.lineno
            if node.func.id == "getattr" and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value == "serving":
                yield node.lineno
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) \
                and isinstance(node.left.func, ast.Name) and node.left.func.id == "type" \
                and any(names(c) & SESSION_CLASSES for c in node.comparators):
            yield node.lineno


def test_no_session_type_tests_outside_the_session_packages() -> None:
    """Who answers a call is the session's data (its sources), not its class: the proxy, the
    runs service, the viewer and the CLI ask a session (``consults_log``, ``recorder()``,
    ``writing_live()``) instead of testing its type."""
    found = [f"{module_name(path)}:{line}" for path in source_files()
             if top(module_name(path)) not in SESSION_PACKAGES
             for line in _session_type_tests(ast.parse(path.read_text()))]
    assert not found, report(found, "session type tests outside recorder/ and replayer/")


# Modules that may still compare a line's kind with a bare string, and why.
BARE_KINDS = {
    # Below the cassette package, which imports it: it cannot import the schema, and
    # compares the kind its callers pass.
    "recorder.canonical": "imported by recorder.cassette",
}


def _kind_values() -> set[str]:
    """The values of ``Kind``, read from the schema's source."""
    tree = ast.parse((ROOT / "recorder" / "cassette" / "schema.py").read_text())
    kind = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Kind")
    return {s.value.value for s in kind.body if isinstance(s, ast.Assign)
            and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)}


KIND_VALUES = _kind_values()


def _reads_kind(node: ast.AST) -> bool:
    """``kind``, ``x.kind``, ``kind_a``, ``obs["kind"]``, ``obs.get("kind")``, ``a or b``
    of those: an expression whose value is a line's kind."""
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return name == "kind" or name.startswith("kind_")
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "kind"
    if isinstance(node, ast.Call):
        return bool(node.args) and isinstance(node.args[0], ast.Constant) \
            and node.args[0].value == "kind"
    if isinstance(node, ast.BoolOp):
        return any(_reads_kind(value) for value in node.values)
    return False


def _kind_strings(node: ast.AST) -> set[str]:
    """The line kinds written as bare strings in ``node``: a literal, or a tuple, list or
    set display of them."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {item.value for item in items if isinstance(item, ast.Constant)
            and isinstance(item.value, str) and item.value in KIND_VALUES}


def _bare_kinds(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Comparisons of a line's kind with a bare string (``obs["kind"] == "model"``, ``kind
    in ("tool", "intent")``) and lines built with one (``{"kind": "effect", ...}``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_reads_kind(side) for side in sides):
                for value in sorted(set().union(*map(_kind_strings, sides))):
                    yield node.lineno, f"compares a kind with {value!r}"
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "kind" \
                        and isinstance(value, ast.Constant) and value.value in KIND_VALUES:
                    yield node.lineno, f"builds a {value.value!r} line with a bare string"


def test_the_bare_kind_check_sees_them() -> None:
    assert {"model", "http", "tool", "end"} <= KIND_VALUES
    source = ('obs["kind"] == "model"; kind in ("tool", "x"); obs.get("kind") != "http"\n'
              'd.kind == "effect"; (s.kind_a or s.kind_b) == "end"; {"kind": "control"}\n'
              'kind == Kind.MODEL; {"kind": Kind.TOOL.value}; scope["type"] == "http"\n')
    assert [line for line, _ in _bare_kinds(ast.parse(source))] == [1, 1, 1, 2, 2, 2]


def test_line_kinds_are_named_by_kind() -> None:
    """A line's kind is compared with, and written as, a member of ``Kind``
    (``recorder.cassette.schema``): one vocabulary, which a type checker and a search
    follow; being a ``StrEnum``, it is the very string on disk."""
    found = {f"{module_name(path)}:{line} {what}": module_name(path) for path in source_files()
             for line, what in _bare_kinds(ast.parse(path.read_text()))}
    bare = [where for where, module in found.items() if module not in BARE_KINDS]
    assert not bare, report(bare, "a line kind as a bare string (use Kind)")
    stale = set(BARE_KINDS) - set(found.values())
    assert not stale, f"allowed bare kinds no longer needed (remove them): {sorted(stale)}"


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60  # of code: a docstring (a command's --help, say) is not counted


def test_no_module_over_600_lines_and_no_function_over_60() -> None:
    """A module is one concept and a function one step: split before they grow past it."""
    long_modules = [f"{module_name(path)}: {n} lines" for path in source_files()
                    if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    long_functions = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            body = node.body
            documented = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                          and isinstance(body[0].value.value, str))
            first = body[1] if documented and len(body) > 1 else body[0]
            lines = (node.end_lineno or first.lineno) - first.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long_functions.append(f"{module_name(path)}:{node.lineno} {node.name}: {lines}")
    assert not long_modules, report(long_modules, f"modules over {MAX_MODULE_LINES} lines")
    assert not long_functions, report(long_functions,
                                      f"functions over {MAX_FUNCTION_LINES} lines of code")


# Keys of the model APIs' wire formats: what reading a request, a conversation, a tool call
# or a response means belongs to the provider modules (recorder/providers/) and the stub
# (recorder/testing/, an independent implementation of the formats).
# (not "tool_calls" or "content": deja's own totals and lines use those names too)
WIRE_KEYS = frozenset({"messages", "tool_use", "tool_result", "choices", "function_call",
                       "content_block_delta", "input_json_delta", "contents",
                       "functionCall", "functionResponse", "candidates"})
WIRE_PACKAGES = ("recorder.providers", "recorder.testing")
# Modules that still read a wire format themselves, with what they ask: none now (every
# reader asks its provider, or the conversation accessors). Nothing may join it.
READS_WIRE_FORMAT: dict[str, str] = {}


def _wire_reads(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Where a module reads or builds a wire-format key: ``x["messages"]``,
    ``x.get("tool_use")``, ``block["type"] == "tool_result"``, ``{"choices": ...}``."""
    def wire(node: ast.AST | None) -> str | None:
        return node.value if isinstance(node, ast.Constant) and node.value in WIRE_KEYS \
            else None

    for node in ast.walk(tree):
        found: list[str | None] = []
        if isinstance(node, ast.Subscript):
            found.append(wire(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("get", "pop", "setdefault") and node.args:
            found.append(wire(node.args[0]))
        elif isinstance(node, ast.Compare):
            found.extend(wire(side) for side in (node.left, *node.comparators))
            for side in node.comparators:
                if isinstance(side, ast.Tuple | ast.List | ast.Set):
                    found.extend(wire(item) for item in side.elts)
        elif isinstance(node, ast.Dict):
            found.extend(wire(key) for key in node.keys)
        for key in filter(None, found):
            yield node.lineno, key


def test_the_wire_format_check_sees_them() -> None:
    source = ('body["messages"]; body.get("choices"); b["type"] == "tool_use"\n'
              't in ("tool_result", "x"); {"contents": []}; obs["kind"]; "messages"\n')
    assert sorted({line for line, _ in _wire_reads(ast.parse(source))}) == [1, 2]
    assert len(list(_wire_reads(ast.parse(source)))) == 5


def test_wire_formats_are_read_behind_the_provider_seam() -> None:
    """What a model API's JSON means is the provider's to say: a module outside
    ``recorder.providers`` (and the stub) that reads a wire-format key asks its provider
    instead. The modules listed above are what is left to move; the list only shrinks."""
    found = {}
    for path in source_files():
        module = module_name(path)
        if any(inside(module, package) for package in WIRE_PACKAGES):
            continue
        for line, key in _wire_reads(ast.parse(path.read_text())):
            found[f"{module}:{line} reads {key!r}"] = module
    new = [where for where, module in found.items() if module not in READS_WIRE_FORMAT]
    assert not new, report(new, "a wire-format key read outside the provider seam")
    stale = set(READS_WIRE_FORMAT) - set(found.values())
    assert not stale, f"modules that no longer read a wire format (remove them): {sorted(stale)}"
