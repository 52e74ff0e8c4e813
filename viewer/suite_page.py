"""The Suites page (``?page=suites``): what ``deja suite`` and ``deja sweep`` left in the
viewed folder, and one suite's verdict table (``?page=suites&suite=S``).

A suite leaves its summary in the folder of the runs it made (``.deja/suites/<id>.json``,
:mod:`replayer.suite_summary`): OUTDIR for a suite with ``--then`` and for a sweep's forks,
the incidents' folder for a plain replay. The table has a row per incident (a fork, for a
sweep): its verdict (``changed at step N (kind)``), how the recorded and the new run
ended, the live calls, the cost and the seconds, and links to the incident's run, to its
new run and to the diff of the two, in the addresses the viewer already has
(:func:`viewer.widgets.run_params`, :func:`viewer.widgets.diff_params`). A link is made
only to a run found here: the new cassette in the folder (by its file, with the run id
the summary names), the incident in the folder or, for a new run's parent in another
folder, through the new run's fork tree (``via``, :mod:`viewer.lineage`), whose headers
are signed. A path the summary names is shown, never opened: the summary is anyone's
who can write the folder, and is read as untrusted (its fields checked, its strings
shown as text).
"""

from __future__ import annotations

import shlex
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pandas as pd
import streamlit as st

from replayer import suite as suites
from replayer import suite_summary
from viewer import lineage, queries, widgets
from viewer.index import RunIndex
from viewer.safe import md

EMPTY = "—"
TABLE = ("incident", "run", "new run", "diff", "verdict", "live calls", "cost", "seconds",
         "recorded", "now", "error")
LIST = ("suite", "started", "mode", "incidents", "verdicts", "exit status", "where", "error")
OPEN_KEY = "suites_open"
INCIDENT_WIDTH = 160  # pixels: a file name such as 01-refund-all.jsonl
RUN_WIDTH = 160  # a run id


def page(index: RunIndex) -> None:
    """The suites of the folder, or the one the address names."""
    suite_id = st.query_params.get("suite")
    if suite_id:
        one(index, suite_id)
    else:
        listing(index)


# ---------------------------------------------------------------------- the suites


def _open(ids: list[str]) -> None:
    """Callback of the list's suite column: open the clicked suite."""
    click = st.session_state.get(OPEN_KEY)
    suite_id = click["label"] if click else None
    if suite_id in ids:
        widgets.go(page="suites", suite=suite_id)


def listing(index: RunIndex) -> None:
    st.title("Suites")
    st.caption(md("What deja suite and deja sweep left in {:code}, newest first; a suite's "
                  "id opens its verdict table", index.directory / ".deja" / "suites"))
    found = suite_summary.find(index.directory)
    if not found:
        st.info(md("No suite has left its summary in {:code}. A suite with --then leaves it "
                   "with its new cassettes (deja view OUTDIR), a plain replay in the "
                   "incidents' folder, a sweep with its forks.", index.directory))
        return
    rows = [_listed(suite_id, summary) for suite_id, summary in found]
    frame = pd.DataFrame(rows, columns=list(LIST))
    st.dataframe(frame, hide_index=True, key="suites", placeholder=EMPTY, column_config={
        "suite": st.column_config.ButtonColumn(
            "suite", width="medium", alignment="left", help="Open the suite's verdicts",
            on_click=_open, args=([s for s, _ in found],), key=OPEN_KEY),
        "error": st.column_config.TextColumn("error", width="large")})


def _listed(suite_id: str, summary: dict[str, Any] | suite_summary.SummaryError
            ) -> dict[str, Any]:
    if isinstance(summary, suite_summary.SummaryError):
        return {"suite": suite_id, "error": f"not a summary: the file {summary}"}
    totals = summary["totals"]
    status = totals.get("exit_status")
    return {"suite": suite_id, "started": summary["when"], "mode": summary["mode"],
            "incidents": len(summary["incidents"]), "verdicts": _counts(summary),
            "exit status": status if isinstance(status, int) else None,
            "where": summary["where"]}


def _counts(summary: dict[str, Any]) -> str:
    """How many entries have each verdict, in words: ``1 identical, 1 now completes``."""
    said = Counter(_verdict_word(e, summary["kind"]) for e in summary["incidents"])
    return ", ".join(f"{n} {word}" for word, n in said.items())


def _verdict_word(entry: dict[str, Any], kind: str | None) -> str:
    """An entry's verdict without where it changed: ``now completes``, ``not judged``."""
    if kind == "sweep":
        return suite_summary.verdict_text(entry, kind).split(" (", 1)[0]
    verdict = str(entry["verdict"])
    return "not judged" if verdict == "error" else verdict.replace("_", " ")


# ---------------------------------------------------------------------- one suite


