"""The viewer's questions, as plain functions over a :class:`RunIndex` and cassette files.

The Streamlit page (:mod:`viewer.app`) only lays out what these return, so each can be
tested on its own. Lists and filters are DuckDB SQL over the index. Opening a step and
forking it live in :mod:`viewer.step` and are offered here too, so that the page asks
one module.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Any

from recorder.cassette import lock
from recorder.cassette.schema import Control, Kind, run_status
from recorder.errors import NoSuchRun, UsageError
from recorder.harness.progress import (
    cancel_requested,
    cassette_end,
    read_status,
    request_cancel,
)
from viewer.diffs import DiffView, diff_view
from viewer.index import RunIndex
from viewer.step import (
    LaunchedFork,
    StepDetail,
    document_text,
    editable,
    fork_document,
    fork_state,
    fork_warnings,
    launch_fork,
    load_cassette,
    recorded_base_url,
    side_effect_tools,
    step_detail,
    validate_edit,
)

__all__ = [
    "RUN_COLUMNS",
    "TIMELINE_COLUMNS",
    "UNFINISHED",
    "DiffView",
    "LaunchedFork",
    "StepDetail",
    "cancel",
    "current_status",
    "diff",
    "document_text",
    "editable",
    "filter_options",
    "fork_document",
    "fork_state",
    "fork_warnings",
    "labels_text",
    "launch_fork",
    "lineage",
    "list_runs",
    "live",
    "load_cassette",
    "recorded_base_url",
    "run_header",
    "run_path",
    "run_steps",
    "side_effect_tools",
    "step_detail",
    "step_labels",
    "timeline",
    "usage_over_time",
    "validate_edit",
    "waterfall",
    "writer_state",
]

# The runs table's columns, in the order they are read: what tells the runs apart, how
# each ended and what it cost, then its lineage and labels (at 1400 px everything up to
# the labels shows without scrolling), then what is looked up: the signature (a run NOT
# VERIFIED is also said above the table), the duration, the file (two copies of a run
# share an id, never a file) and the error.
RUN_COLUMNS = ("name", "status", "started", "steps", "tokens", "cost", "parent", "labels",
               "signed", "duration", "file", "error")


# ---------------------------------------------------------------------- runs


def _when(value: date | datetime | str | None) -> tuple[datetime, bool] | None:
    """A naive UTC datetime, and whether ``value`` was a bare date (a whole day)."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        text = value.strip()
        value = (date.fromisoformat(text) if len(text) <= 10
                 else datetime.fromisoformat(text.replace("Z", "+00:00")))
    if not isinstance(value, datetime):
        return datetime.combine(value, time()), True
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value, False


def _many(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if value is None or value == "":
        return []
    return [value] if isinstance(value, str) else [v for v in value if v]


def _rows(cur: Any) -> list[dict[str, Any]]:
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def _named(row: dict[str, Any]) -> dict[str, Any]:
    """A run row as the pages show it: ``name`` (the run id, or the file name of a file
    that could not be read), ``file`` (two copies of one run share their id, never their
    file), ``signed`` and, for a run without an end line, its
    writer's state (:func:`writer_state`)."""
    row["name"] = row.get("run") or Path(row["path"]).name
    row["file"] = Path(row["path"]).name
    if row.get("status") in ("incomplete", "torn"):
        row["status"] = writer_state(row["path"], row.get("run")) or row["status"]
    if "verified" in row:  # never shown as fact unless its signature was checked
        row["signed"] = ("verified" if row["verified"] else
                         None if row.get("status") == "error" else "NOT VERIFIED")
    return row


def labels_text(labels: str | dict[str, Any] | None) -> str | None:
    """A run's labels as ``key=value, ...`` (None when it has none)."""
    if isinstance(labels, str):
        text = labels
        try:
            labels = json.loads(text)
        except ValueError:
            return text
    if not isinstance(labels, dict) or not labels:
        return None
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))


