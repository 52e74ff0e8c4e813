"""The ``deja`` command line. Each command imports what it needs when it runs.

Exit statuses: 0 success; 1 a replay diverged (or a recorded program failed: its own
status is passed through); 2 a bad cassette, key or argument; 3 the bootstrap could not
start inside the program.

``record``, ``replay``, ``fork`` and ``resume`` are here (what they share around the
program they run is in ``deja._launch``); the commands that look at recorded runs are in
``deja.cli_inspect``, the others each in a ``cli_*`` module of its own.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from deja._common import (
    BadInput,
    ReplayCommand,
    RunsCommand,
    _allow_unverified_option,
    _cwd_option,
    _fail,
    _header_run,
    _labels,
    _load,
    _no_command,
    _read_json_file,
    budgets_of,
    guard_options,
    json_refusal,
    policy_options,
    policy_rows,
    redaction_options,
    restored,
    then_options,
    tool_policy,
    tool_policy_options,
)
from deja._launch import _echo_split, _launch, _where_to_run, _writer_lock

if TYPE_CHECKING:
    from replayer.fork import ForkPlan


# The commands of the other cli_* modules, each imported when it runs (or when --help lists
# them all): a command does not pay for importing the others and what they need.
COMMANDS = {name: module for module, names in {
    "deja.cli_inspect": ("verify", "repair", "show", "ls", "view", "diff"),
    "deja.cli_runs": ("status", "cancel"),
    "deja.cli_stub": ("stub",),
    "deja.cli_proxy": ("proxy",),
    "deja.cli_export": ("export",),
    "deja.cli_import": ("import",),
    "deja.cli_serve": ("worker", "serve", "submit", "runs", "answer", "schedule", "check"),
    "deja.cli_wait": ("wait",),
    "deja.cli_drift": ("drift",),
    "deja.cli_suite": ("suite",),
    "deja.cli_sweep": ("sweep",),
}.items() for name in names}


class _Commands(click.Group):
    """deja's command group: the commands of :data:`COMMANDS` are found in their modules
    by name when asked for, and a deja error no command turned into its own message
    (a line found malformed only when a command reads it, after the load) is said as
    one, with exit status 2, never as a traceback (and, for a command asked for
    ``--json``, also as JSON on stdout, as :func:`deja._common._load` says it)."""

    def invoke(self, ctx: click.Context) -> object:
        from recorder.errors import DejaError

        given = list(ctx.args)  # the command's arguments
        try:
            return super().invoke(ctx)
        except DejaError as exc:
            if self._asked_json(ctx, given):
                json_refusal(type(exc).__name__, str(exc), getattr(exc, "path", None))
            _fail(exc)

    def _asked_json(self, ctx: click.Context, given: list[str]) -> bool:
        """Whether the command that raised was asked for ``--json``: its arguments parsed
        again, as it parsed them (a program's ``--json`` after ``--`` is the program's)."""
        name = ctx.invoked_subcommand
        command = self.get_command(ctx, name) if name else None
        option = next((p.name for p in command.params if "--json" in p.opts), None) \
            if command is not None else None
        if command is None or option is None:
            return False
        parsed = command.make_context(name, given, parent=ctx, resilient_parsing=True)
        return bool(parsed.params.get(option))

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands or cmd_name not in COMMANDS:
            return self.commands.get(cmd_name)
        module = importlib.import_module(COMMANDS[cmd_name])
        [command] = [c for c in vars(module).values()
                     if isinstance(c, click.Command) and c.name == cmd_name]
        self.add_command(command)
        return command


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deja-replay")
def main() -> None:
    """deja: record, replay and inspect LLM agent runs.

    Record a run into a signed cassette, replay it offline bit for bit, and inspect it.
    """


@click.command(cls=RunsCommand, context_settings={"allow_interspersed_args": False})
@click.option("-o", "--output", "output", type=click.Path(path_type=Path),
              default=Path("cassettes"), show_default=True,
              help="Cassette file, or a directory to create <run id>.jsonl in.")
@click.option("--fsync", type=click.Choice(["sync", "turn", "exit"]), default=None,
              help="When lines are forced to disk (default: [tool.deja] fsync, else turn).")
@guard_options()
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Label the run (repeatable).")
@redaction_options
@click.option("--force", is_flag=True, help="Overwrite the cassette file if it exists.")
@click.option("--run-id", "given_run_id", metavar="ID",
              help="The run's id (default: a new one); a worker passes the id it was given.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def record(output: Path, fsync: str | None, max_turns: int | None,
           max_tokens_total: int | None, max_tokens_per_turn: int | None,
           clamp_max_tokens: bool, max_seconds: float | None, max_dollars: float | None,
           no_loop_guard: bool, no_breaker: bool, labels: tuple[str, ...],
           redact_headers: tuple[str, ...], redact_body: tuple[str, ...],
           redact_patterns: tuple[str, ...], redact_query: tuple[str, ...], force: bool,
           given_run_id: str | None, command: tuple[str, ...]) -> None:
    """Record an unmodified Python program: deja record [-o FILE] -- python agent.py ...

    Every model call, HTTP exchange, @recorder.tool call and effect is logged to the
    cassette, with the harness guards on (budgets, cancel, loop guard, circuit breaker;
    flags override [tool.deja] in pyproject.toml). Exits with the program's own status.
    """
    from deja.boot import BOOT_FAILED
    from recorder.cassette.schema import run_file
    from recorder.errors import EXIT_CASSETTE_UNWRITABLE, ConfigError
    from recorder.harness.progress import valid_run_id
    from recorder.harness.settings import resolve as resolve_settings
    from recorder.launch import new_run_id, startable

    label_map = _labels(labels)
    if given_run_id is not None and not valid_run_id(given_run_id):
        raise BadInput(f"--run-id {given_run_id!r} is not a run id (letters, digits, '_', "
                       "'.' and '-', e.g. r_01a2...)")
    run_id = given_run_id or new_run_id()
    try:
        path = run_file(output, run_id)
    except ConfigError as exc:
        _fail(exc)
    if path.exists() and not force:
        raise BadInput(f"{path} already exists; pass --force to overwrite it or choose "
                       "another -o")
    argv = list(command)
    budgets = budgets_of(max_turns, max_tokens_total, max_tokens_per_turn, clamp_max_tokens,
                         max_seconds, max_dollars)
    try:
        resolve_settings(budgets=budgets, loop_guard=False if no_loop_guard else None,
                         breaker=False if no_breaker else None, redact_headers=redact_headers,
                         redact_body=redact_body, redact_patterns=redact_patterns,
                         redact_query=redact_query)
    except ConfigError as exc:
        _fail(exc)
    why = startable(argv, Path.cwd())  # nothing recorded for a program that cannot start
    if why is not None:
        raise BadInput(f"the command ({shlex.join(argv)}) cannot start in {Path.cwd()}: {why}. "
                       "Nothing was recorded")
    lock = _writer_lock(path, run_id, "deja record")  # --force never tramples a live run
    try:
        code = _launch("record", argv, path, None, lock=lock, cassette=str(path.resolve()),
                       run_id=run_id, argv=argv, fsync=fsync, labels=label_map,
                       redact_headers=list(redact_headers), redact_body=list(redact_body),
                       redact_patterns=list(redact_patterns), redact_query=list(redact_query),
                       overwrite=force, budgets=budgets or None, loop_guard=not no_loop_guard,
                       breaker=not no_breaker).status
    finally:
        lock.release()
    started = _header_run(path) == run_id
    if code == EXIT_CASSETTE_UNWRITABLE and not started:
        with contextlib.suppress(OSError):  # the empty file the writer could not fill
            if path.stat().st_size == 0:
                path.unlink()
        sys.exit(code)  # the message above says why; a worker dispatches the run again
    if code == BOOT_FAILED and not started:
        raise BadInput("the program did not start recording (see the message above)")
    if started:
        click.echo(f"deja: recorded run {run_id} to {path}", err=True)
    sys.exit(code)


@click.command(cls=ReplayCommand)
@click.argument("cassettes", nargs=-1, required=True, metavar="CASSETTE|DIR...")
@click.option("--require-signature", is_flag=True,
              help="Refuse a cassette whose signature cannot be checked, even when "
                   "unverified cassettes are allowed.")
@_allow_unverified_option
@click.option("--run-recorded-command", is_flag=True,
              help="Run the command an unverified cassette's header names (never done "
                   "without this flag or -- CMD: the header is not checked).")
@click.option("--allow-torn", is_flag=True, help="Replay the intact part of a torn cassette.")
@click.option("--allow-incomplete", is_flag=True,
              help="Replay a cassette without an end line (a crashed run).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the replay result as JSON on stdout (the program's own output "
                   "goes to stderr); of many cassettes, one document: each one's result "
                   "and the summary.")
@click.option("--junit", type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
              help="Also write a JUnit XML report to FILE, for CI: a test case per "
                   "cassette (a divergence fails, a bad cassette is an error).")
@click.option("--junit-cases", type=click.Choice(["cassettes", "steps"]), default="cassettes",
              show_default=True,
              help="What a JUnit test case is: a cassette, or a recorded step (the "
                   "diverging step fails, the steps after it are skipped).")
@click.option("--cold", is_flag=True,
              help="Of many cassettes: start each one's program in a fresh interpreter. By "
                   "default they start warm, as forks of this process once it has imported "
                   "deja and the SDKs (a program that needs a first import of an SDK, e.g. "
                   "one that sets what the SDK reads as it is imported, needs --cold).")
@then_options("(-o)")
@click.option("-o", "--output", "output", type=click.Path(path_type=Path),
              help="With --then: the new cassette (a file, or a directory for <run>.jsonl; "
                   "default: next to the recording).")
@tool_policy_options
@policy_options
@_cwd_option
def replay(cassettes: tuple[str, ...], command: tuple[str, ...] | None,
           require_signature: bool, allow_unverified: bool, run_recorded_command: bool,
           allow_torn: bool, allow_incomplete: bool, as_json: bool, junit: Path | None,
           junit_cases: str, cold: bool, then: str | None, then_script: Path | None,
           output: Path | None, tool_rules: tuple[str, ...], live_tools: tuple[str, ...],
           ignore: tuple[str, ...], normalise: tuple[str, ...], cwd: Path | None) -> None:
    """Replay recorded runs offline: deja replay CASSETTE|DIR... [-- CMD ...].

    Runs the recorded command (or CMD) with every observation served from the cassette
    and the network blocked. The cassette's signature is checked first; one signed with a
    key this machine does not have is refused unless --allow-unverified, and even then
    its recorded command is only run when given as CMD or with --run-recorded-command.
    --ignore and --normalise say what may differ from the recording (a user id, today's
    date in a prompt) without being a divergence, added to the project's
    [tool.deja.match] and what each provider declares volatile (tool-use ids). The
    report grades the calls exact or equivalent and names the kind of a divergence;
    --json prints them (verdict, grades, kinds, equivalent). An equivalent replay passes
    as an identical one does.

    Many cassettes (several files, a shell glob such as runs/*.jsonl, or a directory: its
    *.jsonl files, sorted) are replayed in turn, each with CMD or its own recorded
    command, under the same rules; everything before -- is a cassette or a directory.
    Each one's report goes to stderr as it finishes, and a table of them all (run,
    verdict, steps served, where it diverged, seconds) and the totals to stdout. Their
    programs start warm, as forks of this process once it has imported deja and the SDKs
    (--cold: each in a fresh interpreter). Under
    GitHub Actions (GITHUB_ACTIONS=true) a divergence or a bad cassette is also an
    ::error annotation on the cassette's line, an equivalent replay a ::notice.

    --then live (or --then stub SCRIPT) tests a change against an incident: the recording
    is served while the program asks what it asked before, and from the first call it
    does not hold the run goes live into a new cassette whose header names the recording
    and that step; the unchanged part costs no live call. A side-effecting tool is then
    served its recorded answer or refused unless named with --live-tool; --tool sets any
    tool's rule. It exits with the program's status.

    Exit 0 identical, 1 diverged, 2 bad cassette. Of many cassettes: 0 when every one
    passed (identical or equivalent), 1 when one diverged, 2 when one could not be
    judged (a bad, torn or refused cassette, a program that failed before the replay
    reported); 2 wins over 1.
    """
    from deja import cli_replay

    cli_replay.run(cassettes, command, cli_replay.ReplayOptions(
        require_signature=require_signature, allow_unverified=allow_unverified,
        run_recorded_command=run_recorded_command, allow_torn=allow_torn,
        allow_incomplete=allow_incomplete, as_json=as_json, ignore=ignore,
        normalise=normalise, cwd=cwd, then=then, then_script=then_script, output=output,
        tool_rules=tool_rules, live_tools=live_tools, cold=cold), junit=junit,
        junit_cases=junit_cases)


@click.command(cls=RunsCommand)
@click.argument("cassette", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--at", "at", type=int, required=True, help="The step (seq) to edit.")
@click.option("--set", "sets", multiple=True, metavar="PATH=VALUE",
              help="Replace one field of the step's document: a JSON pointer (/result) or "
                   "dotted path (content.0.text); VALUE is JSON, or else a string.")
@click.option("--patch", "patch_file", type=click.Path(path_type=Path, dir_okay=False),
              help="An RFC 6902 JSON patch file applied to the step's document.")
@click.option("--replace", "replace_file", type=click.Path(path_type=Path, dir_okay=False),
              help="A JSON file that replaces the step's whole document.")
@click.option("-o", "--output", "output", type=click.Path(path_type=Path),
              help="The new cassette (default: <run id>.jsonl next to the parent).")
@click.option("--then-replay", "then_replay", type=click.Path(path_type=Path, dir_okay=False),
              help="After the edited step, serve calls from this cassette instead of "
                   "going live.")
@click.option("--show-document", is_flag=True,
              help="Print the editable document of step --at and exit.")
@tool_policy_options
@click.option("--allow-torn", is_flag=True,
              help="Fork a parent whose last line is torn (a crash mid-write) from its "
                   "intact lines.")
@_cwd_option
def fork(cassette: Path, command: tuple[str, ...], at: int, sets: tuple[str, ...],
         patch_file: Path | None, replace_file: Path | None, output: Path | None,
         then_replay: Path | None, show_document: bool, allow_torn: bool,
         tool_rules: tuple[str, ...], live_tools: tuple[str, ...], cwd: Path | None) -> None:
    """Re-run a recorded run with step N edited: deja fork CASSETTE --at N --set ... [-- CMD].

    Steps before N replay from the parent (its signature must verify), step N is the
    edited observation, and the steps after it go live (the agent's real upstream, e.g.
    ANTHROPIC_BASE_URL) or come from --then-replay. The new cassette names its parent
    and the fork step; the parent is never written. Bad input exits 2 with nothing
    written. Tool steps are edited as {"result": ...}, model steps as the assembled
    message (content, stop_reason, usage), HTTP steps as {"status", "headers", "body"},
    effects as {"value": ...}; --show-document prints it.

    A tool declared side_effect=True never runs for real after the fork step unless
    named with --live-tool: it is served the recorded answer to the same arguments, or
    refused (the agent sees ToolRefused, the cassette and the report say so). --tool
    sets any tool's rule: live, recorded, refuse or static:JSON.
    """
    from recorder.errors import DejaError
    from recorder.terminal import visible_json
    from replayer import edit
    from replayer.fork import plan_fork

    policy = tool_policy(tool_rules, live_tools)
    patch = _read_json_file(patch_file, "patch file") if patch_file else None
    replace = _read_json_file(replace_file, "replacement file") if replace_file else None
    try:
        if show_document:
            parent = _load(cassette, require_signature=True, allow_incomplete=True,
                           allow_torn=allow_torn)
            if not 0 <= at < len(parent.observations):
                raise BadInput(f"step {at} is out of range 0-{len(parent.observations) - 1}")
            click.echo(visible_json(json.dumps(edit.view(parent.observations[at]), indent=2,
                                               ensure_ascii=False)))
            return
        plan = plan_fork(cassette, at, patch=patch, replace=replace, sets=sets, out=output,
                         allow_torn=allow_torn)
        restored(plan.parent)
    except DejaError as exc:
        _fail(exc)
    if then_replay is not None:  # its steps are re-signed into the fork: it must verify
        _load(then_replay, require_signature=True, allow_incomplete=True, restore=True)
    argv = list(command) or list(plan.parent.header.get("argv") or [])
    if not argv:
        raise _no_command(cassette, plan.parent.header, "fork")
    cwd = _where_to_run(cassette, plan.parent.header, argv, given=bool(command), cwd=cwd)
    warning = plan.side_effect_warning(policy) if then_replay is None else None
    if warning is not None:  # said before anything runs
        click.secho(f"deja: WARNING: {warning}", err=True, fg="yellow")
    if isinstance(plan.parent.header.get("proxy"), dict):  # an agent in any language
        from deja.cli_proxy import through_proxy
        from deja.cli_replay import PROXY_TOOLS_WARNING

        click.secho(PROXY_TOOLS_WARNING, err=True, fg="yellow")
        if then_replay is not None:
            raise BadInput("--then-replay is for runs deja launched; a run recorded through "
                           "deja proxy forks live (--upstream of deja proxy --fork)")
        edit_args = ([f"--set={pair}" for pair in sets] if sets else
                     ["--patch", str(patch_file)] if patch_file else
                     ["--replace", str(replace_file)])
        code = through_proxy(
            ["--fork", str(cassette.resolve()), "--at", str(at), *edit_args,
             "-o", str(plan.out.resolve()), "--upstream", os.environ.get("ANTHROPIC_BASE_URL", "https://api.anthropic.com")],
            argv, cwd)
        sys.exit(code)
    lock = _writer_lock(plan.out, plan.run_id, "deja fork")
    try:
        code, started = _launch(
            "fork", argv, plan.out, cwd, lock=lock, cassette=str(cassette.resolve()), at=at,
            patch=plan.patch, out=str(plan.out.resolve()), run_id=plan.run_id,
            allow_torn=allow_torn,
            then_replay=str(then_replay.resolve()) if then_replay else None,
            tools=[f"{name}={spec}" for name, spec in policy.to_header().items()])
    finally:
        lock.release()
    _forked(cassette, plan, started)
    sys.exit(code)


def _forked(cassette: Path, plan: ForkPlan, started: bool) -> None:
    """What a fork that ran says: where it is, what it cost, which tool calls its tool
    policy answered without running them, and how to compare it with its parent."""
    from recorder.terminal import visible

    if not started:  # the bootstrap said why; the fork's file, begun for it, is removed
        click.echo("deja: the fork did not start; nothing was written", err=True)
        return
    if _header_run(plan.out) != plan.run_id:
        return
    click.echo(visible(f"deja: forked run {plan.run_id} from {plan.parent.run} at step "
                       f"{plan.at} -> {plan.out}"), err=True)
    _echo_split(plan.out)
    rows = policy_rows(plan.out)
    if rows:
        click.echo(f"deja: {len(rows)} tool call(s) not run live (the tool policy):", err=True)
        click.echo("\n".join(rows), err=True)
    click.echo(f"deja: compare them with: deja diff {cassette} {plan.out}", err=True)


@click.command(cls=RunsCommand)
@click.argument("cassette", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@_cwd_option
@click.option("--resend", "resend", multiple=True, metavar="TOOL",
              help="Send (or run) TOOL again if the run stopped inside a call of it that "
                   "nothing can settle: a destructive MCP tool, or a side effect without "
                   "settle=. Only once you checked it did not take effect. Repeatable.")
def resume(cassette: Path, command: tuple[str, ...], cwd: Path | None,
           resend: tuple[str, ...]) -> None:
    """Continue a crashed run: deja resume CASSETTE [-- CMD ...].

    Replays everything recorded (no live call, no side effect repeated), cuts a torn last
    line, settles a side effect that was in flight (the tool's settle= function), then
    continues live, appending to the same cassette after a `resumed` control line. A side
    effect nothing can settle (a destructive MCP tool call sent with no answer logged, a
    tool without settle=) stops the run with status needs_attention, unless --resend names
    it. Exits with the program's status; 2 if the cassette cannot be resumed.
    """
    from recorder.errors import DejaError
    from replayer.resume import plan_resume

    lock = _writer_lock(cassette, _header_run(cassette), "deja resume")  # before reading it
    try:
        try:
            loaded = plan_resume(cassette)
            restored(loaded)
        except DejaError as exc:
            _fail(exc)
        if loaded.torn_offset is not None:
            click.echo(f"deja: {cassette}: the last line is torn (byte {loaded.torn_offset}); "
                       "it is cut before resuming", err=True)
        if loaded.end is not None:
            click.echo(f"deja: {cassette}: the run ended {loaded.end.get('status')}; its end "
                       "line is cut and the run goes on", err=True)
        argv = list(command) or list(loaded.header.get("argv") or [])
        if not argv:
            raise _no_command(cassette, loaded.header, "resume")
        cwd = _where_to_run(cassette, loaded.header, argv, given=bool(command), cwd=cwd)
        code, started = _launch("resume", argv, cassette, cwd, lock=lock,
                                cassette=str(cassette.resolve()), resend=list(resend))
    finally:
        lock.release()
    if not started:  # the bootstrap said why; what it cut of the cassette is put back
        click.echo(f"deja: the run was not resumed; {cassette} is as it was", err=True)
        sys.exit(code)
    from recorder.cassette.schema import run_status
    from recorder.harness.progress import cassette_end
    from recorder.terminal import visible

    _, end = cassette_end(cassette)
    status = run_status(end) if end else "none (still unfinished)"
    click.echo(visible(f"deja: resumed run {loaded.run}: replayed {len(loaded.observations)} "
                       f"steps; end status {status}"), err=True)
    _echo_split(cassette)
    sys.exit(code)


for command in (record, replay, fork, resume):
    main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    main()
