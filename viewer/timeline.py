"""A run's timeline: the grid of its steps on the run's page, a long run's first screen
first."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from viewer import queries, widgets
from viewer.index import RunIndex
from viewer.safe import md

STEP_COLUMNS = list(queries.TIMELINE_COLUMNS)
EMPTY = "—"  # what a cell without a value shows
WHOLE = 1000  # steps up to which a run's timeline is sent whole at once (and its picker
#   lists every step)
FIRST_SCREEN = 60  # rows a longer run's timeline shows first, before the rest comes


class Timeline:
    """A run's timeline grid, and each step's label in the step picker (``labels``: None
    for a long run, whose picker takes a number).

    A run of up to :data:`WHOLE` steps is sent whole. A longer one is sent in two goes
    within the same run of the page, so that its first paint costs what a short run's
    does: first the grid of its first :data:`FIRST_SCREEN` steps, read from the index
    alone, then the rest of the page, and last (:meth:`fill`) the whole timeline, which
    takes the first screen's place. The whole one stays for the page's later runs (a step
    opened, a refresh of a live run).

    (Both goes are in one run because Streamlit drops what a run sent that has not yet
    reached the browser when the next run starts: a first screen sent by one run and
    filled by a rerun was lost on a busy machine, and the page showed nothing until the
    whole timeline came.)"""

    def __init__(self, index: RunIndex, header: dict[str, Any]) -> None:
        self.index, self.path = index, header["path"]
        self.labels: dict[int, str] | None = None
        st.subheader("Timeline")
        self._slot = st.empty()
        self._note: DeltaGenerator | None = None  # a long run's caption until it is filled
        if header["steps"] > WHOLE and st.session_state.get(widgets.FILLED) != self.path:
            columns = queries.timeline(index, self.path, first=FIRST_SCREEN)
            self._slot.dataframe(pd.DataFrame(columns, columns=STEP_COLUMNS), **GRID)
            self._note = st.empty()
            self._note.caption(md("The first {:,} of {:,} steps; the rest follow.",
                                  len(columns["seq"]), header["steps"]))
            return
        frame = self._whole()
        if len(frame) <= WHOLE:
            self.labels = queries.step_labels(
                {c: frame[c].tolist() for c in ("seq", "kind", "name", "mark")})

    def _whole(self) -> pd.DataFrame:
        frame = timeline(self.index.file_state(self.path), self.index)
        self._slot.dataframe(frame, key="timeline", **GRID)
        return frame

    def fill(self) -> None:
        """A long run's whole timeline, in place of its first screen (once the rest of the
        page is sent)."""
        if self._note is None:
            return
        self._whole()
        self._note.empty()
        st.session_state[widgets.FILLED] = self.path


GRID: dict[str, Any] = {  # how the timeline grid is drawn
    "hide_index": True, "placeholder": EMPTY,
    "column_config": {
        "cost": st.column_config.NumberColumn("cost", format="$%.6f"),
        "start_ms": st.column_config.NumberColumn("start (ms)", format="%.2f"),
        "latency_ms": st.column_config.NumberColumn("latency (ms)", format="%.2f")}}


@st.cache_data(max_entries=16, show_spinner=False)
def timeline(state: tuple[Any, ...], _index: RunIndex) -> pd.DataFrame:
    """The timeline table of the file whose index state (:meth:`RunIndex.file_state`) is
    ``state`` (its size and modification time when it was indexed, its signature's
    verdict's keys). Kept across sessions until the file, the index or the trust changes:
    a long run's page opened again, or by another viewer, draws it without asking the
    index."""
    columns = queries.timeline(_index, state[2])
    return pd.DataFrame(columns, columns=STEP_COLUMNS) if columns["seq"] else pd.DataFrame(
        columns=STEP_COLUMNS)
