"""``deja suite DIR [--then live|stub SCRIPT] [-- CMD ...]``: test a change against every
recorded incident of a folder, with a verdict each (:mod:`replayer.suite`).

Each cassette of DIR (its ``*.jsonl``, sorted) is one job, ``deja suite --one CASSETTE
...`` (the options of the suite, the same command), which prints the incident's record as
one line of JSON: a plain replay (``deja replay``'s :func:`deja.cli_replay.attempt`), or
with ``--then`` a replay-then-live (:func:`deja.cli_replay.run_then_live`) into
``OUTDIR/<cassette name>``. The jobs run on the durable workers when one runs against the
runs database (``--workers`` to insist, ``--inline`` to refuse; ``deja.runs.suites``),
else here, ``-j`` at a time. The table, ``--json``, ``--junit`` and GitHub Actions
annotations come from the records, and so does the summary the suite leaves behind
(:mod:`replayer.suite_summary`, which the viewer reads). ``deja sweep`` runs its forks as
jobs too, and takes the same choice of where (:func:`workers_option`, :func:`runner_for`)
and the same summary (:func:`summary_option`, :func:`write_summary`).

A suite has an id (``--id``; default ``<DIR name>-suite-<UTC time>``), which names its
workflows and its default OUTDIR (``DIR/../<suite id>``): the same id again is the same
suite. Its incidents that already have a verdict on the workers are not run again, and,
with ``--then``, a new cassette an earlier attempt finished is judged again without
running anything, while one it left unfinished (no end line, or ``interrupted``: a worker
died under it) is replaced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from deja import cli_replay
from deja._common import (
    BadInput,
    ReplayCommand,
    _cwd_option,
    _print_table,
    policy_options,
    replay_policy,
    then_options,
    tool_policy,
    tool_policy_options,
)
from recorder.cassette.schema import utc_stamp
from replayer import suite as suites
from replayer import suite_summary
from replayer.ci import Case, junit_of, line_of, workflow_command, write_report

COLUMNS = ["incident", "recorded", "now", "verdict", "live calls", "cost", "new cassette",
           "seconds"]
OUTPUT_LINES = 12  # of an incident's output shown under a verdict that is not a pass
_SUITE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Plan:
    """A suite, ready to run: its id, its incidents (file name -> the path as shown), the
    folder its new cassettes go to (with ``--then``) and the jobs."""

    suite_id: str
    shown: dict[str, str]
    outdir: Path | None
    jobs: list[suites.Job]
    then: bool
    folder: Path
    mode: str
    command: tuple[str, ...]


def workers_option(what: str) -> Callable[[F], F]:
    """``--workers/--inline``: where ``deja suite`` runs its incidents, and ``deja sweep``
    its forks (:func:`runner_for`)."""
    return click.option(
        "--workers/--inline", "on_workers", default=None,
        help=f"Run the {what} on the deja workers of the runs database (each one a durable "
             "workflow), or here. Default: on the workers when one is up.")


def summary_option(where: str) -> Callable[[F], F]:
    """``--summary FILE``: where the summary document goes (:mod:`replayer.suite_summary`)."""
    return click.option(
        "--summary", "summary", type=click.Path(path_type=Path, dir_okay=False),
        metavar="FILE", help=f"Write the summary document (JSON) to FILE (default: "
                             f"{where}/.deja/suites/<id>.json, which deja view shows).")


@click.command("suite", cls=ReplayCommand)
@click.argument("folder", metavar="DIR", type=click.Path(path_type=Path))
@then_options("under OUTDIR, for each incident")
@click.option("-j", "--jobs", "parallel", type=click.IntRange(min=1), metavar="N",
              help="Incidents at a time (default: the number of CPUs; on the workers, "
                   "across all of them).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document (each incident's record and the summary) "
                   "instead of the table.")
@click.option("--junit", type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
              help="Also write a JUnit XML report: a test case per incident (a regression "
                   "fails, an incident that could not be judged is an error).")
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), metavar="OUTDIR",
              help="With --then: the folder of the new cassettes and each incident's log "
                   "(default: DIR/../<suite id>).")
@workers_option("incidents")
@click.option("--cold", is_flag=True,
              help="Start each incident in a fresh interpreter. By default incidents start "
                   "warm: as forks of one process that has imported deja and the SDKs once "
                   "(a program that needs a first import of an SDK, e.g. one that sets what "
                   "the SDK reads as it is imported, needs --cold).")
@click.option("--id", "suite_id", metavar="SUITE",
              help="The suite's id (default: <DIR name>-suite-<UTC time>). The same id again "
                   "is the same suite: what it already judged is not run again.")
@click.option("--allow-incomplete", is_flag=True,
              help="Take incidents without an end line (a crashed run).")
@summary_option("OUTDIR (with --then) or DIR")
@click.option("--one", is_flag=True, hidden=True)
@tool_policy_options
@policy_options
@_cwd_option
def suite(folder: Path, command: tuple[str, ...] | None, then: str | None,
          then_script: Path | None, parallel: int | None, as_json: bool, junit: Path | None,
          output: Path | None, on_workers: bool | None, cold: bool, suite_id: str | None,
          allow_incomplete: bool, summary: Path | None, one: bool, tool_rules: tuple[str, ...],
          live_tools: tuple[str, ...], ignore: tuple[str, ...], normalise: tuple[str, ...],
          cwd: Path | None) -> None:
    """Test a change against every recorded incident: deja suite DIR [-- CMD ...].

    Runs CMD (or each incident's recorded command) against each cassette of DIR (its
    *.jsonl files, sorted) and prints a verdict per incident: identical or equivalent
    (the replay passed), changed at step N (it asked for something else there; with
    --then, where it left the recording and went live), now completes (the recorded run
    failed and the new one completed), now fails (the recorded run completed and the new
    one did not), or not judged; with the live calls and their cost, and the new
    cassette.

    Without --then each incident is a plain replay (nothing live, no new cassette). With
    --then live (or --then stub SCRIPT) the recording is served while the program asks
    what it asked before, and from the first call it does not hold the run goes live,
    under the tool policy (a side-effecting tool never runs unless named with
    --live-tool), into OUTDIR/<cassette name>.

    When a deja worker runs against the runs database, each incident is a durable
    workflow on the suite's queue (-j at a time across the workers): a worker that dies
    loses no verdict, and the suite waits for them all. Otherwise the incidents run here,
    -j at a time.

    Each suite leaves its summary, one JSON document, in OUTDIR/.deja/suites/<id>.json
    (with --then; else in DIR's), or in --summary FILE: deja view shows it on its Suites
    page, each incident a link to its runs.

    Exit 0 when nothing regressed; 1 when an incident now fails, or, without --then, a
    replay diverged; 2 when one could not be judged (or for bad input); 2 wins over 1.
    """
    replay_policy(ignore, normalise)  # a bad pointer or pattern: before anything runs
    opts = _options(then, then_script, output if one else None, tool_rules, live_tools,
                    ignore, normalise, cwd, allow_incomplete)
    if one:
        _one(folder, tuple(command or ()), opts)
    if then is None and (output is not None or tool_rules or live_tools):
        raise BadInput("-o, --tool and --live-tool go with --then live or --then stub SCRIPT: "
                       "a plain replay writes nothing and runs no tool")
    plan = _plan(folder, tuple(command or ()), opts, suite_id, output)
    if cold:
        plan.jobs[:] = [dataclasses.replace(job, warm=False) for job in plan.jobs]
    runner, where = runner_for(on_workers, plan.jobs, plan.suite_id, "deja suite", "incidents",
                               f"run the suite again with --inline --id {plan.suite_id}")
    width = parallel or os.cpu_count() or 1
    click.echo(f"deja suite {plan.suite_id}: {len(plan.jobs)} incidents of {folder}, {where}"
               f", {width} at a time" + (f"; new cassettes in {_shown(plan.outdir)}"
                                         if plan.outdir else ""), err=True)
    when, started = utc_stamp("seconds"), time.monotonic()
    done: list[int] = []
    try:
        records = suites.run_jobs(plan.jobs, parallel=width, runner=runner,
                                  on_done=lambda r: _progress(r, plan, done))
    except KeyboardInterrupt:
        interrupted("deja suite", runner is not None, "the incidents go on on the workers: "
                    f"deja suite ... --id {plan.suite_id} collects their verdicts",
                    f"deja suite ... --id {plan.suite_id} goes on where it stopped"
                    if plan.then else "")
    totals = suites.summary(records, then=plan.then, seconds=time.monotonic() - started)
    status = _report([_as_shown(record, plan) for record in records], plan, totals, where,
                     as_json, junit)
    entries = [suite_summary.suite_entry(r, plan.folder / str(r.get("incident")))
               for r in records]
    write_summary(suite_summary.document(
        plan.suite_id, kind="suite", mode=plan.mode, when=when, command=plan.command or None,
        folder=plan.folder, output=plan.outdir, where=where, entries=entries, totals=totals),
        summary, plan.outdir or plan.folder, "deja suite")
    sys.exit(status)


def _options(then: str | None, then_script: Path | None, output: Path | None,
             tool_rules: tuple[str, ...], live_tools: tuple[str, ...],
             ignore: tuple[str, ...], normalise: tuple[str, ...], cwd: Path | None,
             allow_incomplete: bool) -> cli_replay.ReplayOptions:
    """How each incident is replayed; a bad tool rule or a --then without what it needs
    is refused before anything runs."""
    tool_policy(tool_rules, live_tools)
    if then == "stub" and then_script is None:
        raise BadInput("--then stub needs the stub's script: --then stub SCRIPT")
    if then != "stub" and then_script is not None:
        raise BadInput("a script goes with --then stub")
    return cli_replay.ReplayOptions(
        allow_incomplete=allow_incomplete, ignore=ignore, normalise=normalise, cwd=cwd,
        many=True, wants_result=True, then=then, then_script=then_script, output=output,
        tool_rules=tool_rules, live_tools=live_tools)


# --------------------------------------------------------------------------- the suite

def _plan(folder: Path, command: tuple[str, ...], opts: cli_replay.ReplayOptions,
          suite_id: str | None, output: Path | None) -> Plan:
    """The suite's id, its incidents and one job each."""
    if not folder.is_dir():
        raise BadInput(f"{folder} is not a folder: deja suite takes a folder of incidents "
                       "(deja replay takes single cassettes)")
    cassettes = sorted(folder.glob("*.jsonl"))
    if not cassettes:
        raise BadInput(f"{folder} holds no cassettes (no *.jsonl files)")
    if suite_id is not None and _SUITE_ID.fullmatch(suite_id) is None:
        raise BadInput(f"--id {suite_id!r}: a suite's id is 1 to 100 letters, digits, '_', "
                       "'-' and '.', starting with a letter or a digit")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    suite_id = suite_id or f"{folder.resolve().name}-suite-{stamp}"
    outdir = None
    if opts.then is not None:
        outdir = (output or folder.resolve().parent / suite_id).resolve()
        if outdir.exists() and not outdir.is_dir():
            raise BadInput(f"-o {output}: a suite's new cassettes go in a folder, and this "
                           "is a file")
    jobs = [_job(cassette, command, opts, outdir) for cassette in cassettes]
    return Plan(suite_id, {c.name: str(c) for c in cassettes}, outdir, jobs,
                opts.then is not None, folder, suite_summary.mode_of(opts.then), command)


def _job(cassette: Path, command: tuple[str, ...], opts: cli_replay.ReplayOptions,
         outdir: Path | None) -> suites.Job:
    """The job of one incident: ``deja suite --one CASSETTE`` with the suite's options,
    every path absolute (a worker runs it in this directory, maybe much later)."""
    argv = ["deja", "suite", "--one", str(cassette.resolve())]
    if opts.then is not None and outdir is not None:
        argv += ["--then", opts.then, "-o", str(outdir / cassette.name)]
        if opts.then_script is not None:
            argv += ["--then-script", str(opts.then_script.resolve())]
    for rule in opts.tool_rules:
        argv += ["--tool", rule]
    for name in opts.live_tools:
        argv += ["--live-tool", name]
    argv += [f"--ignore={p}" for p in opts.ignore]
    argv += [f"--normalise={n}" for n in opts.normalise]
    if opts.allow_incomplete:
        argv.append("--allow-incomplete")
    if opts.cwd is not None:
        argv += ["--cwd", str(opts.cwd.resolve())]
    log = str(outdir / f"{cassette.stem}.log") if outdir is not None else None
    return suites.Job(cassette.name, (*argv, "--", *command), str(Path.cwd()), log)


def runner_for(on_workers: bool | None, jobs: list[suites.Job], queue_id: str, name: str,
               what: str, again: str) -> tuple[suites.Runner | None, str]:
    """Where ``jobs`` run (``--workers``/``--inline``; by default on the workers when one
    is up, else here): the runner (None: here) and where, in words. ``queue_id`` names
    the queue and the workflows; ``name`` says who speaks, ``what`` the jobs are and
    ``again`` how to run them here instead, when no worker comes."""
    if on_workers is False:
        return None, "inline"
    from deja.runs.config import database_url, safe_url
    from deja.runs.errors import BadRunRequest
    from deja.runs.suites import WorkersRunner, check_storable, live_workers

    url = database_url()
    found = live_workers(url)
    if on_workers is None and not found:
        return None, "inline (" + ("the runs database cannot be reached" if found is None
                                   else "no deja worker is up") + ")"
    if found is None:
        raise BadInput(f"--workers: the runs database {safe_url(url)} cannot be reached")
    try:
        check_storable(jobs)
    except BadRunRequest as exc:
        raise BadInput(f"--workers: {exc}") from None
    if not found:
        click.echo(f"{name}: no worker is up yet: the {what} wait in the queue until one "
                   "starts (deja worker)", err=True)
    runner = WorkersRunner(url, queue_id, say=lambda text: click.echo(f"{name}: {text}",
                                                                      err=True),
                           what=what, again=again)
    return runner, f"on the workers ({', '.join(found) or 'none up yet'})"


def write_summary(summary: dict[str, Any], given: Path | None, folder: Path,
                  name: str) -> None:
    """Write a suite's (or a sweep's) summary to ``given``, else into ``folder``
    (:func:`replayer.suite_summary.default_path`), and say where. A ``--summary`` that
    cannot be written is bad input; the default place only warns."""
    target = given or suite_summary.default_path(folder, summary["suite"])
    try:
        suite_summary.write(target, summary)
    except OSError as exc:
        said = f"cannot write the summary {target}: {exc.strerror or exc}"
        if given is not None:
            raise BadInput(f"--summary: {said}") from None
        click.secho(f"{name}: WARNING: {said}", err=True, fg="yellow")
        return
    click.echo(f"{name}: summary in {_shown(target)}" + ("" if given is not None else
               f" (deja view {_shown(folder)} shows it)"), err=True)


def _progress(record: dict[str, Any], plan: Plan, done: list[int]) -> None:
    """One line per incident as its verdict comes, on stderr; the report of one that did
    not pass under it."""
    done.append(1)
    worker = f", worker {record['worker']}" if record.get("worker") else ""
    click.echo(f"deja suite: [{len(done)}/{len(plan.jobs)}] {record.get('incident')}: "
               f"{suites.headline(record)} in {float(record.get('seconds') or 0):.2f}s"
               f"{worker}", err=True)
    if record.get("verdict") in ("identical", "equivalent"):
        return
    said = (record.get("error") if record.get("verdict") == "error" else
            record.get("report")) or ""
    output = [line for line in str(record.get("output") or "").splitlines() if line.strip()]
    if record.get("verdict") in ("error", "now_fails") and output:
        said += "\nits last output:\n" + "\n".join(f"  {line}" for line in output[-OUTPUT_LINES:])
    for line in said.splitlines():
        click.echo(f"  {line}", err=True)


def interrupted(name: str, on_workers: bool, going_on: str, again: str = "") -> NoReturn:
    """Ctrl-C while ``name`` (``deja suite``, ``deja sweep``) waits: on the workers the
    jobs go on (``going_on`` says how to find them), here they stop (``again``: how to go
    on from where they stopped). Exits 130."""
    if on_workers:
        click.echo(f"{name}: stopped waiting; {going_on}", err=True)
    else:
        click.echo(f"{name}: interrupted" + (f"; {again}" if again else ""), err=True)
    sys.exit(130)


def _shown(path: str | Path | None) -> str | None:
    """A path as this directory sees it: relative when it is under it."""
    if path is None:
        return None
    found = Path(path)
    try:
        return str(found.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(found)


def _as_shown(record: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The record with the incident's path as given on the command line and the new
    cassette's relative to here."""
    key = str(record.get("incident"))
    return {**record, "cassette": plan.shown.get(key, record.get("cassette")),
            "new_cassette": _shown(record.get("new_cassette"))}


# --------------------------------------------------------------------------- reporting

def _report(records: list[dict[str, Any]], plan: Plan, done: dict[str, Any], where: str,
            as_json: bool, junit: Path | None) -> int:
    """The table (or the JSON document), the annotations and the JUnit report; the status
    to exit with. ``done``: the records' summary (:func:`replayer.suite.summary`)."""
    if _on_github():
        for record in records:
            line = _annotation(record, plan.then)
            if line is not None:
                click.echo(line, err=as_json)
    if as_json:
        click.echo(json.dumps({"suite": plan.suite_id, "where": where,
                               "output": _shown(plan.outdir), "incidents": records,
                               "summary": done}, indent=2))
    else:
        columns = COLUMNS if plan.then else [c for c in COLUMNS if c != "new cassette"]
        _print_table([suites.row(r) for r in records], columns,
                     title=f"deja suite {plan.suite_id}: {len(records)} incidents")
        click.echo(_totals(done, where))
    if junit is not None:
        try:
            write_report(junit, junit_of((_case(r, plan.then) for r in records), "deja suite"))
        except OSError as exc:
            raise BadInput(f"cannot write the JUnit report {junit}: "
                           f"{exc.strerror or exc}") from None
    return int(done["exit_status"])


def _totals(done: dict[str, Any], where: str) -> str:
    live = done["live"]
    return (f"total: {done['incidents']} incidents: {done['identical']} identical, "
            f"{done['equivalent']} equivalent, {done['changed']} changed, "
            f"{done['now_completes']} now complete, {done['now_fails']} now fail, "
            f"{done['error']} not judged; live: {live['model_calls']} model calls, "
            f"{live['tool_calls']} tool calls, ${live['cost_usd']:.6f}; in "
            f"{done['seconds']:.2f}s, {where}; exit status {done['exit_status']}")


def _regressed(record: dict[str, Any], then: bool) -> bool:
    return record.get("verdict") == "now_fails" or (
        not then and record.get("verdict") == "changed")


def _case(record: dict[str, Any], then: bool) -> Case:
    """An incident as a JUnit test case: a regression fails, an incident not judged is
    an error, anything else passes."""
    shown = Path(str(record.get("cassette")))
    text = "\n".join(filter(None, [record.get("report"), record.get("error"),
                                   record.get("output")]))
    seconds = float(record.get("seconds") or 0)
    if record.get("verdict") == "error":
        return Case(shown.parent.as_posix(), shown.name, seconds, "error",
                    str(record.get("error")), text, "DejaSuiteError")
    if _regressed(record, then):
        return Case(shown.parent.as_posix(), shown.name, seconds, "failure",
                    suites.headline(record), text, "Regression")
    return Case(shown.parent.as_posix(), shown.name, seconds)


def _on_github() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


def _annotation(record: dict[str, Any], then: bool) -> str | None:
    """The GitHub Actions workflow command of an incident: an error for a regression or
    an incident not judged, a notice for a change that is no regression; None else."""
    shown = str(record.get("cassette"))
    verdict = record.get("verdict")
    if verdict == "error":
        return workflow_command("error", shown, None, "deja suite could not judge",
                                f"{shown}: {record.get('error')}")
    if verdict in ("identical", "equivalent"):
        return None
    kind = "error" if _regressed(record, then) else "notice"
    said = suites.headline(record)
    return workflow_command(kind, shown, line_of(shown, record.get("changed_at")),
                            f"deja suite: {said}",
                            f"{shown} (run {record.get('run')}): {said}")


# --------------------------------------------------------------------------- one incident

def _one(cassette: Path, command: tuple[str, ...], opts: cli_replay.ReplayOptions) -> NoReturn:
    """``deja suite --one CASSETTE``: judge one incident and print its record, one line of
    JSON, on stdout; everything else (the program's output, deja's report) on stderr."""
    with cli_replay._stdout_to_stderr(True):
        try:
            record = _judged(cassette, command, opts)
        except click.ClickException as exc:
            exc.show()
            record = {"incident": cassette.name, "cassette": str(cassette),
                      "verdict": "error", "error": exc.format_message()}
    click.echo(json.dumps(record))
    sys.exit(0)


def _judged(cassette: Path, command: tuple[str, ...],
            opts: cli_replay.ReplayOptions) -> dict[str, Any]:
    if opts.then is None:
        outcome, failed = cli_replay.attempt(cassette, command, opts)
        if failed is not None:
            failed.show()
        else:
            click.echo(outcome.report(), err=True)
        return suites.replay_record(cassette.name, str(cassette), outcome.result,
                                    outcome.code, outcome.error, outcome.report(),
                                    run=outcome.run_id)
    return _then_one(cassette, command, opts)


def _then_one(cassette: Path, command: tuple[str, ...],
              opts: cli_replay.ReplayOptions) -> dict[str, Any]:
    """A replay-then-live into ``opts.output``, a path fixed by the suite and the
    incident: one an earlier attempt finished is judged again without running anything;
    one it left unfinished (a worker died under it) is replaced, once its writer is
    gone."""
    from deja._launch import _writer_lock

    out = opts.output
    if out is None:
        raise BadInput("--one --then needs -o, the incident's new cassette")
    _writer_gone(out)
    lock = _writer_lock(out, None, "deja suite")
    try:
        if earlier_attempt(out, "suite") is not None:
            return suites.then_live_record(cassette.name, cassette, out, None, reused=True)
        ran = cli_replay.run_then_live(cassette, command, opts)
        cli_replay._said_then_live(cassette, ran.out, ran.target)
        return suites.then_live_record(cassette.name, cassette, ran.out, ran.code)
    finally:
        lock.release()


def earlier_attempt(out: Path, what: str) -> dict[str, Any] | None:
    """What an earlier attempt of this ``what`` (suite, sweep) left at ``out``, its writer
    gone: the end line of a cassette it finished (not ``interrupted``), to be judged again
    without running anything; else None, a cassette it left unfinished being removed
    first (it is run again)."""
    from recorder.harness.progress import cassette_end

    state, end = cassette_end(out)
    if state == "ended" and end is not None and end.get("status") != "interrupted":
        click.echo(f"deja: {out} was finished by an earlier attempt of this {what}: judged "
                   "again, nothing run", err=True)
        return end
    if out.exists():
        click.echo(f"deja: {out} was left unfinished by an earlier attempt of this {what}; "
                   f"it is {'replaced' if what == 'suite' else 'run again'}", err=True)
        out.unlink()
    return None


WRITER_WAIT = 60.0  # seconds an incident waits for an earlier attempt to stop writing


def _writer_gone(out: Path) -> None:
    """Wait until no process writes ``out``: an earlier attempt of this incident whose
    worker died goes on for a moment (its program ends the run ``interrupted``); after
    :data:`WRITER_WAIT` seconds the lock's holder is named and the incident not judged."""
    from recorder.cassette.lock import describe, holder_of

    deadline = time.monotonic() + WRITER_WAIT
    said = False
    while (holder := holder_of(out)) is not None and time.monotonic() < deadline:
        if not said:
            click.echo(f"deja: waiting for {describe(holder)} to stop writing {out}", err=True)
            said = True
        time.sleep(0.1)
