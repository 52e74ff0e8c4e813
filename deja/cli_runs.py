"""``deja status`` and ``deja cancel``: what a run is doing, and asking it to stop. A run
is named by its id or by its cassette, whose run id is used only once it verifies.

A run of this machine is read from its status record (``$DEJA_HOME/runs``). A run id
without one here (a run submitted to ``deja serve`` that no worker of this machine has
started), or whose record was left by a process that is gone (a worker's run waiting for
an answer, or taken over elsewhere), is asked of ``deja serve`` (``DEJA_SERVER``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from deja._common import (
    BadInput,
    _allow_unverified_option,
    _fail,
    _load,
    _pid_gone,
    _warn_unverified,
)


def _run_of(target: str, allow_unverified: bool = False) -> tuple[str, Any]:
    """The run a RUN-or-CASSETTE argument names, and the cassette (loaded and checked)
    when one was given: a run id is taken from a header only once its signature holds."""
    path = Path(target)
    if path.suffix == ".jsonl" or os.sep in target or path.is_file():
        cassette = _load(path, allow_torn=True, allow_incomplete=True,
                         allow_unverified=allow_unverified)
        return cassette.run, cassette
    return target, None


def _status_from_cassette(c: Any) -> dict[str, Any]:
    """What a cassette says about its run when there is no status record (another
    machine's run, or another DEJA_HOME): its end line, or who is still writing it."""
    from recorder.cassette import lock
    from recorder.cassette.rows import run_totals
    from recorder.cassette.schema import run_status

    counted = run_totals(c)["all"]
    holder = lock.holder_of(c.path)
    status = run_status(c.end, None if c.end else ("running" if holder else "crashed"))
    record = {"run_id": c.run, "status": status, "source": "cassette",
              "artefacts": [str(c.path)], "steps": counted.get("steps"),
              "tokens": (counted.get("input_tokens") or 0) + (counted.get("output_tokens") or 0),
              "spend_usd": counted.get("cost_usd"), "verified": c.verified}
    if not c.verified:
        record["verify_note"] = c.verify_note
    if c.end:
        record.update(ended=True, totals=c.end.get("totals"))
    if holder:
        record["pid"] = holder.get("pid")
    return record


@click.command()
@click.argument("run", metavar="RUN|CASSETTE")
@click.option("--json", "as_json", is_flag=True, help="Print the status record as JSON.")
@click.option("--wait", is_flag=True,
              help="A submitted run: wait until it ends or waits for an answer, then show it.")
@click.option("--timeout", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="With --wait: give up after this long (exit status 1).")
@_allow_unverified_option
def status(run: str, as_json: bool, wait: bool, timeout: float | None,
           allow_unverified: bool) -> None:
    """Show what a run is doing: status, turn, step, elapsed, budgets, tokens, spend.

    Give the run id or its cassette. Reads the run's status record ($DEJA_HOME/runs/RUN.json),
    which the recorder updates at every step; for a finished run it shows the end status
    and totals. A run whose process is gone without closing it shows as crashed. Without a
    status record (a cassette from elsewhere), the cassette itself says how the run ended.
    """
    from recorder.harness.progress import read_status

    if wait:
        _wait_served(run, as_json, timeout)
        return
    run, cassette = _run_of(run, allow_unverified)
    if cassette is not None:
        _warn_unverified(cassette)
    record = read_status(run)
    if record is None and cassette is not None:
        record = _status_from_cassette(cassette)
    if cassette is None and (record is None or _left_behind(record)):
        served, why = _from_server("GET", run, have_local=record is not None)
        if served is not None:
            _print_served(served, as_json)
            return
        if record is None:
            raise BadInput(f"no status for run {run!r} (runs record theirs under "
                           "$DEJA_HOME/runs; is DEJA_HOME the same as the recording's? Give "
                           f"the cassette instead: deja status CASSETTE){why}")
    assert record is not None
    closed = record.get("source") != "cassette" and _end_line_first(record)
    gone = not closed and _process_gone(record)
    if gone:  # the record is stale: say what happened, keep what it last said
        record.update(status="crashed", last_recorded_status=record["status"],
                      process_alive=False)
    if as_json:
        click.echo(json.dumps(record, indent=2))
        return

    def limit(value: Any, cap: Any, unit: str = "") -> str:
        return f"{value}{unit}" + (f" / {cap}{unit}" if cap is not None else "")

    artefact = next(iter(record.get("artefacts") or []), "CASSETTE")
    if record.get("source") == "cassette":
        lines = [f"run {record['run_id']}: {record['status']} (from the cassette; no status "
                 "record here)" + ("" if record["verified"] else "; NOT VERIFIED"),
                 f"  steps:    {record.get('steps')}",
                 f"  tokens:   {record.get('tokens')}",
                 f"  spend:    {record.get('spend_usd')} USD",
                 f"  artefacts: {artefact}"]
        if record["status"] == "crashed":
            lines.append(f"  resume:   deja resume {artefact}")
        click.echo("\n".join(lines))
        return
    lines = [f"run {record['run_id']}: {record['status']}",
             f"  step:     {record.get('step')}",
             f"  turn:     {limit(record.get('turn'), record.get('turn_limit'))}",
             f"  elapsed:  {limit(record.get('elapsed_s'), record.get('budget_s'), 's')}",
             f"  tokens:   {limit(record.get('tokens'), record.get('token_limit'))}",
             f"  spend:    {limit(record.get('spend_usd'), record.get('dollar_limit'), ' USD')}",
             f"  artefacts: {', '.join(record.get('artefacts') or []) or '-'}",
             f"  updated:  {record.get('updated')} (pid {record.get('pid')})"]
    if gone:
        lines[0] += (f": its process (pid {record.get('pid')}) is gone without closing the "
                     f"run, last seen {record['last_recorded_status']}. Resume it with: "
                     f"deja resume {artefact}")
    elif record.get("status") in LIVE:
        lines.append(f"  cancel:   {record.get('cancel')}")
    click.echo("\n".join(lines))


def _end_line_first(record: dict[str, Any]) -> bool:
    """A run's status from its cassette's end line first, then its record
    (:func:`recorder.cassette.schema.run_status`): the record is the program's own
    account, written before ``deja record`` learns its exit status (a program that exits
    1 after its last step ended ``error``, shown ``failed``), and a run resumed since
    has a newer end line. True when the end line decided."""
    from recorder.cassette.schema import run_status
    from recorder.harness.progress import cassette_end

    cassette = next(iter(record.get("artefacts") or []), None)
    if not isinstance(cassette, str):
        return False
    state, end = cassette_end(cassette)
    if state != "ended" or end is None or (record.get("status") in LIVE and
                                           not _process_gone(record)):
        return False  # not closed, or a resume is writing it again right now
    status = run_status(end)
    if status != record.get("status"):
        record["last_recorded_status"] = record.get("status")
        record.update(status=status, step=f"ended: {status}")
    record["ended"] = True
    return True


def _left_behind(record: dict[str, Any]) -> bool:
    """A record of this host that does not say the run ended, whose process is gone."""
    import socket

    return not record.get("ended") and record.get("host") == socket.gethostname() and \
        _pid_gone(record.get("pid"))


def _from_server(method: str, run: str, *,
                 have_local: bool = False) -> tuple[dict[str, Any] | None, str]:
    """What ``deja serve`` says of ``run`` (``POST``: cancels it), or None and why not
    (to add to the message of a run not found here).

    With ``have_local`` (this machine holds a record of the run, left behind by a process
    that is gone), the server is only asked in case it ran the run; a server that
    refuses the question (another DEJA_HOME's, whose token this one lacks) is said on
    stderr and the local record is used."""
    from deja.cli_serve import ServerSaid, _api, _said
    from deja.runs.errors import ServerUnreachable
    from recorder.harness.progress import valid_run_id

    if not valid_run_id(run):
        return None, ""
    path = f"/runs/{run}" + ("/cancel" if method == "POST" else "")
    try:
        return _api(method, path, {} if method == "POST" else None), ""
    except ServerUnreachable as exc:
        return None, f"; not asked of deja serve either: {exc}"
    except ServerSaid as exc:
        from deja.runs.config import server_url

        if exc.type == "NoSuchRun":
            return None, f"; nor does deja serve at {server_url()} hold it (NoSuchRun)"
        if have_local:
            click.echo(f"deja: deja serve at {server_url()} refused to say whether it ran "
                       f"{run} ({exc.type}); this is this machine's record of it", err=True)
            return None, ""
        _said(exc)


SETTLED = ("input_required", "completed", "failed", "cancelled", "exhausted", "stopped",
           "interrupted", "needs_attention")


def _wait_served(run: str, as_json: bool, timeout: float | None) -> None:
    """Poll deja serve until ``run`` ends or waits for an answer; print it then."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        served, why = _from_server("GET", run)
        if served is None:
            raise BadInput(f"no submitted run {run!r}{why}")
        if served.get("status") in SETTLED:
            _print_served(served, as_json)
            return
        if deadline is not None and time.monotonic() >= deadline:
            _print_served(served, as_json)
            click.echo(f"deja: run {run} is still {served.get('status')} after {timeout:g} s",
                       err=True)
            sys.exit(1)
        time.sleep(0.2)


def _print_served(record: dict[str, Any], as_json: bool) -> None:
    """A run's record as deja serve tells it."""
    if as_json:
        click.echo(json.dumps(record, indent=2))
        return

    def limit(value: Any, cap: Any = None, unit: str = "") -> str:
        if value is None:
            return "-"  # not started yet
        return f"{value}{unit}" + (f" / {cap}{unit}" if cap is not None else "")

    artefacts = ", ".join(f"{a.get('path')} (sha256 {str(a.get('sha256'))[:12]})"
                          for a in record.get("artefacts") or []) or "-"
    lines = [f"run {record['run_id']}: {record['status']} (deja serve"
             + (f"; worker {record['worker']}" if record.get("worker") else "") + ")",
             f"  command:  {' '.join(record.get('command') or [])}",
             f"  step:     {limit(record.get('step'))}",
             f"  turn:     {limit(record.get('turn'), record.get('turn_limit'))}",
             f"  elapsed:  {limit(record.get('elapsed_s'), record.get('budget_s'), 's')}",
             f"  tokens:   {limit(record.get('tokens'), record.get('token_limit'))}",
             f"  spend:    {limit(record.get('spend_usd'), record.get('dollar_limit'), ' USD')}",
             f"  artefacts: {artefacts}",
             f"  cassette: {record.get('cassette')}",
             f"  submitted: {record.get('submitted')}, updated {record.get('updated')}"]
    if record.get("question") is not None:
        lines += [f"  question: {record['question']}", f"  answer:   {record.get('answer')}"]
    if record.get("error"):
        lines.append(f"  error:    {record['error']}")
    if not record.get("ended"):
        lines.append(f"  cancel:   {record.get('cancel')}")
    click.echo("\n".join(lines))


LIVE = ("running", "input_required")  # what a run's own record says while it runs


def _process_gone(record: dict[str, Any]) -> bool:
    """A record that says running (or waiting for an answer), written on this host by a
    process that no longer is."""
    import socket

    if record.get("ended") or record.get("status") not in LIVE or \
            record.get("host") != socket.gethostname():
        return False
    return _pid_gone(record.get("pid"))


@click.command()
@click.argument("run", metavar="RUN|CASSETTE")
@click.option("--reason", default="", help="Why; recorded in the run's control line.")
def cancel(run: str, reason: str) -> None:
    """Ask a run (its id or its cassette) to stop at its next boundary, status cancelled.

    Sets a flag that the recorder reads before each call and after each write; the run
    never stops mid-action. Any process with the same DEJA_HOME can cancel.
    """
    from recorder.errors import ConfigError
    from recorder.harness.progress import read_status, request_cancel

    run, given = _run_of(run)  # a cassette names the run it cancels only if it verifies
    record = read_status(run)
    if given is None and (record is None or _left_behind(record)):
        served, why = _from_server("POST", run, have_local=record is not None)
        if served is not None:
            _cancelled_served(run, served)
            return
        if record is None:
            raise BadInput(f"no run {run!r} under $DEJA_HOME/runs{why}")
    if record is None:
        raise BadInput(f"no run {run!r} under $DEJA_HOME/runs")
    if given is not None and Path(given.path).resolve() not in {
            Path(a).resolve() for a in record.get("artefacts") or ()}:
        raise BadInput(f"run {run} is not writing {given.path} (its record names "
                       f"{', '.join(record.get('artefacts') or []) or 'no cassette'}); "
                       f"give the run id: deja cancel {run}")
    if _process_gone(record):
        raise BadInput(f"run {run} is not running: its process (pid {record.get('pid')}) is "
                       "gone (it crashed); there is nothing to cancel")
    if record.get("ended"):
        raise BadInput(f"run {run} already ended with status {record.get('status')!r}")
    try:
        path = request_cancel(run, reason)
    except ConfigError as exc:  # the flag cannot be written: say so, no traceback
        _fail(exc)
    click.echo(f"deja: cancel requested for run {run} ({path}); it stops at its next "
               "boundary")


def _cancelled_served(run: str, answer: dict[str, Any]) -> None:
    if answer.get("note"):  # it had ended: nothing to cancel
        raise BadInput(f"run {run} already ended with status {answer.get('status')!r}")
    if answer.get("status") == "cancelling":
        click.echo(f"deja: cancel requested for run {run} (it was {answer.get('was')}); it "
                   "stops at its next boundary")
    else:
        was = answer.get("was")
        click.echo(f"deja: run {run} cancelled (it was {was}; it never "
                   f"{'starts' if was == 'queued' else 'resumes'})")