def writer_state(path: str | Path, run: str | None) -> str | None:
    """What became of a run without an end line: ``running`` while a process writes it
    (it holds the cassette's writer lock, or its status record says running and names a
    live process here; a record whose artefacts name other files is another copy's),
    ``crashed`` when the record says running but that process is gone, ``failed`` when a
    worker gave up on it (its record says so); None when nothing says either (a copied or
    cut file: it stays ``incomplete``).
    """
    if lock.holder_of(path) is not None:
        return "running"
    record = read_status(run) if run else None
    if record is not None and record.get("ended") and record.get("status") == "failed" and \
            _names(record, path):
        return "failed"  # a worker gave up on it (its agent kept dying); resumable by hand
    if record is None or record.get("ended") or record.get("status") != "running":
        return None
    if not _names(record, path):  # a copy: another file is written
        return None
    alive = _alive(record)
    return "running" if alive else "crashed" if alive is False else None


UNFINISHED = ("running", "crashed", "incomplete", "torn")


def current_status(header: dict[str, Any]) -> str:
    """A run's status now (:func:`recorder.cassette.schema.run_status`): the end line of
    its file first, read from the file's tail, so that a run that ended since the index
    was refreshed (cancelled, say) is not shown as running; then who writes it. A file
    that cannot be read stays ``error``."""
    status = str(header.get("status"))
    if status == "error":
        return status
    _, end = cassette_end(header["path"])
    if end is not None:
        return run_status(end)
    if status in UNFINISHED:
        return writer_state(header["path"], header.get("run")) or status
    return status


def _names(record: dict[str, Any], path: str | Path) -> bool:
    """The record is of this file (not of another copy of the run)."""
    artefacts = [Path(str(a)).name for a in record.get("artefacts") or []]
    return not artefacts or Path(path).name in artefacts


_RUN_SELECT = """
SELECT r.run, r.path, r.status, r.created AS started, r.duration_s AS duration, r.steps,
       CASE WHEN r.input_tokens IS NULL AND r.output_tokens IS NULL THEN NULL
            ELSE CAST(coalesce(r.input_tokens, 0) + coalesce(r.output_tokens, 0) AS BIGINT)
       END AS tokens,
       r.cost_usd AS cost, r.parent_run AS parent, r.parent_step, r.models, r.error,
       r.verified, r.verify_note, r.input_tokens, r.output_tokens, r.model_calls,
       r.tool_calls, r.errors, r.labels
FROM runs r
"""


def list_runs(index: RunIndex, *, status: str | list[str] | None = None,
              model: str | list[str] | None = None, tool: str | list[str] | None = None,
              since: date | datetime | str | None = None,
              until: date | datetime | str | None = None,
              min_tokens: int | None = None, max_tokens: int | None = None,
              min_cost: float | None = None, max_cost: float | None = None,
              text: str | None = None, limit: int = 500) -> list[dict[str, Any]]:
    """The runs of the index, newest first, narrowed by every filter given.

    ``status``, ``model`` and ``tool`` take one value or several (any of them); ``since``
    and ``until`` bound the start time (a date includes its whole day; times are UTC);
    token and cost bounds are inclusive; ``text`` finds runs with a step whose messages,
    thinking, tool inputs or results contain it, case-insensitively. Rows have ``name``
    (the run id, or the file name of an unreadable file), ``file`` (the cassette's file
    name: two copies of a run share an id, never a file), ``labels`` as ``k=v, ...``
    text, a ``status`` of ``running`` or ``crashed`` for a run without an end line when
    its writer says so (:func:`writer_state`), and :data:`RUN_COLUMNS`.
    """
    where: list[str] = []
    args: list[Any] = []
    if statuses := _many(status):
        where.append("r.status IN (SELECT unnest(?::VARCHAR[]))")
        args.append(statuses)
    if models := _many(model):
        where.append("len(list_intersect(string_split(coalesce(r.models, ''), ','), "
                     "?::VARCHAR[])) > 0")
        args.append(models)
    if tools := _many(tool):
        where.append("EXISTS (SELECT 1 FROM steps s WHERE s.path = r.path AND s.kind = 'tool' "
                     "AND s.name IN (SELECT unnest(?::VARCHAR[])))")
        args.append(tools)
    started = "TRY_CAST(rtrim(r.created, 'Z') AS TIMESTAMP)"
    if (lo := _when(since)) is not None:
        where.append(f"{started} >= ?")
        args.append(lo[0])
    if (hi := _when(until)) is not None:  # a date: up to the end of that day
        where.append(f"{started} {'<' if hi[1] else '<='} ?")
        args.append(hi[0] + timedelta(days=1) if hi[1] else hi[0])
    tokens = "(coalesce(r.input_tokens, 0) + coalesce(r.output_tokens, 0))"
    for bound, op, expr in ((min_tokens, ">=", tokens), (max_tokens, "<=", tokens),
                            (min_cost, ">=", "coalesce(r.cost_usd, 0)"),
                            (max_cost, "<=", "coalesce(r.cost_usd, 0)")):
        if bound is not None:
            where.append(f"r.status != 'error' AND {expr} {op} ?")
            args.append(bound)
    if text:
        where.append("EXISTS (SELECT 1 FROM steps s WHERE s.path = r.path "
                     "AND contains(lower(s.text), lower(?)))")
        args.append(text)
    sql = _RUN_SELECT + (" WHERE " + " AND ".join(where) if where else "")
    sql += " ORDER BY r.created DESC NULLS LAST, r.path LIMIT ?"
    args.append(int(limit))
    rows = [_named(row) for row in _rows(index.con.execute(sql, args))]
    for row in rows:
        row["labels"] = labels_text(row.get("labels"))
    return rows


