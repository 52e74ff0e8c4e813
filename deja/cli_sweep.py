"""``deja sweep``: fork a recorded run once per perturbed observation, run the forks, and
report which perturbations change how the run ends (:mod:`replayer.sweep`)."""

from __future__ import annotations

import json
import re
import secrets
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import click

from deja._common import (
    BadInput,
    RunsCommand,
    _cwd_option,
    _fail,
    _load,
    _no_command,
    tool_policy,
    tool_policy_options,
)
from deja._launch import _where_to_run
from deja.cli_suite import (
    interrupted,
    runner_for,
    summary_option,
    workers_option,
    write_summary,
)
from recorder.cassette.schema import utc_stamp
from recorder.terminal import visible, visible_json
from replayer import suite_summary

_SWEEP_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def junit_cases(report: Any) -> list[Any]:
    """The sweep as JUnit test cases (:func:`replayer.ci.junit_of`), one per perturbation:
    one that changed the outcome fails, a fork that could not run is an error."""
    from replayer.ci import Case

    cases = []
    for row in report.rows:
        p = row.perturbation
        name = f"step {p.step} {p.step_kind} {p.target} {p.label}"
        if row.error is not None:
            cases.append(Case(report.cassette, name, row.seconds, "error", row.error,
                              kind="SweepForkError"))
        elif row.changed:
            said = "changed" if row.answer_changed else "same"
            cases.append(Case(report.cassette, name, row.seconds, "failure",
                              f"ended {row.status} (recorded: {report.status}); final "
                              f"answer {said}", f"final answer: {row.answer}\n"
                              f"fork: {row.cassette}", kind="OutcomeChanged"))
        else:
            cases.append(Case(report.cassette, name, row.seconds))
    return cases


def _plan(cassette: Path, rules: tuple[str, ...], output: Path | None,
          command: tuple[str, ...], cwd: Path | None, policy: Any,
          sweep_id: str | None = None) -> tuple[Any, list[Any], bool]:
    """Check everything before anything is written: the cassette, the command, the rules
    and the files the forks will write (those of the sweep ``sweep_id`` already wrote
    there may be). Returns the parent, the jobs, and whether that sweep is resumed."""
    from recorder.errors import DejaError
    from replayer.sweep import plan_jobs, plan_sweep, sweep_mark

    if sweep_id is not None and _SWEEP_ID.fullmatch(sweep_id) is None:
        raise BadInput(f"--id {sweep_id!r}: a sweep's id is 1 to 100 letters, digits, '_', "
                       "'-' and '.', starting with a letter or a digit")
    parent = _load(cassette, require_signature=True, allow_incomplete=True)
    argv = list(command) or list(parent.header.get("argv") or [])
    if not argv:
        raise _no_command(cassette, parent.header, "fork")
    _where_to_run(cassette, parent.header, argv, given=bool(command), cwd=cwd)
    out_dir = output if output is not None else cassette.parent / f"{cassette.stem}-sweep"
    mark = sweep_mark(out_dir)
    resume = sweep_id is not None and mark is not None and mark.get("id") == sweep_id
    if resume and mark is not None and mark.get("run") != parent.run:
        raise BadInput(f"{out_dir} holds sweep {sweep_id} of run {mark.get('run')}, not of "
                       f"{cassette} (run {parent.run}): give another -o or --id")
    try:
        perturbations = plan_sweep(parent, rules)
        jobs = plan_jobs(cassette, perturbations, out_dir, command=command, cwd=cwd,
                         tool_rules=_rules(policy), resume=resume)
    except DejaError as exc:
        _fail(exc)
    return parent, jobs, resume


def _rules(policy: Any) -> list[str]:
    """The tool policy as ``deja fork --tool`` rules (a tool named live is NAME=live)."""
    return [f"{name}={rule.spec()}" for name, rule in sorted(policy.rules.items())]


def _progress(total: int) -> Any:
    """Say each fork's end on stderr as it comes."""
    done = [0]

    def said(row: Any) -> None:
        done[0] += 1
        p = row.perturbation
        how = (f"could not run: {row.error}" if row.error is not None else
               f"{row.status}, final answer {'changed' if row.answer_changed else 'same'}")
        click.echo(visible(f"deja: [{done[0]}/{total}] step {p.step} {p.target} {p.label}: "
                           f"{how} ({row.seconds:.1f} s)"), err=True)
    return said


@click.command(cls=RunsCommand)
@click.argument("cassette", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--perturb", "rules", multiple=True, metavar="RULE",
              help="Steps and perturbations, SELECTOR:P[,P...]: tool=NAME (tool=* for every "
                   "tool), model, or step=N; P is error, timeout, empty, malformed or "
                   "other=FILE for a tool step, 429 or 529 for a model step (repeatable).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Forks run at the same time.")
