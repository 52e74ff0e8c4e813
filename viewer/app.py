"""The deja viewer: runs, a run's timeline and steps, diffs, forks and live runs.

Start it with ``deja view [DIR]`` (``streamlit run viewer/app.py -- DIR``; the directory
may also come from ``DEJA_VIEW_DIR``). The page is in the URL: ``?run=R&file=F&step=N``
opens run R (the cassette file F in the folder: a copied cassette keeps its run id, so the
file is what tells two copies apart) and one of its steps, ``?a=R1&a_file=F1&b=R2&b_file=F2``
compares two runs (``&c=R3&c_file=F3`` ... more, :mod:`viewer.diff_page`),
``?run=R&file=F&via=F0`` opens a run of another folder found in the fork tree of the
folder's file F0 (:mod:`viewer.lineage`), nothing lists the runs (``?q=words`` keeps the search),
``?page=submitted`` shows the runs database (:mod:`viewer.submitted_page`), ``?page=suites``
the suites and sweeps that left their summary in the folder and ``&suite=S`` one's verdict
table (:mod:`viewer.suite_page`); a reload or a shared link restores the view. This script
only lays out: every question is a function of :mod:`viewer.queries`.

A run of the runs database is opened by its id there, ``?submitted=R`` (``a_submitted``,
``b_submitted`` in a diff): its cassette is the file the database names, wherever it lies
(``$DEJA_HOME/cassettes`` or ``DEJA_CASSETTE_DIR``), and its folder is indexed as a second
source, read and verified as the viewed folder is. Nothing else outside the viewed folder
is opened: a URL names runs, never paths. A fork of such a run is written to the viewed
folder, where it is listed and opened as usual.
"""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from recorder.errors import DejaError
from viewer import diff_page, lineage, queries, suite_page, widgets
from viewer.index import RunIndex
from viewer.lineage import open_index, refresh, tree_panel
from viewer.safe import md
from viewer.timeline import EMPTY, Timeline


def directory() -> Path:
    """``streamlit run app.py -- DIR`` (or ``serve.py -- DIR``, as ``deja view`` runs it),
    else ``$DEJA_VIEW_DIR``, else ``cassettes``."""
    argv = sys.argv
    here = Path(__file__).resolve()
    if len(argv) > 1 and Path(argv[0]).resolve() in (here, here.with_name("serve.py")):
        return Path(argv[1])
    return Path(os.environ.get("DEJA_VIEW_DIR") or "cassettes")


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------------- runs


def runs_page(index: RunIndex) -> None:
    st.title("Runs")
    st.caption(md("Every run recorded in the folder {:code}, newest first", index.directory))
    options = queries.filter_options(index)
    with st.sidebar:
        st.header("Filters")
        status = st.multiselect("Status", options["status"], key="f_status")
        model = st.multiselect("Model", options["model"], key="f_model")
        tool = st.multiselect("Tool used", options["tool"], key="f_tool")
        since = st.date_input("Started on or after", value=None, key="f_since")
        until = st.date_input("Started on or before", value=None, key="f_until")
        left, right = st.columns(2)
        min_tokens = left.number_input("Min tokens", min_value=0, value=None, step=100,
                                       key="f_min_tokens")
        max_tokens = right.number_input("Max tokens", min_value=0, value=None, step=100,
                                        key="f_max_tokens")
        min_cost = left.number_input("Min cost ($)", min_value=0.0, value=None, step=0.01,
                                     format="%.4f", key="f_min_cost")
        max_cost = right.number_input("Max cost ($)", min_value=0.0, value=None, step=0.01,
                                      format="%.4f", key="f_max_cost")
    text = st.text_input("Search messages and tool content", key="q", bind="query-params",
                         placeholder="words from a prompt, a reply, a tool argument or result")
    filters: dict[str, Any] = {
        "status": status, "model": model, "tool": tool, "since": since, "until": until,
        "min_tokens": min_tokens, "max_tokens": max_tokens, "min_cost": min_cost,
        "max_cost": max_cost, "text": text or None}
    rows = queries.list_runs(index, **filters)
    running = [r for r in rows if r["status"] == "running"]

    @st.fragment(run_every=2 if running else None)
    def table() -> None:
        current = rows
        if running:
            refresh(index)
            current = queries.list_runs(index, **filters)
        runs_table(current)

    table()