def filter_options(index: RunIndex) -> dict[str, list[str]]:
    """The values the run filters can take: statuses, models and tool names."""
    con = index.con
    statuses = [r[0] for r in con.execute(
        "SELECT DISTINCT status FROM runs WHERE status IS NOT NULL ORDER BY 1").fetchall()]
    models = [r[0] for r in con.execute(
        "SELECT DISTINCT unnest(string_split(models, ',')) AS m FROM runs "
        "WHERE coalesce(models, '') != '' ORDER BY 1").fetchall()]
    tools = [r[0] for r in con.execute(
        "SELECT DISTINCT name FROM steps WHERE kind = 'tool' ORDER BY 1").fetchall()]
    return {"status": statuses, "model": models, "tool": tools}


def _find(index: RunIndex, run: str) -> dict[str, Any] | None:
    """The run row named ``run``: a run id, a cassette path or a file name."""
    rows = _rows(index.con.execute(
        _RUN_SELECT + " WHERE r.run = ? OR r.path = ? OR ends_with(r.path, ?) "
        "ORDER BY r.run = ? DESC, r.created DESC NULLS LAST, r.path",
        [run, run, run, run]))
    for row in rows:
        if row["run"] == run or row["path"] == run or Path(row["path"]).name == run:
            return _named(row)
    return None


def run_path(index: RunIndex, run: str) -> Path | None:
    row = _find(index, run)
    return Path(row["path"]) if row else None


def run_header(index: RunIndex, run: str) -> dict[str, Any] | None:
    """The run's facts and totals (steps, calls, tokens, cost), as
    :func:`recorder.cassette.rows.run_summary` counts them when the file is indexed."""
    row = _find(index, run)
    if row is None:
        return None
    for name in ("steps", "model_calls", "tool_calls", "errors", "input_tokens",
                 "output_tokens", "tokens"):
        row[name] = row.get(name) or 0
    row["cost"] = round(row.get("cost") or 0.0, 8)
    row["labels"] = json.loads(row["labels"]) if row.get("labels") else {}
    row["models"] = [m for m in (row.get("models") or "").split(",") if m]
    return row


TIMELINE_COLUMNS = ("seq", "kind", "name", "status", "start_ms", "latency_ms", "tokens", "cost",
                    "mark", "error")

# One row per step, marks included, from the index's columns: no payload is parsed. A long
# run's first screen asks for its first rows alone (``LIMIT``).
_TIMELINE_SELECT = """
SELECT seq, kind, name, status, input_tokens, output_tokens,
       CASE WHEN input_tokens IS NULL AND output_tokens IS NULL THEN NULL
            ELSE CAST(coalesce(input_tokens, 0) + coalesce(output_tokens, 0) AS BIGINT)
       END AS tokens,
       cost_usd AS cost, ms AS latency_ms, error, coalesce(edited, false) AS edited, within,
       concat_ws(' ',
                 CASE WHEN kind = 'control' THEN '⚑ ' || coalesce(name, 'None') END,
                 CASE WHEN edited THEN '✎ edited' END,
                 CASE WHEN coalesce(within, '') != '' THEN '↳ in ' || within END,
                 CASE WHEN coalesce(error, '') != '' THEN '✗ error' END) AS mark,
       t
FROM steps WHERE path = ? ORDER BY seq LIMIT ?
"""

