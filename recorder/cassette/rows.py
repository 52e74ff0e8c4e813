"""A cassette as rows: one flat row per step and one summary per run.

This module is the one definition of what a run counts. ``deja show``, ``deja ls`` and
the viewer (through the DuckDB index), ``deja verify``, ``deja diff`` and a replay's
report all count with it, so a run has the same number of steps, calls, tokens and
dollars everywhere:

- A **step** is one observation line: every line after the header that has a ``seq``,
  except the end line. A run of ``n`` steps has seqs ``0 .. n-1``; its end line (seq
  ``n``) closes the run and is not a step. Control lines (a harness decision, a fork's
  ``fork_edit``, a ``resumed`` marker) and lines made inside a tool's body are steps.
- **Totals** are summed from the steps, never taken from the end line (a crashed run has
  none), by the rule a live run's end line counts with too
  (:func:`recorder.cassette.schema.add_step`): ``model_calls`` (``model`` lines),
  ``http_calls``, ``tool_calls`` (``tool`` and ``outcome`` lines), ``effects``,
  ``input_tokens``/``output_tokens`` (their usage), ``cost_usd`` and ``errors`` (steps
  with an error: :func:`recorder.cassette.schema.error_of`).
- A fork or a resumed run is split at :func:`live_from`, the first step the run made
  itself: before it, steps **replayed** (copied from the parent up to the edited step, or
  recorded by earlier attempts before the last ``resumed`` line); from it on, **live**.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from recorder.cassette import Cassette
from recorder.cassette.lines import Lines
from recorder.cassette.reader import peek_header
from recorder.cassette.schema import (
    Control,
    Kind,
    StepTotals,
    add_step,
    error_of,
    step_totals,
    totals_of,
    zero_totals,
)
from recorder.cassette.schema import run_status as schema_run_status

__all__ = [
    "STEP_COLUMNS",
    "children_of",
    "describe_split",
    "describe_totals",
    "live_from",
    "run_status",
    "run_summary",
    "run_totals",
    "step_count",
    "step_error",
    "step_name",
    "step_row",
    "step_rows",
    "step_status",
    "totals_of",
]

STEP_COLUMNS = ("seq", "kind", "name", "status", "input_tokens", "output_tokens", "cost_usd",
                "ms", "error")


def step_name(obs: Mapping[str, Any]) -> str:
    kind = obs.get("kind")
    if kind == Kind.MODEL:
        return str(obs.get("model") or obs.get("provider") or "model")
    if kind == Kind.HTTP:
        parts = urlsplit(obs.get("url", ""))
        return f"{obs.get('method', '')} {parts.netloc}{parts.path}"
    if kind in (Kind.TOOL, Kind.EFFECT, Kind.INTENT, Kind.OUTCOME):
        return str(obs.get("name", ""))
    if kind == Kind.MCP:  # the server's name and the method: "ledger tools/list"
        part = obs.get("mcp") or {}
        return f"{(part.get('server') or {}).get('name') or '?'} {part.get('method', '')}"
    if kind == Kind.CONTROL:
        return str(obs.get("event", ""))
    return ""


def step_status(obs: Mapping[str, Any]) -> str:
    kind = obs.get("kind")
    if kind in (Kind.MODEL, Kind.HTTP):
        if "response" in obs:
            status = str(obs["response"].get("status"))
            if obs.get("api_error") and obs["response"].get("status") == 200:
                status += " stream-error"
            return status
        return "failed"
    if kind in (Kind.TOOL, Kind.OUTCOME, Kind.MCP):
        return "error" if "error" in obs else "ok"
    if kind == Kind.END:
        return str(obs.get("status", ""))
    return "ok"


def step_error(obs: Mapping[str, Any]) -> str | None:
    """The error column: the step's :func:`~recorder.cassette.schema.error_of`, if any."""
    err = error_of(obs)
    if not err:
        return None
    return f"{err.get('type')}: {err.get('message')}"


def step_row(obs: Mapping[str, Any]) -> dict[str, Any]:
    usage = obs.get("usage") or {}
    return {
        "seq": obs["seq"], "kind": obs["kind"], "name": step_name(obs),
        "status": step_status(obs),
        "input_tokens": usage.get("input_tokens"), "output_tokens": usage.get("output_tokens"),
        "cost_usd": obs.get("cost_usd"), "ms": obs.get("ms"), "error": step_error(obs),
    }


def step_rows(cassette: Cassette) -> list[dict[str, Any]]:
    return [step_row(obs) for obs in cassette.observations]


def step_count(cassette: Cassette) -> int:
    """The number of steps: observation lines, the end line excepted (see the module)."""
    return len(cassette.observations)


def live_from(cassette: Cassette) -> int:
    """The seq of the first step this run made itself (0 for a run recorded from scratch).

    A fork's steps up to the edited one and its ``fork_edit`` line come from the parent;
    a replay-then-live's steps before the one it left its parent at (``parent.mode``
    ``then_live``) were served from the parent; a resumed run's steps before its last
    ``resumed`` line were recorded by earlier attempts and replayed by the last one.
    """
    start = 0
    parent = cassette.header.get("parent")
    if isinstance(parent, dict) and isinstance(parent.get("step"), int):
        start = parent["step"] + (0 if parent.get("mode") == "then_live" else 1)
    steps = cassette.observations
    # a loaded cassette's heads say each line's kind and event, without restoring it
    found = steps.kinds() if isinstance(steps, Lines) \
        else ((o["seq"], o.get("kind"), o.get("event")) for o in steps)
    for seq, kind, event in found:
        if kind != Kind.CONTROL:
            continue
        if event == Control.FORK_EDIT:
            start = max(start, seq + 1)
        elif event == Control.RESUMED:
            start = max(start, seq)
    return start