def one(index: RunIndex, suite_id: str) -> None:
    """Suite ``suite_id`` of the folder: what it ran, its totals and its verdict table."""
    st.button("← Suites", on_click=widgets.go, kwargs={"page": "suites"}, key="back")
    path = suite_summary.path_of(index.directory, suite_id)
    if path is None or not path.is_file():
        st.error(md("No suite {} in {:code}.", suite_id, index.directory / ".deja" / "suites"))
        return
    try:
        summary = suite_summary.read(path)
    except suite_summary.SummaryError as exc:
        st.error(md("{:code} {}", path, exc))
        return
    st.title(md("Suite {}", suite_id))
    st.caption(md("{} · {} {} of {:code} · started {} · {}", summary["mode"] or "?",
                  len(summary["incidents"]),
                  "fork(s) of the run in" if summary["kind"] == "sweep" else "incident(s)",
                  summary["folder"] or "?", summary["when"] or "?", summary["where"] or "?"))
    if summary["command"]:
        st.code(shlex.join(summary["command"]), language=None)
    totals(summary)
    table(index, summary)


def totals(summary: dict[str, Any]) -> None:
    """Its counts, what its live parts cost, how long it took and its exit status."""
    entries = summary["incidents"]
    status, wall = summary["totals"].get("exit_status"), summary["totals"].get("seconds")
    cols = st.columns(4)
    cols[0].metric("Incidents" if summary["kind"] != "sweep" else "Forks", f"{len(entries):,}")
    cols[1].metric("Live cost", widgets.money(sum(e["live"]["cost_usd"] for e in entries)))
    cols[2].metric("Seconds", f"{wall:.2f}" if isinstance(wall, int | float) else "?",
                   help="From the start of the suite to its last verdict")
    cols[3].metric("Exit status", f"{status:d}" if isinstance(status, int) else "?")
    st.caption(md("{}", _counts(summary) or "no incident"))


def table(index: RunIndex, summary: dict[str, Any]) -> None:
    """The verdict table; its run, new run and diff cells are links."""
    rows = [row(index, entry, summary["kind"]) for entry in summary["incidents"]]
    frame = pd.DataFrame(rows, columns=list(TABLE))
    # The links first, in columns of fixed widths (a run id each): they stay in view.
    st.dataframe(frame, hide_index=True, key="suite_table", placeholder=EMPTY, column_config={
        "incident": st.column_config.TextColumn("incident", width=INCIDENT_WIDTH),
        "run": st.column_config.LinkColumn("run", display_text=r"^\?run=([^&]*)",
                                           width=RUN_WIDTH, help="The incident's run (a new tab)"),
        "new run": st.column_config.LinkColumn(
            "new run", display_text=r"^\?run=([^&]*)", width=RUN_WIDTH,
            help="The run the suite made from the incident (a new tab)"),
        "diff": st.column_config.LinkColumn("diff", display_text="diff", width=50,
                                            help="The incident against its new run"),
        "verdict": st.column_config.TextColumn("verdict", width=280),
        "error": st.column_config.TextColumn("error", width="large")})
    missing = sum(1 for r in rows if r["run"] is None and r["new run"] is None)
    if missing:
        st.caption(md("{} row(s) link no run: their cassettes are not runs of this folder "
                      "or of its runs' fork trees.", missing))


def row(index: RunIndex, entry: dict[str, Any], kind: str | None) -> dict[str, Any]:
    """One incident's row: its verdict and totals as ``deja suite`` prints them, and the
    addresses of its runs and of their diff (None: not found here)."""
    shown = suites.row(entry)
    incident, new = runs_of(index, entry)
    return {**{k: shown[k] for k in ("incident", "recorded", "now", "live calls", "cost",
                                     "seconds")},
            "verdict": suite_summary.verdict_text(entry, kind),
            "run": link(widgets.run_params(incident)) if incident else None,
            "new run": link(widgets.run_params(new)) if new else None,
            "diff": link(widgets.diff_params(incident, new)) if incident and new else None,
            "error": entry["error"]}


def link(params: dict[str, Any]) -> str:
    """A page's address, relative to the viewer's: its query alone."""
    return "?" + urlencode({k: str(v) for k, v in params.items() if v is not None})


def runs_of(index: RunIndex, entry: dict[str, Any]
            ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The incident's run and its new run, as run rows of this folder (the incident, when
    it is elsewhere, reached through the new run's fork tree); None for one not found."""
    new = _here(index, _name(entry["new_cassette"]), entry["new_run"])
    file = _name(entry["cassette"]) or entry["incident"]
    incident = _here(index, file, entry["run"])
    if incident is not None and new is not None and incident["path"] == new["path"]:
        incident = None  # the new run, under the incident's file name: not the incident
    if incident is None and new is not None and entry["run"] and file:
        anchor = Path(new["path"]).name
        found = lineage.locate(index, anchor, entry["run"], file)
        if found is not None:
            incident = {"run": entry["run"], "path": str(found), "via": anchor}
    return incident, new


def _name(path: str | None) -> str | None:
    return Path(path).name if path else None


def _here(index: RunIndex, file: str | None, run: str | None) -> dict[str, Any] | None:
    """The run of this folder whose file is ``file`` (and whose id is ``run``, when
    given)."""
    if not file:
        return None
    found = queries.run_header(index, file)
    if found is None or Path(found["path"]).name != file or (run and found["run"] != run):
        return None
    return found