# The earliest start among the steps after the first ``n`` that belong to the same part of
# the run as the ``n``-th (up to the next control line that starts a part): a part's steps
# are drawn from its earliest start, and a tool step starts before the steps made in its
# body, which are written before it.
_PART_REST_START = """
SELECT min(t) FROM steps WHERE path = ? AND seq > ? AND seq < coalesce(
    (SELECT min(seq) FROM steps WHERE path = ? AND seq > ? AND kind = 'control'
     AND name IN (SELECT unnest(?::VARCHAR[]))), 2147483647)
"""


def _timeline(index: RunIndex, run: str, first: int | None = None) -> dict[str, list[Any]]:
    """The timeline of ``run`` by column (see :func:`run_steps`), or of its ``first``
    steps; empty lists when there is no such run."""
    path = run_path(index, run)
    limit = first if first is not None else 2**62
    cur = index.con.execute(_TIMELINE_SELECT, [str(path) if path is not None else None, limit])
    names = [d[0] for d in cur.description]
    rows = cur.fetchall() if path is not None else []
    columns: dict[str, list[Any]] = {name: [] for name in names}
    if rows:
        columns = {name: list(values)
                   for name, values in zip(names, zip(*rows, strict=True), strict=True)}
    rest = None
    if first is not None and len(rows) == first and rows:
        last = columns["seq"][-1]
        found = index.con.execute(_PART_REST_START, [str(path), last, str(path), last,
                                                     sorted(_NEW_PART)]).fetchone()
        rest = found[0] if found else None
    columns["start_ms"] = _part_times(columns.pop("t"), columns["kind"], columns["name"],
                                      columns["latency_ms"], rest)
    return columns


# Control lines after which a run's steps were made at another time: a fork's live part
# (its prefix was copied from the parent, recorded earlier), a resume's.
_NEW_PART = frozenset({Control.FORK_EDIT, Control.RESUMED})


def _part_times(starts: list[Any], kinds: list[Any], names: list[Any],
                latencies: list[Any], rest: float | None = None) -> list[float | None]:
    """Each step's start in ms since the run began, each part of the run (a fork's copied
    prefix and its live part, the parts of a resumed run) drawn from where the part before
    it ended: the hours between recording and forking are not the run's time. ``rest``:
    for the first steps of a run, the earliest start of the steps of the last part that
    are not among them."""
    parts: list[list[int]] = [[]]
    for i, (kind, name) in enumerate(zip(kinds, names, strict=True)):
        if kind == Kind.CONTROL and name in _NEW_PART and parts[-1]:
            parts.append([])
        parts[-1].append(i)
    out: list[float | None] = [None] * len(starts)
    base = 0.0  # ms at which the current part starts on the drawn axis
    for part in parts:
        timed = [starts[i] for i in part if starts[i] is not None]
        if part is parts[-1] and rest is not None:
            timed.append(rest)
        if not timed:
            continue
        origin, end = min(timed), base
        for i in part:
            if starts[i] is not None:
                start = round(base + (starts[i] - origin) * 1000, 3)
                out[i] = start
                end = max(end, start + (latencies[i] or 0.0))
        base = end
    return out


def run_steps(index: RunIndex, run: str) -> list[dict[str, Any]]:
    """The timeline of a run: one row per step, without payloads.

    ``mark`` flags what deserves a look: control lines (budget, cancel, loop, fork edit),
    an edited step, and steps made inside a tool's body.
    """
    columns = _timeline(index, run)
    names = list(columns)
    return [dict(zip(names, row, strict=True))
            for row in zip(*columns.values(), strict=True)]


def timeline(index: RunIndex, run: str, first: int | None = None) -> dict[str, list[Any]]:
    """What a run's page shows of its steps before one is opened: the timeline table's
    columns (:data:`TIMELINE_COLUMNS`, as :func:`run_steps` has them); ``first``: of its
    first so many steps alone (a long run's first screen: the index is asked for those
    rows, and each start time is the one the whole timeline gives it)."""
    columns = _timeline(index, run, first)
    return {c: columns[c] for c in TIMELINE_COLUMNS}


def step_labels(columns: dict[str, list[Any]]) -> dict[int, str]:
    """Each step's label in the step picker (``seq · kind · name mark``), from the
    timeline's columns."""
    return {seq: f"{seq} · {kind} · {name} {mark}" for seq, kind, name, mark in
            zip(columns["seq"], columns["kind"], columns["name"], columns["mark"],
                strict=True)}


