"""A run's family in the viewer: the indexes of the folders a session reads, and the fork
tree on a run's page (:mod:`viewer.tree`), each run of it a link.

A run of the tree in another folder is opened by the run it was reached from, never by a
path: ``?run=R&file=F&via=A.jsonl`` is the run R (file F) of the fork tree of ``A.jsonl``,
a file of the viewed folder (``c_via`` in a diff's address). The folder it lies in is
indexed and verified as the viewed folder is.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import duckdb
import streamlit as st

from replayer.diff_many import TAGS
from viewer import tree, widgets
from viewer.index import RunIndex
from viewer.safe import md

log = logging.getLogger("deja.viewer")

INDENT = 28  # pixels a child is drawn right of its parent


def open_index(folder: Path) -> RunIndex:
    """This session's index of ``folder``, refreshed (incrementally) on every run."""
    key = f"index:{folder.resolve()}"
    index = st.session_state.get(key)
    if index is None:
        index = st.session_state[key] = RunIndex(folder)
    refresh(index)
    return index


def refresh(index: RunIndex) -> None:
    try:
        index.refresh()
    except duckdb.Error as exc:  # another session refreshing the same file: next time
        log.warning("index refresh failed: %s", exc)


def locate(viewed: RunIndex, anchor: str, run: str | None, file: str | None) -> Path | None:
    """The cassette of run ``run`` (file ``file``) in the fork tree of ``anchor``, a run
    of the viewed folder (:func:`viewer.tree.locate`)."""
    return tree.locate(viewed, anchor, run, file, open_index)


def node_row(node: tree.Node, anchor: str) -> dict[str, Any]:
    """A node as the run row the links are made from: a run of another folder is named
    through ``anchor``, the file of the viewed folder the tree was drawn from."""
    row: dict[str, Any] = {"run": node.run, "path": node.path}
    if not node.here:
        row["via"] = anchor
    return row


def tree_panel(viewed: RunIndex, header: dict[str, Any]) -> None:
    """The fork tree of the run of ``header`` (drawn when it has a parent or a child): every
    run of it a link, each child with the step it was forked at, and a button comparing
    them all. A run opened from the runs database has none here."""
    if header.get("submitted"):
        return
    anchor = header.get("via") or Path(header["path"]).name
    root = tree.fork_tree(viewed, anchor, open_index, current=header["path"])
    if root is None or not root.children:
        return
    nodes = list(tree.walk(root))
    with st.expander(md("Fork tree ({} runs)", len(nodes)), expanded=True):
        for node, depth in nodes:
            draw(node, depth, anchor)
        found = [node for node, _ in nodes if node.path][:len(TAGS)]
        if len(found) > 1:
            st.button(md("Compare these {} runs", len(found)), key="tree_diff",
                      on_click=widgets.go,
                      kwargs=widgets.diff_params(*(node_row(n, anchor) for n in found)))


def draw(node: tree.Node, depth: int, anchor: str) -> None:
    """One run of the tree, on a line of its own, right of its parent."""
    key = f"tree:{node.path or node.run}"
    with st.container(horizontal=True, vertical_alignment="center", gap="small"):
        if depth:
            st.space(INDENT * depth)
            st.markdown("└")
        if node.path is None:
            st.markdown(md("{} (not found)", node.name))
        elif node.current:
            st.markdown(md("● **{}** · {} (this run)", node.name, node.file))
        else:
            st.button(md("{} · {}", node.name, node.file), key=key, type="tertiary",
                      icon=":material/arrow_outward:", help="Open this run",
                      on_click=widgets.go, kwargs=widgets.run_params(node_row(node, anchor)))
        facts = [node.how, node.status or "", "" if node.here or node.path is None
                 else f"in {node.folder}"]
        st.caption(md("{}", " · ".join(f for f in facts if f)))