def runs_table(rows: list[dict[str, Any]]) -> None:
    st.caption(md("{} run(s)", len(rows)))
    unverified = sum(r.get("signed") == "NOT VERIFIED" for r in rows)
    if unverified:  # its column is to the right: said here too
        st.error(md("{} run(s) NOT VERIFIED: their signatures were not checked, so what "
                    "they say is unchecked.", unverified), icon=":material/warning:")
    frame = pd.DataFrame([{c: r.get(c) for c in queries.RUN_COLUMNS} for r in rows],
                         columns=list(queries.RUN_COLUMNS))
    frame["started"] = pd.to_datetime(frame["started"], utc=True, errors="coerce")
    # Widths in pixels up to the labels (a run id, a start to the second, a cost to the
    # millionth of a dollar): 892 of the 940 the table has at 1400 px, room left for a
    # vertical scrollbar; what is right of the labels is scrolled to.
    st.dataframe(frame, hide_index=True, key="runs_table", placeholder=EMPTY, column_config={
        "name": st.column_config.TextColumn("run", width=170),
        "status": st.column_config.TextColumn("status", width=80),
        "started": st.column_config.DatetimeColumn("started (UTC)", width=132,
                                                   format="YYYY-MM-DD HH:mm:ss"),
        "steps": st.column_config.NumberColumn("steps", width=50),
        "tokens": st.column_config.NumberColumn("tokens", width=60),
        "cost": st.column_config.NumberColumn("cost", format="$%.6f", width=80),
        "parent": st.column_config.TextColumn("parent", width=170),
        "labels": st.column_config.TextColumn("labels", width=150),
        "duration": st.column_config.NumberColumn("duration", format="%.3f s"),
        "error": st.column_config.TextColumn("error", width="large")})
    bad = [r for r in rows if r["status"] == "error"]
    if bad:
        st.warning(md("{} cassette(s) could not be read; the rest are listed as usual.",
                      len(bad)))
        for r in bad:
            st.error(md("{:code}: {}", r["name"], r["error"]))
    if not rows:
        return
    by_file = {r["file"]: r for r in rows}
    files = list(by_file)

    def label(file: str) -> str:
        row = by_file[file]
        return row["name"] if row["name"] == file else f"{row['name']} · {file}"

    left, right = st.columns([4, 1], vertical_alignment="bottom")
    pick = left.selectbox("Open a run", files, key="open_run", format_func=label)
    right.button("Open", key="open_run_btn", on_click=widgets.go,
                 kwargs=widgets.run_params(by_file[pick]))
    if len(files) > 1:
        left, mid, right = st.columns([2, 2, 1], vertical_alignment="bottom")
        a = left.selectbox("Compare run A", files, key="diff_a", format_func=label)
        b = mid.selectbox("with run B", files, index=1, key="diff_b", format_func=label)
        right.button("Diff", key="diff_btn", on_click=widgets.go,
                     kwargs=widgets.diff_params(by_file[a], by_file[b]))


# ---------------------------------------------------------------------- one run