@click.option("-o", "--output", "output", type=click.Path(path_type=Path, file_okay=False),
              help="The directory for the forks' cassettes, edit documents and logs "
                   "(default: CASSETTE's name with -sweep, next to it).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--junit", type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
              help="Also write a JUnit XML report: a test case per perturbation, failed "
                   "when it changed the outcome.")
@click.option("--dry-run", is_flag=True,
              help="Print the forks the rules make (and their commands) and run nothing.")
@click.option("--job", "job", metavar="NAME", hidden=True,
              help="Run the one fork NAME a sweep planned in -o DIR, at step --at, and "
                   "print its record (a sweep's job).")
@click.option("--at", "at", type=int, hidden=True)
@workers_option("forks")
@click.option("--id", "sweep_id", metavar="SWEEP",
              help="The sweep's id (default: <CASSETTE name>-sweep-<UTC time>-<random>). "
                   "The same id again, with the same -o, goes on with that sweep: a fork it "
                   "finished is judged again without running, one it left unfinished is run "
                   "again, and on the workers a fork with a verdict is not run again.")
@summary_option("the -o directory")
@tool_policy_options
@_cwd_option
def sweep(cassette: Path, command: tuple[str, ...], rules: tuple[str, ...], jobs: int,
          output: Path | None, as_json: bool, junit: Path | None, dry_run: bool,
          job: str | None, at: int | None, on_workers: bool | None, sweep_id: str | None,
          summary: Path | None, tool_rules: tuple[str, ...], live_tools: tuple[str, ...],
          cwd: Path | None) -> None:
    """What if a tool had failed? deja sweep CASSETTE --perturb RULE ... [-j N] [-- CMD].

    Forks the run once per perturbation (deja fork --at N --replace EDIT), runs the forks
    (-j at a time; each re-runs the recorded command, or CMD, live after its step against
    the program's own base URL), and reports, one row per perturbation: the step, the
    fork's end status (completed, failed, stopped by a guard ...), whether its final answer
    changed, its live calls and cost, and its cassette; then which perturbations changed
    the outcome. The final answer is the text of the last model reply (the last model
    step with a status below 400). A perturbation changes the outcome when the final
    answer or the end status differs from the recording's.

    Tool steps take error (RuntimeError), timeout (TimeoutError), empty ("", [], {} or
    null, by the recorded type), malformed (the recorded JSON text cut in half) and
    other=FILE (the same tool's result in another recording); model steps take 429 and
    529 (the provider's error response). A side-effecting tool never runs in a fork unless
    named with --live-tool. CASSETTE is never written.

    When a deja worker runs against the runs database, each fork is a durable workflow on
    the sweep's queue (-j at a time across the workers), as deja suite's incidents are
    (--workers to insist, --inline to run them here). The sweep leaves its summary, one
    JSON document, in the -o directory's .deja/suites/<id>.json (or --summary FILE), which
    deja view shows on its Suites page. A sweep has an id (--id): interrupted, the same
    command with the same --id goes on where it stopped, without running a fork twice.

    Exit 0 no perturbation changed the outcome, 1 one did, 2 bad input (nothing is
    written) or a fork that could not run.
    """
    from replayer.ci import junit_of, write_report
    from replayer.fork import side_effect_warning

    policy = tool_policy(tool_rules, live_tools)
    if job is not None:
        run_one(cassette, job, at, output, command, cwd, _rules(policy))
    if not rules:
        raise BadInput("give at least one --perturb RULE, e.g. --perturb tool=search:error")
    parent, planned, resume = _plan(cassette, rules, output, command, cwd, policy, sweep_id)
    if dry_run:
        click.echo(visible_json(json.dumps(
            [{**j.perturbation.to_dict(), **j.to_dict()} for j in planned], indent=2,
            ensure_ascii=False)) if as_json else visible("\n".join(
                f"step {j.perturbation.step} {j.perturbation.target} {j.perturbation.label}: "
                f"{shlex.join(j.fork_argv)}" for j in planned)))
        return
    warning = side_effect_warning(parent, min(j.perturbation.step for j in planned), policy)
    if warning is not None:
        click.secho(f"deja: WARNING: {warning}", err=True, fg="yellow")
    report, written = _run(cassette, parent.run, planned, command, jobs, cwd, policy,
                           on_workers, sweep_id or _sweep_id(cassette), resume)
    click.echo(visible_json(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
               if as_json else report.render())
    if junit is not None:
        try:
            write_report(junit, junit_of(junit_cases(report), f"deja sweep {report.run}"))
        except OSError as exc:
            raise BadInput(f"--junit {junit}: {exc.strerror or exc}") from None
    write_summary(written, summary, planned[0].out.parent, "deja sweep")
    sys.exit(report.exit_code)


def _run(cassette: Path, run: str, planned: list[Any], command: tuple[str, ...], jobs: int,
         cwd: Path | None, policy: Any, on_workers: bool | None, sweep_id: str,
         resume: bool) -> tuple[Any, dict[str, Any]]:
    """Run the planned forks, here or on the workers (:func:`deja.cli_suite.runner_for`):
    the sweep's report and its summary document."""
    from replayer.sweep import run_sweep

    out_dir = planned[0].out.parent
    again = f"deja sweep {shlex.quote(str(cassette))} ... --id {sweep_id} -o " \
        f"{shlex.quote(str(out_dir))}"
    runner, where = runner_for(on_workers, [j.suite_job(Path.cwd()) for j in planned],
                               sweep_id, "deja sweep", "forks",
                               f"stop the sweep and run it again with --inline: {again}")
    click.echo(visible(f"deja: sweep {sweep_id}{' (resumed)' if resume else ''} of run {run}: "
                       f"{len(planned)} fork(s), {jobs} at a time, {where}, into {out_dir}"),
               err=True)
    when, started = utc_stamp("seconds"), time.monotonic()
    try:
        report = run_sweep(cassette, [j.perturbation for j in planned], out_dir=out_dir,
                           command=command, jobs=jobs, cwd=cwd, tool_rules=_rules(policy),
                           runner=runner, on_done=_progress(len(planned)),
                           sweep_id=sweep_id, resume=resume)
    except KeyboardInterrupt:
        interrupted("deja sweep", runner is not None,
                    f"the forks go on on the workers, into {out_dir}: {again} collects "
                    "their verdicts", f"{again} goes on where it stopped")
    return report, suite_summary.document(
        sweep_id, kind="sweep", mode="sweep", when=when, command=command or None,
        folder=cassette.parent, output=out_dir, where=where,
        entries=suite_summary.sweep_entries(report),
        totals=suite_summary.sweep_totals(report, time.monotonic() - started))


def _sweep_id(cassette: Path) -> str:
    """A sweep's default id: the cassette's name, the time and a random tail. It names the
    sweep's queue and workflows on the workers, and its summary, and is written in its
    directory (``--id`` again goes on with it)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", cassette.stem).strip("-.")[:60] or "run"
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stem}-sweep-{stamp}-{secrets.token_hex(3)}"


def run_one(cassette: Path, name: str, at: int | None, output: Path | None,
            command: tuple[str, ...], cwd: Path | None, rules: list[str]) -> NoReturn:
    """A sweep's job (:class:`replayer.sweep.SweepJob`): run its fork, ``deja fork
    CASSETTE --at N --replace DIR/NAME.edit.json -o DIR/NAME.jsonl``, here, everything it
    and its program print on stderr; then print its record, one JSON line on stdout, as a
    job of :mod:`replayer.suite` does."""
    from deja.cli import fork
    from deja.cli_drift import _program_output_on_stderr

    if at is None or output is None:
        raise BadInput("--job NAME needs --at N and -o DIR (the sweep's job)")
    out, said = output / f"{name}.jsonl", output / f"{name}.record.json"
    finished = _finished(out, said)
    if finished is not None:
        click.echo(json.dumps({"incident": name, "exit_code": finished, "cassette": str(out),
                               "reused": True}))
        sys.exit(0)
    args = [str(cassette), "--at", str(at), "--replace", str(output / f"{name}.edit.json"),
            "-o", str(out), *(f"--tool={rule}" for rule in rules),
            *(["--cwd", str(cwd)] if cwd is not None else []),
            *(["--", *command] if command else [])]
    with _program_output_on_stderr(True):
        try:
            fork.main(args, prog_name="deja fork", standalone_mode=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    record = json.dumps({"incident": name, "exit_code": code, "cassette": str(out)})
    try:  # for an attempt of the sweep after this one: what the fork exited with
        said.write_text(record + "\n")
    except OSError:
        pass
    click.echo(record)
    sys.exit(0)


def _finished(out: Path, said: Path) -> int | None:
    """A fork an earlier attempt of the sweep wrote: finished (an end line, not
    ``interrupted``), the exit status it had (``said``, written after it; else 0 for a
    run that completed, 1 for one that did not), and it is judged again without running;
    left unfinished (a worker or the sweep stopped under it), it is removed once its
    writer is gone, and run again. None: it is to be run."""
    from deja.cli_suite import _writer_gone, earlier_attempt

    _writer_gone(out)
    end = earlier_attempt(out, "sweep")
    if end is None:
        return None
    try:
        code = json.loads(said.read_text()).get("exit_code")
    except (OSError, ValueError, AttributeError):
        code = None
    return code if isinstance(code, int) else int(end.get("status") != "completed")
