"""The viewer's diff page: runs side by side, a column per run, aligned step by step.

The address names the runs by tag, ``?a=R1&a_file=F1&b=R2&b_file=F2&c=R3&c_file=F3...``
(``a_submitted`` for a run of the runs database, ``c_via`` for a run of another folder
reached through a fork tree, :mod:`viewer.lineage`); ``a`` is the base every other run is
compared with. The page adds a run of the folder to the comparison, or takes one out.
Every question goes to :func:`viewer.queries.diff`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from recorder.cassette.schema import Kind
from recorder.errors import DejaError
from replayer.diff_many import TAGS, where
from viewer import lineage, queries, widgets
from viewer.diffs import DiffView
from viewer.index import RunIndex
from viewer.safe import md

EMPTY = "—"  # what a cell without a value shows
FIRST = "▶ "  # a run's first divergence from the base, before its cell
FIRST_STYLE = "background-color: rgba(255, 75, 75, 0.25)"
CHANGED_STYLE = "background-color: rgba(255, 189, 69, 0.2)"


def sides(index: RunIndex) -> list[tuple[str | Path | None, str | None]]:
    """The runs the address names, in tag order (``a``, ``b``, ... up to the first tag it
    does not name): what each names and, for a run of the runs database, its id there."""
    out = []
    for tag in TAGS.lower():
        if not any(st.query_params.get(f"{tag}{end}") for end in ("", "_file", "_submitted")):
            break
        out.append(side(index, tag))
    return out


def side(index: RunIndex, tag: str) -> tuple[str | Path | None, str | None]:
    """What side ``tag`` of a diff's URL names: a run id or file name of the folder
    (``a``, ``a_file``); for ``a_submitted`` the cassette the runs database names for that
    run, and that run's id there; for ``a_via`` the cassette of that run in the fork tree
    of the folder's run ``a_via`` (:func:`viewer.lineage.locate`)."""
    params = st.query_params
    run_id = params.get(f"{tag}_submitted")
    if run_id:
        from viewer import submitted_page

        found = submitted_page.run_record(run_id)  # None: it says why
        return (Path(found["cassette"]) if found else None), run_id
    if via := params.get(f"{tag}_via"):
        return lineage.locate(index, via, params.get(tag), params.get(f"{tag}_file")), None
    return params.get(f"{tag}_file") or params.get(tag), None


def page(index: RunIndex, named: list[tuple[str | Path | None, str | None]]) -> None:
    """Runs ``named`` (see :func:`sides`) side by side."""
    st.button("← All runs", on_click=widgets.go, key="back")
    st.title("Diff")
    runs = [run for run, _ in named]
    if any(run is None for run in runs):
        st.error(md("Cannot compare: run {} is not found.", TAGS[runs.index(None)]))
        return
    try:
        view = queries.diff(index, *[run for run in runs if run is not None])
    except (DejaError, OSError) as exc:
        st.error(md("Cannot compare {}: {}", ", ".join(map(str, runs)), exc))
        return
    for run, (_, submitted) in zip(view.runs, named, strict=True):
        if submitted:
            run["submitted"] = submitted
        if via := st.query_params.get(f"{run['tag']}_via"):
            run["via"] = via
    heads(index, view)
    if view.many.same:
        st.success("Same: every step means the same in both runs." if len(view.runs) == 2
                   else md("Same: every step means the same in all {} runs.", len(view.runs)))
        return
    body(view)


def heads(index: RunIndex, view: DiffView) -> None:
    """A column per run: its tag, id and steps, a button to open it and, with three runs
    or more, one to take it out; then a way to add a run of the folder."""
    many = len(view.runs) > 2
    for col, run in zip(st.columns(len(view.runs)), view.runs, strict=True):
        tag = run["tag"].upper()
        col.markdown(md("**{}: {}** · {} steps", tag, run["name"], run["steps"]))
        col.caption(md("{}", Path(run["path"]).name) + (" · the base" if tag == "A" and many
                                                        else ""))
        col.button(md("Open {}", tag), key=f"open_{tag}", on_click=widgets.go,
                   kwargs=widgets.run_params(run))
        if many:
            rest = [r for r in view.runs if r is not run]
            col.button(md("Take {} out", tag), key=f"remove_{tag}", on_click=widgets.go,
                       kwargs=widgets.diff_params(*rest))
    if len(view.runs) < len(TAGS):
        add_run(index, view)


def add_run(index: RunIndex, view: DiffView) -> None:
    """A run of the folder, picked, joins the comparison as the next tag."""
    rows = queries.list_runs(index)
    by_file = {r["file"]: r for r in rows if r["status"] != "error"}
    if not by_file:
        return
    left, right = st.columns([4, 1], vertical_alignment="bottom")
    pick = left.selectbox("Add a run to the comparison", list(by_file), key="diff_add",
                          format_func=lambda f: f if by_file[f]["name"] == f
                          else f"{by_file[f]['name']} · {f}")
    right.button("Add", key="diff_add_btn", on_click=widgets.go,
                 kwargs=widgets.diff_params(*view.runs, by_file[pick]))