def run_page(index: RunIndex, run: str, *, submitted: str | None = None,
             fork_dir: Path | None = None, via: str | None = None,
             viewed: RunIndex | None = None) -> None:
    """Run ``run`` of ``index``; ``submitted``: its id in the runs database, opened from
    Submitted runs (``run`` is then the cassette the database names); ``via``: the run of
    the viewed folder (``viewed``) whose fork tree it was reached through, for a run of
    another folder; ``fork_dir``: where its forks are written (next to it by default)."""
    marks = {k: v for k, v in (("submitted", submitted), ("via", via)) if v is not None}
    if submitted is None:
        st.button("← All runs", on_click=widgets.go, key="back")
    found = run_header(index, run, marks)
    if found is None:
        st.error(md("No run {!r} in {:code}.", run, index.directory))
        return
    header: dict[str, Any] = found  # not None, also in the fragment that refreshes it
    st.title(md("Run {}", header["name"]))
    st.caption(md("{:code} · started {}", header["path"], header["started"] or "-"))
    if header["status"] == "error":
        st.error(md("This cassette cannot be read: {}", header["error"]))
        return
    state = live_state(header)

    @st.fragment(run_every=1 if state["poll"] else None)
    def body() -> None:
        nonlocal header
        now = state
        if state["poll"]:
            refresh(index)
            header = run_header(index, run, marks) or header
            now = live_state(header)
            if not now["poll"]:  # it ended: one full rerun, and the timer stops
                st.rerun()
        run_body(index, header, now["live"], fork_dir, viewed or index)

    body()


def run_header(index: RunIndex, run: str, marks: dict[str, str]) -> dict[str, Any] | None:
    """:func:`queries.run_header`, marked with the run's id in the runs database when it
    was opened from there, or with the run it was reached through (``via``): its links
    and diffs name it so."""
    header = queries.run_header(index, run)
    if header is not None:
        header.update(marks)
    return header


def live_state(header: dict[str, Any]) -> dict[str, Any]:
    header["status"] = queries.current_status(header)  # the end line first, not the index
    active = False
    if header.get("submitted"):  # what the runs database says of a cassette left open
        from viewer import submitted_page

        header["status"], active = submitted_page.run_status(header["submitted"],
                                                             header["status"])
    unfinished = header["status"] in queries.UNFINISHED
    status = queries.live(header["run"]) if unfinished and header["run"] else None
    forks = [f for f in st.session_state.get("forks", [])
             if str(f.parent) == header["path"] and f.process.poll() is None]
    return {"live": status, "poll": bool(status and status["running"]) or ending(status)
            or bool(forks) or active}


def ending(status: dict[str, Any] | None, grace_s: float = 30.0) -> bool:
    """The record says ended, the cassette has no end line yet: ``deja record`` writes it
    once the program has exited. Keep refreshing for a while, so that it shows."""
    if not status or not status["ended"]:
        return False
    try:
        age = datetime.now(UTC) - datetime.fromisoformat(str(status["record"].get("updated")))
    except (TypeError, ValueError):  # no time, or one without its zone
        return False
    return age < timedelta(seconds=grace_s)


def run_body(index: RunIndex, header: dict[str, Any], status: dict[str, Any] | None,
             fork_dir: Path | None = None, viewed: RunIndex | None = None) -> None:
    # The timeline is sent before the totals and panels above it (filled in afterwards):
    # the browser starts drawing a long run's grid the soonest. What says the run is not
    # verified is sent before it.
    totals = st.container()
    if header.get("error"):
        st.warning(md("{}", header["error"]))
    if not header.get("verified"):
        st.error(md("{}. What this page shows is the file as it is, unchecked.",
                    header.get("verify_note") or "NOT VERIFIED"), icon=":material/warning:")
    panels = st.container()
    grid = Timeline(index, header)
    labels = grid.labels
    with totals:
        cols = st.columns([1.6, 0.8, 1, 1.6, 1, 1.1])  # room for "incomplete", "$0.012345"
        cols[0].metric("Status", md("{}", header["status"]))
        cols[1].metric("Steps", md("{}", header["steps"]))
        cols[2].metric("Tokens", f"{header['tokens']:,}",
                       help=f"{header['input_tokens']:,} in, {header['output_tokens']:,} out")
        cols[3].metric("Cost", widgets.money(header["cost"]))
        cols[4].metric("Model calls", md("{}", header["model_calls"]))
        cols[5].metric("Duration", "-" if header["duration"] is None
                       else f"{header['duration']:.3f}s")
    with panels:
        widgets.lineage_panel(index, header)
        tree_panel(viewed or index, header)
        if status and status["record"] is not None:
            widgets.live_panel(header, status)
    # A long run's charts are drawn on request, so its timeline paints first.
    steps = len(labels) if labels is not None else header["steps"]
    if steps <= DENSE or st.toggle(md("Charts of the {:,} steps", steps), key="charts"):
        charts(queries.run_steps(index, header["path"]))
    step_panel(header, labels, fork_dir)
    grid.fill()


