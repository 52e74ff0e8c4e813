"""A run's fork tree: where it comes from and every run forked from its family, across
folders.

A fork, a replay-then-live or a proxied fork names its parent in its header: ``parent.run``
(the id) and ``parent.path`` (the file it was made from, wherever that was), with
``parent.step``, the step it was forked at (a replay-then-live, ``parent.mode ==
"then_live"``: the step it left the recording at, absent when it never left). The tree is
found from the run up: each parent by its id in the folder of its child, else at the path
its child's header names (followed only from a run whose signature verified, and taken
only when the file there is that run), until a run without a parent (the root) or a parent
that cannot be found (shown by its id). Then down from the root: the runs whose parent is a
run of the tree, in the folders of the runs found so far. So a run sees its siblings and
cousins next to its ancestors, but not a fork written to a folder none of them is in.

The folders are read through their indexes (:class:`viewer.index.RunIndex`, opened by the
caller's ``open_index``), verified as the viewed folder is. A page names a run of the tree
by the run it was reached from (a file of the viewed folder), never by a path:
:func:`locate` finds it again.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recorder.cassette.reader import peek_header
from recorder.launch import CannotLaunch, launch_dir
from viewer import queries
from viewer.index import RunIndex

__all__ = ["Node", "OpenIndex", "fork_tree", "locate", "walk"]

OpenIndex = Callable[[Path], RunIndex]
"""The index of a folder, refreshed: the caller's (a page keeps one per folder)."""

MAX_NODES = 200  # runs drawn in one tree; a larger family is cut, its root kept


@dataclass
class Node:
    """A run of the tree. ``step`` and ``mode`` say where it left its parent (``mode``:
    ``fork`` or ``then_live``; None for the root); ``path`` is None for a parent that was
    not found; ``here``: in the viewed folder."""

    run: str | None
    path: str | None
    status: str | None = None
    step: int | None = None
    mode: str | None = None
    here: bool = False
    current: bool = False
    children: list[Node] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.run or (Path(self.path).name if self.path else "?")

    @property
    def file(self) -> str | None:
        return Path(self.path).name if self.path else None

    @property
    def folder(self) -> str | None:
        return str(Path(self.path).parent) if self.path else None

    @property
    def how(self) -> str:
        """Where it left its parent, in words (empty for the root)."""
        if self.mode is None:
            return ""
        if self.mode == "then_live":
            return ("replay-then-live, never left its parent" if self.step is None
                    else f"replay-then-live, left at step {self.step}")
        return f"forked at step {self.step}"


def walk(root: Node, depth: int = 0) -> Iterator[tuple[Node, int]]:
    """Every node of the tree and its depth, parents before their children."""
    yield root, depth
    for child in root.children:
        yield from walk(child, depth + 1)


def _parent_of(path: str) -> dict[str, Any] | None:
    """What a cassette's header says of its parent (unchecked: the index says whether
    the file verified)."""
    header: dict[str, Any] = dict(peek_header(path) or {})
    parent = header.get("parent")
    return parent if isinstance(parent, dict) and isinstance(parent.get("run"), str) else None


def _left(parent: dict[str, Any]) -> tuple[int | None, str]:
    """The step a child left its parent at, and how (``fork`` or ``then_live``)."""
    step = parent.get("step")
    return (step if isinstance(step, int) and not isinstance(step, bool) else None,
            "then_live" if parent.get("mode") == "then_live" else "fork")


