"""The Submitted runs page (``?page=submitted``): runs out of the request cycle.

The queued, working and waiting runs of the runs database (each with its status, step,
turn, spend, worker and labels), the recently ended ones below them, and the schedules
with their next occurrence, last verified artefact and latest alerts. A waiting run
shows its question with a box for the answer; a queued or working run has a Cancel
button. While runs are active the tables refresh every two seconds (every ten when
none is). A run's id opens its page (``?submitted=R``, laid out by :mod:`viewer.app`),
where the cassette the database names is shown; :func:`run_record`, :func:`run_status`
and :func:`not_started` are what that page asks of the database.

Shown by :mod:`viewer.app`, which imports this module only when the page is asked for;
every question goes to :mod:`viewer.submitted`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from deja.runs.config import database_url
from deja.runs.errors import DatabaseUnavailable
from deja.runs.service import Runs
from recorder.errors import DejaError, NoSuchRun
from viewer import submitted, widgets
from viewer.safe import md

EMPTY = "—"
REFRESH_S = 2  # seconds between refreshes while runs are active
IDLE_REFRESH_S = 10  # and otherwise (a run submitted meanwhile shows)
FLASH = "submitted_flash"  # what the last Answer or Cancel did, shown once
CONFIRM = "submitted_confirm_cancel"  # the run whose Cancel waits for a second click
LEFT_OPEN = ("incomplete", "crashed", "torn")  # a cassette without end line or writer


@st.cache_resource(show_spinner=False, on_release=submitted.close)
def connection(url: str) -> Runs:
    """One runs service per database for the whole viewer (the engine's client is slow to
    make); a failure is not kept, so the next view tries again."""
    return submitted.connect(url)


def _action_errors() -> tuple[type[BaseException], ...]:
    """What an Answer or a Cancel can meet: deja's named errors, or a database gone
    meanwhile."""
    return (DejaError, *submitted.database_errors())


def _say(kind: str, template: str, *values: Any) -> None:
    """Keep a message to show once: ``template`` with ``values`` as literal text."""
    st.session_state[FLASH] = (kind, md(template, *values))


def _answer(runs: Runs, run_id: str, question: str | None) -> None:
    text = st.session_state.get(f"answer_text:{run_id}") or ""
    if not text.strip():
        _say("error", "Type an answer for run {} first.", run_id)
        return
    try:
        runs.answer(run_id, text)
    except _action_errors() as exc:
        _say("error", "Run {} could not be answered: {}", run_id, exc)
        return
    st.session_state.setdefault("answered", set()).add((run_id, question))
    st.session_state[f"answer_text:{run_id}"] = ""  # a later question starts empty
    _say("success", "Answer sent to run {}; it goes on when a worker takes it up.", run_id)


def _ask_cancel(run_id: str | None) -> None:
    """First click: ask again before cancelling (None: keep the run)."""
    st.session_state[CONFIRM] = run_id


def _cancel(runs: Runs, run_id: str) -> None:
    st.session_state.pop(CONFIRM, None)
    try:
        done = runs.cancel(run_id)
    except _action_errors() as exc:
        _say("error", "Run {} could not be cancelled: {}", run_id, exc)
        return
    if done.get("note"):
        _say("warning", "Run {}: {}.", run_id, done["note"])
    elif done["status"] == "cancelling":
        _say("success", "Cancel sent to run {}: it stops at its next boundary.", run_id)
    else:
        _say("success", "Run {} is cancelled (it was {}).", run_id, done["was"])


def how_to_start() -> None:
    st.markdown(submitted.HOW_TO_START)


def _open(key: str, run_ids: list[str]) -> None:
    """Callback of a runs table's run column: open the clicked run's page."""
    click = st.session_state.get(key)
    run_id = click["label"] if click else None
    if run_id in run_ids:  # a run the database listed, by its id
        widgets.go(submitted=run_id)


def run_record(run_id: str) -> dict[str, Any] | None:
    """The runs database's record of ``run_id`` (:func:`submitted.run_record`), or None
    once the page says why there is none."""
    url = database_url()
    missing = submitted.missing_database(url)
    if missing is not None:
        st.error(md("No run {} here: the runs database {:code} does not exist yet.",
                    run_id, missing))
        return None
    try:
        return submitted.run_record(connection(url), run_id)
    except DatabaseUnavailable as exc:
        connection.clear()
        st.error(md("The runs database cannot be read: {}", exc))
    except NoSuchRun as exc:
        st.error(md("{}", exc))
    return None


def _record_now(run_id: str) -> dict[str, Any] | None:
    """The database's record of a run shown already; None when it cannot say now."""
    try:
        return submitted.run_record(connection(database_url()), run_id)
    except DejaError:
        return None