def run_totals(cassette: Cassette) -> dict[str, Any]:
    """The run's totals: ``all`` (:func:`~recorder.cassette.schema.totals_of` every step)
    and, for a fork or a resumed run, ``replayed`` and ``live`` split at ``live_from``,
    with ``replayed_from`` saying where the replayed part came from. For any other run
    those three are None. The steps are read once, a model line without its request
    (:meth:`~recorder.cassette.lines.Lines.counted`)."""
    start = live_from(cassette)
    steps = cassette.observations
    tallies = [zero_totals() for _ in range(3)]  # all, replayed, live
    counts = [0, 0, 0]
    for obs in steps.counted() if isinstance(steps, Lines) else steps:
        for i in ((0, 2 if obs["seq"] >= start else 1) if start else (0,)):
            counts[i] += 1
            add_step(tallies[i], obs)
    whole, replayed, live = (step_totals(t, n) for t, n in zip(tallies, counts, strict=True))
    out: dict[str, Any] = {"all": whole, "live_from": start, "replayed_from": None,
                           "replayed": None, "live": None}
    if start:
        parent = cassette.header.get("parent")
        out.update(
            replayed_from=(f"parent {parent.get('run')}" if isinstance(parent, dict)
                           and parent.get("run") else "earlier attempts"),
            replayed=replayed, live=live)
    return out


def describe_totals(t: Mapping[str, Any] | StepTotals) -> str:
    """``5 model calls, 4 tool calls, 2873 in / 310 out tokens, $0.012345`` (one line)."""
    def calls(n: int, what: str) -> str:
        return f"{n} {what} call" + ("" if n == 1 else "s")

    parts = [calls(t["model_calls"], "model"), calls(t["tool_calls"], "tool")]
    if t.get("http_calls"):
        parts.append(calls(t["http_calls"], "HTTP"))
    parts.append(f"{t['input_tokens']} in / {t['output_tokens']} out tokens")
    return ", ".join(parts) + f", ${t['cost_usd']:.6f}"


def describe_split(totals: dict[str, Any]) -> list[str]:
    """Two lines telling the replayed part of a fork or a resumed run from its live part
    (none for another run); ``totals`` is what :func:`run_totals` returns."""
    if not totals.get("replayed"):
        return []
    start, steps = totals["live_from"], totals["all"]["steps"]
    live = f"steps {start}-{steps - 1}" if steps > start else "no steps yet"
    return [f"replayed from {totals['replayed_from']} (steps 0-{start - 1}): "
            f"{describe_totals(totals['replayed'])}",
            f"live ({live}): {describe_totals(totals['live'])}"]


def run_status(cassette: Cassette) -> str:
    """The run's status from its file (:func:`~recorder.cassette.schema.run_status`): the
    end line's (``error`` shown as ``failed``); without one, ``torn`` or ``incomplete``."""
    if cassette.end is not None:
        return schema_run_status(cassette.end)
    return "torn" if cassette.torn_offset is not None else "incomplete"


def run_summary(cassette: Cassette, rows: Iterable[Mapping[str, Any]] | None = None,
                totals: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run-level facts. The counts are :func:`~recorder.cassette.schema.totals_of` the steps
    (the end line of a run gives only its status and duration); a fork or resumed run
    adds ``replayed`` and ``live`` totals split at ``live_from``.

    Its ``models`` are named by its model lines' requests, which only a line restored
    whole gives: a caller that made the :func:`step_row` of every step already passes
    those ``rows``, and no line is restored whole a second time; one that has the run's
    :func:`run_totals` already passes them as ``totals``.
    """
    header, end = cassette.header, cassette.end
    totals = run_totals(cassette) if totals is None else totals
    recorded = end.get("totals") if end is not None else None  # only its duration is read
    parent: Mapping[str, Any] = header.get("parent") or {}
    named = ((row["name"] for row in rows if row["kind"] == Kind.MODEL) if rows is not None
             else (step_name(o) for o in cassette.observations if o["kind"] == Kind.MODEL))
    models = sorted(set(named))
    return {
        "run": header.get("run"), "path": str(cassette.path), "created": header.get("created"),
        "status": run_status(cassette),
        "parent_run": parent.get("run"), "parent_step": parent.get("step"),
        "duration_s": recorded.get("duration_s") if recorded else None,
        "models": models, "labels": header.get("labels") or {},
        "verified": cassette.verified, "verify_note": cassette.verify_note,
        **totals["all"], "live_from": totals["live_from"],
        "replayed_from": totals["replayed_from"], "replayed": totals["replayed"],
        "live": totals["live"],
    }


def children_of(run: str, directory: str | Path) -> list[dict[str, Any]]:
    """Runs in ``directory`` forked from ``run``: reads only each cassette's header line."""
    out = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        header = peek_header(path)
        if header is None:
            continue
        parent = header.get("parent")
        if isinstance(parent, dict) and parent.get("run") == run:
            out.append({"run": header.get("run"), "step": parent.get("step"),
                        "path": str(path)})
    return out