def body(view: DiffView) -> None:
    """The first divergences, the identical prefix folded, the aligned table and the
    changed fields of every row that differs."""
    if len(view.runs) == 2:
        st.error(md("First divergence: step {}", view.first_divergence))
    else:
        tags = TAGS[1:len(view.runs)]
        said = [where(view.many, tag).removeprefix("first divergence at ") for tag in tags]
        st.error(md("First divergence from A — " + " · ".join(["{}: {}"] * len(tags)),
                    *(x for pair in zip(tags, said, strict=True) for x in pair)))
    prefix = view.same_prefix
    if prefix:
        with st.expander("Step 0: identical" if prefix == 1 else
                         md("Steps 0-{}: identical ({} steps)", prefix - 1, prefix)):
            show(view, frame(view, view.rows[:prefix]))
    rest = view.rows[prefix:]
    table = frame(view, rest)
    show(view, table.style.apply(styles, axis=1, view=view), key="diff_table")
    for row in rest:
        changed = view.changed.get(row["step"])
        if changed:
            changes(view, row, changed)
    with st.expander("As text (deja diff)"):
        st.code(view.text, language=None)


def show(view: DiffView, table: Any, key: str | None = None) -> None:
    """An aligned table, without the columns that only say where to colour it; with more
    than two runs, each run's column is headed by its tag and file, its id in the
    column's help."""
    columns = table.columns if isinstance(table, pd.DataFrame) else table.data.columns
    config = {column_name(run): st.column_config.TextColumn(help=run["name"])
              for run in view.runs} if len(view.runs) > 2 else None
    st.dataframe(table, hide_index=True, key=key, placeholder=EMPTY, column_config=config,
                 column_order=[c for c in columns if not c.startswith("first")])


def changes(view: DiffView, row: dict[str, Any], changed: dict[str, Any]) -> None:
    """A row's changed fields, run by run, in an expander (open at a first divergence)."""
    template = ("▶ first divergence · " if row["first"] else "") + "Step {}: " + " · ".join(
        ["{} {}"] * len(view.tags))
    parts = [x for tag in view.tags
             for x in (tag.upper(), _side(row[f"seq_{tag}"], row[f"kind_{tag}"]))]
    with st.expander(md(template, row["step"], *parts), expanded=row["first"]):
        for tag, step in changed.items():
            rows = widgets.changes_table(step.changes)
            if len(view.runs) > 2:  # this run's side is named by its tag
                st.caption(md("{} against A", tag.upper()))
                rows = [{k if k != "B" else tag.upper(): v for k, v in r.items()}
                        for r in rows]
            st.dataframe(pd.DataFrame(rows), hide_index=True, placeholder=EMPTY)


def _side(seq: Any, kind: Any) -> str:
    """One run's side of an aligned step: its seq and kind, or that it has none."""
    return f"seq {seq} {kind}" if seq is not None else "has no such step"


# The two-run table's columns as a reader reads them: A's side, B's side, the verdict.
_ALIGNED = {"step": "step", "seq_a": "A seq", "kind_a": "A kind", "name_a": "A name",
            "status_a": "A status", "seq_b": "B seq", "kind_b": "B kind",
            "name_b": "B name", "status_b": "B status", "verdict": "verdict",
            "changed": "changed", "first": "first"}


def frame(view: DiffView, rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Aligned rows as a table: for two runs, each side's seq, kind, name and status and
    the verdict; for more, a column per run (headed by its tag and file) whose cell says
    its step (``seq kind name``, ``▶`` before a run's first divergence) or ``—``, and
    the changed fields of each run that differs from A."""
    if len(view.runs) == 2:
        table = pd.DataFrame([{**{c: r.get(c) for c in _ALIGNED},
                               "verdict": "same" if r["same"] else "differs"} for r in rows],
                             columns=list(_ALIGNED))
        table = table.astype({"seq_a": "Int64", "seq_b": "Int64"})  # absent: <NA>, not 1.0
        return table.rename(columns=_ALIGNED)
    columns = {run["tag"]: column_name(run) for run in view.runs}
    out = []
    for r in rows:
        cells = {columns[t]: cell_text(r, t) for t in view.tags}
        marks = {f"first_{t}": r.get(f"first_{t}", False) for t in view.tags}
        changed = "; ".join(f"{tag.upper()} " + ", ".join(c.path or c.op for c in step.changes)
                            for tag, step in view.changed.get(r["step"], {}).items())
        out.append({"step": r["step"], **cells, "changed": changed, "first": r["first"],
                    **marks})
    return pd.DataFrame(out, columns=["step", *columns.values(), "changed", "first",
                                      *(f"first_{t}" for t in view.tags)])


def column_name(run: dict[str, Any]) -> str:
    """A run's column: its tag and file (its id is the column's help)."""
    return f"{run['tag'].upper()} · {Path(run['path']).name}"


def cell_text(row: dict[str, Any], tag: str) -> str:
    if row[f"seq_{tag}"] is None:
        return EMPTY
    text = "end " + str(row[f"status_{tag}"]) if row[f"kind_{tag}"] == Kind.END else \
        f"{row[f'seq_{tag}']} {row[f'kind_{tag}']} {row[f'name_{tag}']}".rstrip()
    return (FIRST if row.get(f"first_{tag}") else "") + text


def styles(row: pd.Series, view: DiffView) -> list[str]:
    """A table row's colours: for two runs the first divergence's whole row; for more, a
    run's first divergence red and its other differing cells amber."""
    if len(view.runs) == 2:
        return [FIRST_STYLE if row["first"] else "" for _ in row]
    changed = view.changed.get(int(row["step"]), {})
    by_column = {column_name(run): run["tag"] for run in view.runs}
    out = []
    for column in row.index:
        tag = by_column.get(column)
        out.append("" if tag is None else FIRST_STYLE if row.get(f"first_{tag}")
                   else CHANGED_STYLE if tag in changed else "")
    return out