def run_status(run_id: str, status: str) -> tuple[str, bool]:
    """The status a submitted run's page shows, and whether to keep refreshing it.

    ``status`` comes from its cassette (the end line first, then its writer); a cassette
    that has neither (the run waits for an answer, was queued again, was cancelled while
    it waited) says less than the runs database, whose status is shown then. The page
    keeps refreshing while the database says the run is queued, working or waiting.
    """
    found = _record_now(run_id)
    if found is None:  # the database gone meanwhile: the cassette's word
        return status, False
    if status in LEFT_OPEN:
        status = found["status"]
    return status, found["status"] in submitted.ACTIVE


def not_started(found: dict[str, Any]) -> None:
    """A submitted run with no cassette yet: queued, or cancelled before it started. The
    page waits for its worker to start it."""
    run_id = found["run_id"]
    st.title(md("Run {}", run_id))
    st.caption(md("{:code} · not written yet", found["cassette"]))

    @st.fragment(run_every=REFRESH_S if found["status"] in submitted.ACTIVE else None)
    def status() -> None:
        now = found
        if st.session_state.pop("not_started_drawn", False):  # a refresh
            now = _record_now(run_id) or found
            if now["status"] != found["status"] or Path(now["cassette"]).is_file():
                st.rerun()  # it started, or ended: the whole page again
        st.session_state["not_started_drawn"] = True
        st.metric("Status", md("{}", now["status"]))
        if now["status"] in submitted.ACTIVE:
            st.info("No cassette yet: a worker writes it once it starts the run, and this "
                    "page shows it then.")
        else:
            st.info(md("The run ended {} with no cassette: nothing of it was recorded.",
                       now["status"]))

    st.session_state.pop("not_started_drawn", None)
    status()


def page() -> None:
    st.title("Submitted runs")
    url = database_url()
    missing = submitted.missing_database(url)
    if missing is not None:
        st.info(md("No runs database yet: {:code} does not exist, so no run was ever "
                   "submitted here.", missing))
        how_to_start()
        return
    try:
        runs = connection(url)
        first = submitted.board(runs)
    except DatabaseUnavailable as exc:
        connection.clear()
        st.error(md("The runs database cannot be read: {}", exc))
        how_to_start()
        return
    st.caption(md("Runs submitted with `deja submit` or `POST /runs`, and scheduled runs, "
                  "from the runs database {:code}", first.where))

    @st.fragment(run_every=REFRESH_S if first.active else IDLE_REFRESH_S)
    def body() -> None:
        view = first
        if st.session_state.pop("submitted_drawn", False):  # a refresh, not the first draw
            try:
                view = submitted.board(runs)
            except DatabaseUnavailable as exc:
                connection.clear()
                st.error(md("The runs database cannot be read: {}", exc))
                return
        st.session_state["submitted_drawn"] = True
        board_body(runs, view)

    st.session_state.pop("submitted_drawn", None)
    body()