def usage_over_time(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cumulative tokens and cost over the run's time: a point at its start (0, 0, 0),
    then one where each step that used tokens or cost ended (``time_s`` since the run's
    first step began). Two points for a one-call run, so it draws as a line."""
    timed = sorted((s for s in steps if s.get("start_ms") is not None),
                   key=lambda s: s["start_ms"] + (s.get("latency_ms") or 0))
    points = [{"time_s": 0.0, "seq": None, "tokens": 0, "cost": 0.0}]
    tokens, cost = 0, 0.0
    for step in timed:
        if step.get("tokens") is None and step.get("cost") is None:
            continue
        tokens += step.get("tokens") or 0
        cost += step.get("cost") or 0.0
        end = (step["start_ms"] + (step.get("latency_ms") or 0)) / 1000
        points.append({"time_s": round(end, 6), "seq": step["seq"], "tokens": tokens,
                       "cost": round(cost, 8)})
    return points if len(points) > 1 else []


def waterfall(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step's start offset and duration (ms since the run's first step began), as a
    trace viewer draws a trajectory: one bar per step, in order."""
    return [{"seq": s["seq"], "step": f"{s['seq']} · {s['kind']} · {s['name']}",
             "kind": s["kind"], "start_ms": s["start_ms"],
             "end_ms": s["start_ms"] + (s.get("latency_ms") or 0.0),
             "duration_ms": s.get("latency_ms") or 0.0}
            for s in steps if s.get("start_ms") is not None]


# ---------------------------------------------------------------------- diff and lineage


def diff(source: RunIndex | None, a: str | Path, b: str | Path, *more: str | Path) -> DiffView:
    """Compare runs ``a``, ``b`` and any ``more`` with ``a``, aligned by what their steps
    mean (:func:`viewer.diffs.diff_view`): a :class:`~pathlib.Path` is a cassette file; a
    string is a run id or file name of the index ``source`` (never a path: it may come
    from a URL), or a path when there is no index."""
    paths = []
    for run in (a, b, *more):
        if isinstance(run, Path) or source is None:
            path: Path | None = Path(run)
        else:
            path = run_path(source, run)
        if path is None or not path.exists():
            raise NoSuchRun(f"no run {run!r}" + (f" in {source.directory}" if source else ""))
        paths.append(path)
    return diff_view(paths)


def lineage(index: RunIndex, run: str) -> dict[str, Any] | None:
    """Where a run comes from (its parent run and fork step) and the runs forked from it."""
    row = _find(index, run)
    if row is None:
        return None
    parent = None
    if row.get("parent"):
        found = _find(index, row["parent"])
        parent = {"run": row["parent"], "step": row.get("parent_step"),
                  "path": found["path"] if found else None,
                  "status": found["status"] if found else None, "indexed": found is not None}
    children = []
    if row.get("run"):
        children = [_named(r) for r in _rows(index.con.execute(
            "SELECT run, path, status, parent_step AS step, created AS started FROM runs "
            "WHERE parent_run = ? ORDER BY created, path", [row["run"]]))]
    return {"run": row.get("run"), "name": row["name"], "parent": parent,
            "children": children}


# ---------------------------------------------------------------------- live runs


def _alive(record: dict[str, Any]) -> bool | None:
    """Is the recording process still there? None when it runs on another host."""
    pid = record.get("pid")
    if not isinstance(pid, int) or record.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live(run: str | None) -> dict[str, Any]:
    """The run's progress record, whether it is still running, and any cancel request."""
    record = read_status(run) if run else None
    if record is None:
        return {"record": None, "running": False, "ended": False, "alive": None,
                "cancel": None}
    ended = bool(record.get("ended")) or record.get("status") != "running"
    alive = None if ended else _alive(record)
    return {"record": record, "running": not ended and alive is not False, "ended": ended,
            "alive": alive, "cancel": cancel_requested(str(run))}


def cancel(run: str, reason: str = "cancelled from the viewer") -> Path:
    """Ask a running run to stop at its next boundary (as ``deja cancel``)."""
    record = read_status(run)
    if record is None:
        raise NoSuchRun(f"no run {run!r} under $DEJA_HOME/runs")
    if record.get("ended"):
        raise UsageError(f"run {run} already ended with status {record.get('status')!r}")
    return request_cancel(run, reason)