class _Finder:
    """The indexes of the folders a tree has reached, opened once each."""

    def __init__(self, viewed: RunIndex, open_index: OpenIndex) -> None:
        self.viewed = viewed.directory.resolve()
        self.indexes = {self.viewed: viewed}
        self.open_index = open_index

    def index(self, folder: Path) -> RunIndex:
        key = folder.resolve()
        if key not in self.indexes:
            self.indexes[key] = self.open_index(folder)
        return self.indexes[key]

    def node(self, row: dict[str, Any]) -> Node:
        step, mode = (None, None) if not row.get("parent") else \
            _left(_parent_of(row["path"]) or {"step": row.get("parent_step")})
        return Node(row.get("run"), row["path"], row.get("status"), step,
                    mode, Path(row["path"]).parent.resolve() == self.viewed)

    def parent(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """The row of the run ``row`` was made from: by id in its own folder, else at the
        path its header names (a verified header; the file there must be that run)."""
        parent = _parent_of(row["path"])
        if parent is None:
            return None
        found = queries._find(self.index(Path(row["path"]).parent), parent["run"])
        if found is not None and found.get("run") == parent["run"]:
            return found
        if not row.get("verified") or not isinstance(parent.get("path"), str):
            return None
        for candidate in _candidates(Path(row["path"]), parent["path"]):
            if candidate.is_file():
                found = queries._find(self.index(candidate.parent), candidate.name)
                if found is not None and found.get("run") == parent["run"]:
                    return found
        return None

    def children(self, node: Node) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for index in list(self.indexes.values()):
            rows += queries._rows(index.con.execute(
                "SELECT run, path, status, parent_run AS parent, parent_step, verified "
                "FROM runs WHERE parent_run = ? ORDER BY created, path", [node.run]))
        return rows


def _candidates(child: Path, named: str) -> list[Path]:
    """Where a parent's path, as its child's header names it, may be: as it is when
    absolute; else from the directory the child's command ran in, from the child's folder
    and from the folders above it."""
    path = Path(named)
    if path.is_absolute():
        return [path]
    bases = []
    try:
        bases.append(launch_dir(child, peek_header(child) or {}))
    except CannotLaunch:
        pass
    bases += [child.resolve().parent, *child.resolve().parent.parents]
    return [Path(os.path.normpath(base / path)) for base in bases]


def fork_tree(index: RunIndex, run: str, open_index: OpenIndex, *,
              current: str | None = None) -> Node | None:
    """The fork tree of ``run`` (a run id, file name or path of ``index``): its root, with
    the run at ``current`` (a cassette's path; by default ``run``'s) marked ``current``.
    None when there is no such run."""
    row = queries._find(index, run)
    if row is None:
        return None
    finder = _Finder(index, open_index)
    current, top = current or row["path"], row
    seen = {row["path"]}
    while (above := finder.parent(top)) is not None and above["path"] not in seen:
        seen.add(above["path"])
        top = above
    root = finder.node(top)
    orphan = _parent_of(top["path"]) if above is None else None
    if orphan is not None:  # a parent that was not found: the root is its id
        root = Node(orphan["run"], None, children=[root])
    _grow(root, finder, current)
    return root


def _grow(root: Node, finder: _Finder, current: str) -> None:
    """Add every run forked from a run of the tree (in the folders reached), breadth
    first, up to :data:`MAX_NODES`."""
    placed = {node.path for node, _ in walk(root) if node.path}
    queue = [node for node, _ in walk(root)]
    while queue and len(placed) < MAX_NODES:
        node = queue.pop(0)
        if node.run is None:
            continue
        for row in finder.children(node):
            if row["path"] in placed or len(placed) >= MAX_NODES:
                continue
            placed.add(row["path"])
            child = finder.node(row)
            node.children.append(child)
            queue.append(child)
    for node, _ in walk(root):
        node.current = node.path == current


def locate(index: RunIndex, anchor: str, run: str | None, file: str | None,
           open_index: OpenIndex) -> Path | None:
    """The cassette of the run ``run`` (and file ``file``) in the fork tree of ``anchor``,
    a run of the viewed folder: how a page opens a run of another folder without a path
    in its address. None when the tree has no such run."""
    if not run and not file:
        return None
    root = fork_tree(index, anchor, open_index)
    for node, _ in walk(root) if root else ():
        if node.path and (not run or node.run == run) and (not file or node.file == file):
            return Path(node.path)
    return None