DENSE = 200  # steps up to which the charts draw one labelled mark per step
def charts(steps: list[dict[str, Any]]) -> None:
    """Cumulative tokens and cost over the run's time, and every step as a bar from its
    start to its end (a waterfall, as trace viewers draw a trajectory)."""
    usage = queries.usage_over_time(steps)
    if usage:
        frame = pd.DataFrame(usage)
        left, right = st.columns(2)
        for col, field, title, fmt in ((left, "tokens", "Tokens so far", ",d"),
                                       (right, "cost", "Cost so far ($)", "$,.6f")):
            with col:
                st.caption(md("{}", title))
                chart = alt.Chart(frame).mark_line(point=len(frame) <= DENSE,
                                                   interpolate="step-after").encode(
                    x=alt.X("time_s:Q", title="time since the run began (s)"),
                    y=alt.Y(f"{field}:Q", title=None, axis=alt.Axis(format=fmt, tickCount=4)),
                    tooltip=["seq", "time_s", field])
                st.altair_chart(chart, width="stretch", height=200)
    bars = queries.waterfall(steps)
    if not bars:
        return
    st.caption("Steps over time: start and duration (ms)")
    frame = pd.DataFrame(bars)
    span = max(frame["end_ms"].max(), 1.0)
    frame["drawn_end_ms"] = frame[["end_ms"]].max(axis=1).clip(  # a 0.1 ms step stays visible
        lower=frame["start_ms"] + span * 0.004)
    if len(frame) <= DENSE:  # one labelled row per step
        y = alt.Y("step:N", sort=None, title=None, axis=alt.Axis(labelLimit=280))
        height: Any = alt.Step(24)
    else:  # a long run: every step still drawn, as a dense overview of fixed height
        y = alt.Y("seq:Q", title="step (seq)", scale=alt.Scale(reverse=True))
        height = 480
    chart = alt.Chart(frame).mark_bar().encode(
        x=alt.X("start_ms:Q", title="ms since the run began"), x2="drawn_end_ms:Q", y=y,
        color=alt.Color("kind:N", legend=alt.Legend(orient="right", title=None)),
        tooltip=["step", "start_ms", "duration_ms"])
    st.altair_chart(chart.properties(height=height), width="stretch")


def step_panel(header: dict[str, Any], names: dict[int, str] | None,
               fork_dir: Path | None = None) -> None:
    """The step picker and the step of the URL (``step``), opened. A short run's picker
    lists every step (``names``, their labels); a long run's takes a step's number."""
    current = _int(st.query_params.get("step"))
    if names is not None:
        current = current if current in names else None
        st.session_state["step_select"] = current  # the URL is the truth
        st.selectbox("Open step", [None, *names], key="step_select", on_change=_picked,
                     args=("step_select",),
                     format_func=lambda s: "—" if s is None else names[s])
    else:
        last = max(header["steps"] - 1, 0)
        current = current if current is not None and 0 <= current <= last else None
        st.session_state["step_number"] = current
        st.number_input(md("Open step (0 to {:,})", last), min_value=0, max_value=last,
                        step=1, key="step_number", on_change=_picked, args=("step_number",),
                        placeholder="a step's seq")
    widgets.forks_panel(header)
    if current is not None:
        open_step(header, current, fork_dir)