def board_body(runs: Runs, view: submitted.Board) -> None:
    flash = st.session_state.pop(FLASH, None)
    if flash is not None:
        getattr(st, flash[0])(flash[1])  # made by md() in _say
    st.subheader("Queued, working and waiting")
    if view.active:
        runs_table(view.active, submitted.ACTIVE_COLUMNS, "active_runs")
    else:
        st.caption("No run is queued, working or waiting.")
    for record in submitted.waiting(view.active):
        waiting_run(runs, record)
    cancellable = submitted.cancellable(view.active)
    if cancellable:
        st.markdown("**Cancel a run**")
        for record in cancellable:
            run_id = record["run_id"]
            left, right = st.columns([4, 2], vertical_alignment="center")
            left.markdown(md("{:code} · {}", run_id, record["status"])
                          + (md(" · {}", record["step"]) if record.get("step") else ""))
            if st.session_state.get(CONFIRM) != run_id:
                right.button("Cancel", key=f"cancel_btn:{run_id}", on_click=_ask_cancel,
                             args=(run_id,),
                             help="A queued run never starts; a working one stops at its "
                                  "next boundary. Asks once more first.")
                continue
            yes, keep = right.columns(2)
            yes.button("Cancel it", key=f"cancel_yes:{run_id}", type="primary",
                       on_click=_cancel, args=(runs, run_id),
                       help=md("Cancel run {} now.", run_id))
            keep.button("Keep", key=f"cancel_keep:{run_id}", on_click=_ask_cancel,
                        args=(None,))
    st.subheader("Recently ended")
    if view.ended:
        runs_table(view.ended, submitted.ENDED_COLUMNS, "ended_runs")
    else:
        st.caption("No run has ended yet.")
    schedules_panel(view.schedules)


def runs_table(records: list[dict[str, Any]], columns: tuple[str, ...], key: str) -> None:
    """A table of runs; a click on a run's id opens its page."""
    frame = pd.DataFrame([{c: submitted.run_row(r)[c] for c in columns} for r in records],
                         columns=list(columns))
    click = f"{key}_open"
    st.dataframe(frame, hide_index=True, key=key, placeholder=EMPTY, column_config={
        "run": st.column_config.ButtonColumn(
            "run", width="medium", alignment="left", help="Open the run's page",
            on_click=_open, args=(click, [r["run_id"] for r in records]), key=click),
        "step": st.column_config.TextColumn("step", width="medium"),
        "spend": st.column_config.NumberColumn("spend", format="$%.6f"),
        "error": st.column_config.TextColumn("error", width="large")})


def waiting_run(runs: Runs, record: dict[str, Any]) -> None:
    run_id = record["run_id"]
    with st.container(border=True):
        st.markdown(md("**Run {:code} asks:** {}", run_id,
                       record.get("question") or "(no question)"))
        if (run_id, record.get("question")) in st.session_state.get("answered", set()):
            st.caption("Answered; the run goes on when a worker takes it up.")
            return
        left, right = st.columns([5, 1], vertical_alignment="bottom")
        left.text_input("Answer", key=f"answer_text:{run_id}",
                        placeholder="the answer the run resumes with")
        right.button("Answer", key=f"answer_btn:{run_id}", type="primary", on_click=_answer,
                     args=(runs, run_id, record.get("question")))


def schedules_panel(schedules: list[dict[str, Any]]) -> None:
    st.subheader("Schedules")
    if not schedules:
        st.caption("No schedule; add one with `deja schedule add NAME --cron \"0 6 * * 1\" "
                   "--deadline 07:00 -- CMD`.")
        return
    columns = list(submitted.SCHEDULE_COLUMNS)
    frame = pd.DataFrame([submitted.schedule_row(s) for s in schedules], columns=columns)
    st.dataframe(frame, hide_index=True, key="schedules", placeholder=EMPTY, column_config={
        "latest alert": st.column_config.TextColumn("latest alert", width="large"),
        "last verified artefact": st.column_config.TextColumn("last verified artefact",
                                                              width="medium")})
    for schedule in schedules:
        alerts = schedule.get("alerts") or []
        if not alerts:
            continue
        with st.expander(md("Alerts of {} ({})", schedule["name"], len(alerts))):
            st.dataframe(pd.DataFrame(alerts, columns=["at", "kind", "occurrence", "run_id",
                                                       "message", "delivery"]),
                         hide_index=True, placeholder=EMPTY)