def _picked(key: str) -> None:
    """Callback: the step picked goes into the URL."""
    value = st.session_state[key]
    if value is None:
        st.query_params.pop("step", None)
    else:
        st.query_params["step"] = str(int(value))


def open_step(header: dict[str, Any], current: int, fork_dir: Path | None) -> None:
    full_key = f"full:{header['path']}:{current}"
    try:
        detail = queries.step_detail(header["path"], current,
                                     full=st.session_state.get(full_key, False))
    except (DejaError, OSError) as exc:
        st.error(md("Step {} cannot be shown: {}", current, exc))
        return
    st.subheader(md("Step {}: {} {}", current, detail.kind, detail.name))
    if detail.truncated:
        st.warning("Payloads over 100 KB are cut short.")
        st.button("Show full", key="show_full", on_click=st.session_state.__setitem__,
                  args=(full_key, True))
    widgets.step(detail)
    if detail.editable:
        widgets.fork_editor(header, detail, out_dir=fork_dir)


# ---------------------------------------------------------------------- submitted runs


def submitted_run_page(folder: Path, run_id: str) -> None:
    """Run ``run_id`` of the runs database, opened from Submitted runs: the cassette the
    database names, in the run page, its folder indexed as a second source; a fork of it
    goes to the viewed ``folder`` (when there is one), where it can be opened."""
    from viewer import submitted_page

    st.button("← Submitted runs", on_click=widgets.go, kwargs={"page": "submitted"},
              key="back")
    found = submitted_page.run_record(run_id)  # None: it says why
    if found is None:
        return
    path = Path(found["cassette"])
    if not path.is_file():
        submitted_page.not_started(found)
        return
    run_page(open_index(path.parent), str(path), submitted=run_id,
             fork_dir=folder if folder.is_dir() else None)


def via_run_page(viewed: RunIndex, via: str) -> None:
    """A run of another folder, reached through the fork tree of ``via`` (a file of the
    viewed folder): the address names runs, never a path. Its forks go to the viewed
    folder, where they are listed."""
    run, file = st.query_params.get("run"), st.query_params.get("file")
    path = lineage.locate(viewed, via, run, file)
    if path is None:
        st.button("← All runs", on_click=widgets.go, key="back")
        st.error(md("No run {} in the fork tree of {}.", run or file, via))
        return
    run_page(open_index(path.parent), str(path), via=via, viewed=viewed,
             fork_dir=viewed.directory)


# ---------------------------------------------------------------------- main


def main() -> None:
    st.set_page_config(page_title="deja", page_icon="⏺", layout="wide")
    folder = directory()
    with st.sidebar:
        st.markdown("### deja")
        st.caption(md("{:code}", folder))
        st.button("Runs", on_click=widgets.go, key="nav_runs")
        st.button("Submitted runs", on_click=widgets.go, kwargs={"page": "submitted"},
                  key="nav_submitted")
        st.button("Suites", on_click=widgets.go, kwargs={"page": "suites"}, key="nav_suites")
    if st.query_params.get("page") == "submitted":  # the runs database, not the folder
        from viewer import submitted_page  # the engine is slow to import: only here

        submitted_page.page()
        return
    if run_id := st.query_params.get("submitted"):  # a run of the runs database
        submitted_run_page(folder, run_id)
        return
    if not folder.is_dir():
        st.error(md("No cassette directory {}. Start the viewer with `deja view DIR`.", folder))
        return
    index = open_index(folder)
    params = st.query_params
    if params.get("page") == "suites":
        suite_page.page(index)
    elif len(named := diff_page.sides(index)) >= 2:
        diff_page.page(index, named)
    elif via := params.get("via"):  # a run of another folder, in a fork tree of this one
        via_run_page(index, via)
    elif ref := params.get("file") or params.get("run"):
        run_page(index, ref)
    else:
        runs_page(index)


main()
