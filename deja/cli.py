"""The ``deja`` command line. Each command imports what it needs when it runs.

Exit statuses: 0 success; 1 a replay diverged (or a recorded program failed: its own
status is passed through); 2 a bad cassette, key or argument; 3 the bootstrap could not
start inside the program.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from deja import cli_export, cli_import, cli_proxy, cli_runs, cli_serve, cli_stub
from deja._common import (
    EXIT_DIVERGED,
    BadInput,
    RunsCommand,
    _allow_unverified_option,
    _cwd_option,
    _fail,
    _fmt,
    _header_run,
    _labels,
    _load,
    _no_command,
    _pid_gone,
    _print_table,
    _python_argv,
    _read_json_file,
    _warn_unverified,
    budgets_of,
    guard_options,
    redaction_options,
    table_width,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deja")
def main() -> None:
    """deja: record, replay and inspect LLM agent runs.

    Record a run into a signed cassette, replay it offline bit for bit, and inspect it.
    """


@main.command(cls=RunsCommand, context_settings={"allow_interspersed_args": False})
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
    from recorder.record import new_run_id

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
    lock = _writer_lock(path, run_id, "deja record")  # --force never tramples a live run
    try:
        code = _launch("record", argv, path, None, lock=lock, cassette=str(path.resolve()),
                       run_id=run_id, argv=argv, fsync=fsync, labels=label_map,
                       redact_headers=list(redact_headers), redact_body=list(redact_body),
                       redact_patterns=list(redact_patterns), redact_query=list(redact_query),
                       overwrite="1" if force else None,
                       budgets=budgets or None, loop="0" if no_loop_guard else None,
                       breaker="0" if no_breaker else None)
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


@main.command(cls=RunsCommand)
@click.argument("cassette", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
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
                   "goes to stderr).")
@_cwd_option
def replay(cassette: Path, command: tuple[str, ...], require_signature: bool,
           allow_unverified: bool, run_recorded_command: bool, allow_torn: bool,
           allow_incomplete: bool, as_json: bool, cwd: Path | None) -> None:
    """Replay a recorded run offline: deja replay CASSETTE [-- CMD ...].

    Runs the recorded command (or CMD) with every observation served from the cassette
    and the network blocked. The cassette's signature is checked first; one signed with a
    key this machine does not have is refused unless --allow-unverified, and even then
    its recorded command is only run when given as CMD or with --run-recorded-command.
    Exit 0 identical, 1 diverged, 2 bad cassette.
    """
    from deja import launcher
    from deja.boot import child_env

    loaded = _load(cassette, require_signature=require_signature,
                   allow_unverified=allow_unverified, allow_torn=allow_torn,
                   allow_incomplete=allow_incomplete)
    recorded = list(loaded.header.get("argv") or [])
    if not loaded.verified and not command and not run_recorded_command:
        shown = " ".join(recorded) or "(none)"
        raise BadInput(
            f"{cassette}: {loaded.verify_note}. deja does not run the command an unverified "
            f"header names ({shown}), since anyone could have written it there. Give the "
            f"command yourself: deja replay {cassette} --allow-unverified -- CMD ..., or "
            "pass --run-recorded-command if you have read it and trust it")
    _warn_unverified(loaded)
    argv = list(command) or recorded
    if not argv:
        raise _no_command(cassette, loaded.header, "replay")
    cwd = _where_to_run(cassette, loaded.header, argv, given=bool(command), cwd=cwd)
    if isinstance(loaded.header.get("proxy"), dict):  # an agent in any language
        sys.exit(cli_proxy.through_proxy(
            ["--replay", str(cassette.resolve()),
             *([] if loaded.verified else ["--allow-unverified"])], argv, cwd))
    with tempfile.TemporaryDirectory(prefix="deja-replay-") as tmp:
        report = Path(tmp) / "report.json"
        env = child_env("replay", cassette=str(cassette.resolve()), report=str(report),
                        allow_torn="1" if allow_torn else None,
                        allow_incomplete="1" if allow_incomplete else None,
                        require_signature="1" if require_signature else None,
                        allow_unverified=None if loaded.verified else "1")
        try:
            ended = launcher.run(_python_argv(argv), env=env, cwd=cwd,
                                 stdout=sys.stderr.fileno() if as_json else None)
        except OSError as exc:
            raise BadInput(f"cannot run {argv[0]!r}: {exc.strerror or exc}") from None
        if ended.received is not None:
            click.echo(f"deja: replay stopped by signal {ended.received}", err=True)
            sys.exit(ended.status)
        if not report.exists():
            raise BadInput(f"the program exited with status {ended.status} before the replay "
                           "could report (see the message above)")
        result = json.loads(report.read_text())
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(_replay_report(result, ended.status))
    sys.exit(0 if result["identical"] else EXIT_DIVERGED)


def _where_to_run(cassette: Path, header: Mapping[str, Any], argv: list[str], *, given: bool,
                  cwd: Path | None) -> Path | None:
    """The directory to run a recorded (or given) command in; a command that cannot start
    there exits 2 (it is not a divergence), naming the directory and what to do."""
    from recorder.errors import CannotLaunch
    from recorder.record import launch_dir, startable

    advice = (f"give the project directory with --cwd DIR, or the command after --: "
              f"deja {click.get_current_context().info_name} {cassette} -- {' '.join(argv)}")
    if cwd is None and not given:
        try:
            cwd = launch_dir(cassette, header)
        except CannotLaunch as exc:
            raise BadInput(f"the recorded command ({' '.join(argv)}) cannot be run: {exc}; "
                           f"{advice}") from None
    why = startable(argv, cwd or Path.cwd())
    if why is not None:
        what = "the command" if given else "the recorded command"
        raise BadInput(f"{what} ({' '.join(argv)}) cannot start in {cwd or Path.cwd()}: {why}. "
                       "Nothing was run. " + ("Check the command" if given else advice))
    return cwd


def _replay_report(result: dict[str, Any], code: int) -> str:
    """The one report of a replay: the child printed no traceback for a divergence, so
    this is where the user reads it (and its diff), once."""
    from recorder.cassette.rows import describe_split, describe_totals

    verdict = "identical" if result["identical"] else "DIVERGED"
    if not result.get("verified"):
        verdict += " (NOT VERIFIED: what was served is unchecked)"
    lines = [f"replay of {result['run']}: {verdict}",
             f"  cassette:   {result['path']}",
             f"  steps:      {result['steps_served']}/{result['steps_recorded']} served "
             f"in {result['seconds']:.3f}s",
             f"  signature:  {result['verify_note']}",
             f"  recorded:   {result['recorded_status'] or 'no end line'}; "
             f"program exit status {code}"]
    totals = result.get("totals")
    if totals:
        lines.append(f"  totals:     {describe_totals(totals['all'])}")
        lines.extend(f"              {line}" for line in describe_split(totals))
    d = result.get("divergence")
    if d:
        step = d["step"] if d["step"] is not None else "end"
        lines.append(f"  divergence: step {step} ({d['kind']}): {d['reason']}")
        lines.extend("    " + line for line in (d.get("diff") or "").splitlines())
        lines.append("  next:       the agent's code or inputs changed since the run was "
                     "recorded: fix it, record the run again"
                     + (f", or fork it at this step (deja fork {result['path']} --at {step} "
                        "...) to test the change" if d["step"] is not None else ""))
    lines.extend(f"  note:       {note}" for note in result.get("notes") or ())
    return "\n".join(lines)


@main.command()
@click.argument("cassette", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--allow-torn", is_flag=True, help="Check the intact part of a torn cassette.")
@click.option("--allow-incomplete", is_flag=True,
              help="Accept a cassette without an end line (a run still going, or crashed).")
def verify(cassette: Path, allow_torn: bool, allow_incomplete: bool) -> None:
    """Check a cassette's format and signature chain; name the first bad line.

    Needs the key it was signed with (DEJA_KEY, the key file, or DEJA_OLD_KEYS). A
    cassette without its end line is refused: lines cut off at a line boundary leave no
    other trace (--allow-incomplete accepts a run that is still going or crashed).
    Exit 0 ok, 2 refused.
    """
    c = _load(cassette, require_signature=True, allow_torn=allow_torn,
              allow_incomplete=allow_incomplete)
    from recorder.cassette.rows import step_count
    from recorder.cassette.schema import run_status
    from recorder.harness.progress import read_status

    # Without an end line the run's status record says more (a worker failed it).
    end = run_status(c.end) if c.end else \
        f"{run_status(None, (read_status(c.run) or {}).get('status'))} (no end line)"
    click.echo(f"ok: {cassette}: run {c.run}, {step_count(c)} steps, {c.verify_note}, "
               f"end: {end}")


@main.command()
@click.argument("cassette", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Say what would be cut; change nothing.")
def repair(cassette: Path, dry_run: bool) -> None:
    """Cut what a power loss left after a cassette's last verified line.

    Keeps the header and every line after it that verifies, and cuts the rest, once a
    copy of the file as it is has been written beside it (CASSETTE.bak). Refused (exit 2,
    nothing written) when the cassette cannot be verified here, or when what follows its
    verified lines looks like edited lines rather than junk. A run that keeps no end line
    can then be resumed (deja resume). Exit 0 repaired, or nothing to cut.
    """
    from recorder.cassette import repair as repairs
    from recorder.errors import DejaError

    try:
        done = repairs.plan(cassette) if dry_run else repairs.apply(cassette)
    except DejaError as exc:
        _fail(exc)
    if not done.needed:
        click.echo(done.describe())
    elif dry_run:
        click.echo(f"would cut: {done.describe()}")
    else:
        click.echo(f"repaired: {done.describe()}; the file as it was is {done.backup}")


@main.command()
@click.argument("cassette", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the run and its steps as JSON.")
@_allow_unverified_option
def show(cassette: Path, as_json: bool, allow_unverified: bool) -> None:
    """One row per step: seq, kind, name, status, tokens, cost, latency.

    The signature is checked first; a cassette signed with a key this machine does not
    have is refused unless --allow-unverified, and then marked NOT VERIFIED.
    """
    from recorder.cassette.rows import (
        children_of,
        describe_split,
        describe_totals,
        run_summary,
        run_totals,
        step_rows,
    )

    c = _load(cassette, allow_torn=True, allow_unverified=allow_unverified)
    _warn_unverified(c)
    summary, rows = run_summary(c), step_rows(c)
    if summary["status"] in ("incomplete", "torn"):  # who writes it, or who gave up on it
        from viewer.queries import writer_state

        summary["status"] = writer_state(c.path, c.run) or summary["status"]
    children = children_of(c.run, cassette.parent)
    if as_json:
        click.echo(json.dumps({"run": summary, "children": children, "steps": rows}, indent=2,
                              default=str))
        return
    if not c.verified:
        click.secho(f"{c.verify_note}", fg="yellow", bold=True)
    click.echo(f"run {summary['run']}  status {summary['status']}  created {summary['created']}")
    if summary["parent_run"]:
        click.echo(f"  forked from {summary['parent_run']} at step {summary['parent_step']}")
    for child in children:
        click.echo(f"  fork {child['run']} at step {child['step']}: {child['path']}")
    click.echo(f"  {summary['steps']} steps: {describe_totals(summary)}; "
               f"{summary['verify_note']}")
    for line in describe_split(run_totals(c)):
        click.echo(f"    {line}")
    for row in rows:
        row["tokens"] = (f"{row['input_tokens']}/{row['output_tokens']}"
                         if row["input_tokens"] is not None else None)
    _print_table(rows, ["seq", "kind", "name", "status", "tokens", "cost_usd", "ms", "error"])


@main.command(name="ls")
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False),
                default=Path("cassettes"))
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON.")
@_allow_unverified_option
def ls_(directory: Path, as_json: bool, allow_unverified: bool) -> None:
    """List the runs in a cassette directory (default: cassettes).

    Reads the DuckDB index of DIR (kept under $DEJA_HOME/index/, never in DIR), refreshed
    from the files first; delete it at any time and it is rebuilt. Indexing many files
    shows a progress bar when stderr is a terminal. A run without an end line is
    `running` while a process writes it, `crashed` when its status record says running
    but that process is gone, else `incomplete`. A cassette that does not verify is an
    error row with the reason; with --allow-unverified, one signed with a key this
    machine does not have is listed, marked NOT VERIFIED.
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from viewer.console import indexing_progress
    from viewer.index import RunIndex
    from viewer.queries import labels_text, writer_state

    if not directory.is_dir():
        raise BadInput(f"no directory {directory}")
    with RunIndex(directory, allow_unverified=allow_unverified or None) as index, \
            indexing_progress() as progress:
        index.refresh(progress=progress)
        runs = index.runs()
    for run in runs:
        run["file"] = Path(run["path"]).name
        run["labels"] = json.loads(run["labels"]) if run.get("labels") else {}
        if run.get("status") in ("incomplete", "torn"):
            run["status"] = writer_state(run["path"], run.get("run")) or run["status"]
    if as_json:
        click.echo(json.dumps(runs, indent=2, default=str))
        return
    if not runs:
        click.echo(f"no runs in {directory}")
        return
    forks: dict[str, int] = {}
    for run in runs:
        if run.get("parent_run"):
            forks[run["parent_run"]] = forks.get(run["parent_run"], 0) + 1
    for run in runs:
        run["created"] = (run.get("created") or "")[:19].replace("T", " ")
        run["parent"] = (f"{run['parent_run']}@{run['parent_step']}" if run.get("parent_run")
                         else None)
        run["forks"] = forks.get(run["run"] or "") or None
        run["labels"] = labels_text(run["labels"])
        run["run"] = run["run"] or run["file"]
        run["signed"] = ("verified" if run.get("verified") else
                         "NOT VERIFIED" if run.get("status") != "error" else None)
    # A run id is never wrapped; short values (a status, a count) keep their width, the
    # long ones (file, time, parent, labels, error) fold. A column empty for every run is
    # left out.
    cells = [{c: "" if run.get(c) is None else _fmt(run.get(c)) for c in
              ("run", "file", "status", "signed", "created", "steps", "tokens", "cost_usd",
               "duration_s", "parent", "forks", "labels", "error")} for run in runs]
    columns = [c for c in cells[0] if c in ("run", "file", "status")
               or any(row[c] for row in cells)]
    width = table_width()
    widest = {c: max(len(c), *(len(row[c]) for row in cells)) for c in columns}
    keep = {c: w for c, w in widest.items() if w <= 12 or c == "run"}
    if sum(keep.values()) + 8 * (len(columns) - len(keep)) + 3 * len(columns) > width:
        keep = {"run": widest["run"]}  # too narrow for all: only the run id keeps its width
    table = Table(title=f"runs in {directory}", header_style="bold", box=box.SIMPLE_HEAD)
    for col in columns:
        table.add_column(col, no_wrap=col == "run", overflow="fold", min_width=keep.get(col))
    for row in cells:
        table.add_row(*(row[c] for c in columns))
    Console(width=width).print(table)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False),
                default=Path("cassettes"))
@click.option("--port", type=click.IntRange(1, 65535), default=8501, show_default=True,
              help="Port on 127.0.0.1.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="Also answer requests made to this host name (repeatable; by default only "
                   "localhost, 127.0.0.1 and [::1]), e.g. a name that a tunnel forwards here.")
@click.option("--token", envvar="DEJA_TOKEN", metavar="TOKEN",
              help="The token the printed address carries (also DEJA_TOKEN). Default: this "
                   "install's, $DEJA_HOME/serve.token, made on first use.")
@_allow_unverified_option
def view(directory: Path, port: int, allow_hosts: tuple[str, ...], token: str | None,
         allow_unverified: bool) -> None:
    """Browse the runs of a cassette directory in the browser (default: cassettes).

    Serves the viewer on http://127.0.0.1:PORT: every run with filters and text search;
    a run's totals, timeline and steps (the conversation, tool calls, raw JSON); diffs;
    forks from an edited step; live runs with a cancel button. Stop it with Ctrl-C.
    The folder is indexed first (the index lives under $DEJA_HOME/index/), with a
    progress bar when stderr is a terminal and there are many files to read.

    A run's content is shown as text, never as markup, and the page fetches nothing
    from elsewhere. The server answers only requests made to a loopback name (or an
    --allow-host name) from its own pages: another site's page, even one whose name
    resolves to 127.0.0.1, cannot read the viewer or press its buttons. The address it
    prints carries a token (?token=...): opening it gives the browser a cookie, which every
    request needs, so another user of the machine cannot drive the viewer either.
    """
    import importlib.util
    import signal
    from urllib.parse import quote

    import viewer
    from runs.auth import server_token
    from viewer.console import indexing_progress
    from viewer.guard import HOSTS_ENV, TOKEN_ENV, host_name
    from viewer.index import RunIndex

    if not directory.is_dir():
        raise BadInput(f"no directory {directory}")
    for name in allow_hosts:
        if host_name(name) is None or ":" in name.strip("[]"):
            raise BadInput(f"--allow-host {name!r}: give a host name (such as "
                           "viewer.example), without a port or a scheme")
    if importlib.util.find_spec("streamlit.starlette") is None:
        raise BadInput("deja view needs Streamlit 1.53 or newer (its Starlette server "
                       "runs the viewer's host checks): pip install -U 'streamlit>=1.53'")
    secret = server_token(token)
    # Indexed here first, with a progress bar on a terminal, so the first page is quick.
    with RunIndex(directory, allow_unverified=allow_unverified or None) as index, \
            indexing_progress() as progress:
        index.refresh(progress=progress)
    # serve.py: the page script (app.py) behind the viewer's Host and Origin checks
    app = Path(viewer.__file__).resolve().parent / "serve.py"
    argv = [sys.executable, "-m", "streamlit", "run", str(app),
            "--server.address", "127.0.0.1", "--server.port", str(port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--client.toolbarMode", "viewer",  # no Deploy button, no developer menu
            "--server.enableCORS", "true", "--server.enableXsrfProtection", "true"]
    from streamlit import config as streamlit_config

    if "server.allowedHosts" in streamlit_config.get_config_options():  # its own check too
        for name in ("localhost", "127.0.0.1", "::1", *allow_hosts):
            argv += ["--server.allowedHosts", name.strip("[]")]
    if "logger.hideWelcomeMessage" in streamlit_config.get_config_options():
        argv += ["--logger.hideWelcomeMessage", "true"]  # its address lacks the token
    argv += ["--", str(directory)]
    # A SIGTERM from here on stops the viewer with us, even one that comes while it starts.
    terminated: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: terminated.append(signum))
    click.echo(f"deja view: {directory} at http://127.0.0.1:{port}/?token="
               f"{quote(secret, safe='')} (Ctrl-C stops it)", err=True)
    env = dict(os.environ)
    env[TOKEN_ENV] = secret
    env["DEJA_VIEW_DIR"] = str(directory)
    env[HOSTS_ENV] = ",".join(name.strip("[]") for name in allow_hosts)
    if allow_unverified:
        env["DEJA_ALLOW_UNVERIFIED"] = "1"
    if terminated:
        sys.exit(128 + signal.SIGTERM)
    process = subprocess.Popen(argv, env=env)
    signal.signal(signal.SIGTERM, lambda *_: process.terminate())
    if terminated:
        process.terminate()
    try:
        code = process.wait()
    except KeyboardInterrupt:  # the viewer has the same Ctrl-C and stops on its own
        try:
            code = process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
    sys.exit(code)


def _writer_lock(path: Path, run: str | None, what: str) -> Any:
    """Take ``path``'s writer lock for the whole command (refused: exit 2, naming who has it)."""
    import time

    from recorder.cassette import lock
    from recorder.errors import CassetteLocked, DejaError

    deadline = None
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return lock.acquire(path, run=run, what=what)
        except OSError as exc:
            raise BadInput(f"cannot create {path.parent}: {exc.strerror or exc}") from None
        except CassetteLocked as exc:
            # A launcher killed outright leaves its program closing the run (its
            # parent-death signal): wait for that, never for a live run.
            if not _orphaned_holder(exc.holder) or (deadline and time.monotonic() > deadline):
                _fail(exc)
            if deadline is None:
                deadline = time.monotonic() + 15
                click.echo(f"deja: waiting for pid {exc.holder.get('child')}, whose launcher "
                           "was killed, to close the run", err=True)
            time.sleep(0.1)
        except DejaError as exc:
            _fail(exc)


def _orphaned_holder(holder: dict[str, Any]) -> bool:
    """The lock is held by a program whose launcher (on this host) is gone."""
    import socket

    if holder.get("host") != socket.gethostname() or not holder.get("child"):
        return False
    return _pid_gone(holder.get("pid"))


def _launch(mode: str, command: list[str], target: Path, cwd: Path | None, *,
            lock: Any = None, **values: Any) -> int:
    """Run a program under the bootstrap; write the end line it hands back, with its exit
    status. A program killed before handing over leaves its run open: resumable.
    Returns the status to exit with (128 + N when a signal N stopped it)."""
    from deja import launcher
    from deja.boot import BOOT_FAILED, child_env
    from recorder.ask import EXIT_INPUT_REQUIRED, WORKER_ENV
    from recorder.errors import EXIT_CASSETTE_UNWRITABLE, CassetteWriteError, DejaError
    from recorder.record import write_end

    with tempfile.TemporaryDirectory(prefix="deja-") as tmp:
        report = Path(tmp) / "report.json"
        env = child_env(mode, report=str(report), **values)
        try:
            ended = launcher.run(_python_argv(command), env=env, cwd=cwd, lock=lock)
        except OSError as exc:
            raise BadInput(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
        status = ended.status
        if report.exists():
            handed = json.loads(report.read_text())
            end = handed.get("end")
            handed_status = end.get("status") if end is not None else None
            killed_by = ended.received if ended.received is not None else \
                ended.code - 128 if ended.code > 128 else None
            if end is not None and end.get("status") == "completed" and \
                    killed_by is not None and ended.code != 0:
                # Every step was logged, but a signal stopped the program on its way out
                # (through us, or sent to the program alone: the out-of-memory killer):
                # resumable (a resume replays it all and closes the run), not a failure.
                end = dict(end, status="interrupted",
                           reason=f"signal {killed_by} as the program exited")
            if end is not None and end.get("status") == "interrupted" and \
                    ended.received is None and isinstance(handed.get("signal"), int):
                # The signal went to the program alone (not through us): as a shell
                # reports a program stopped by signal N, 128 + N, not Python's exit 1.
                status = 128 + handed["signal"]
            if end is not None:
                try:
                    write_end(target, end, 0 if ended.received is not None and
                              end.get("status") == "completed" else status,
                              handed=handed_status)
                except CassetteWriteError as exc:  # still no room: the run stays open
                    click.echo(f"deja: the run's end line could not be written ({exc})",
                               err=True)
                except DejaError as exc:
                    _fail(exc)
        elif ended.code == EXIT_INPUT_REQUIRED and os.environ.get(WORKER_ENV) == "1":
            click.echo("deja: the run waits for an answer (recorder.ask); it is resumed with "
                       "it", err=True)
        elif target.exists() and ended.code not in (BOOT_FAILED, EXIT_CASSETTE_UNWRITABLE):
            click.echo(f"deja: the program ended (status {ended.status}) before the run could "
                       f"be closed; it can be resumed: deja resume {target}", err=True)
    return status


@main.command(cls=RunsCommand)
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
@click.option("--allow-torn", is_flag=True,
              help="Fork a parent whose last line is torn (a crash mid-write) from its "
                   "intact lines.")
@_cwd_option
def fork(cassette: Path, command: tuple[str, ...], at: int, sets: tuple[str, ...],
         patch_file: Path | None, replace_file: Path | None, output: Path | None,
         then_replay: Path | None, show_document: bool, allow_torn: bool,
         cwd: Path | None) -> None:
    """Re-run a recorded run with step N edited: deja fork CASSETTE --at N --set ... [-- CMD].

    Steps before N replay from the parent (its signature must verify), step N is the
    edited observation, and the steps after it go live (the agent's real upstream, e.g.
    ANTHROPIC_BASE_URL) or come from --then-replay. The new cassette names its parent
    and the fork step; the parent is never written. Bad input exits 2 with nothing
    written. Tool steps are edited as {"result": ...}, model steps as the assembled
    message (content, stop_reason, usage), HTTP steps as {"status", "headers", "body"},
    effects as {"value": ...}; --show-document prints it.
    """
    from recorder.errors import DejaError
    from replayer import edit
    from replayer.fork import plan_fork

    patch = _read_json_file(patch_file, "patch file") if patch_file else None
    replace = _read_json_file(replace_file, "replacement file") if replace_file else None
    try:
        if show_document:
            parent = _load(cassette, require_signature=True, allow_incomplete=True,
                           allow_torn=allow_torn)
            if not 0 <= at < len(parent.observations):
                raise BadInput(f"step {at} is out of range 0-{len(parent.observations) - 1}")
            click.echo(json.dumps(edit.view(parent.observations[at]), indent=2,
                                  ensure_ascii=False))
            return
        plan = plan_fork(cassette, at, patch=patch, replace=replace, sets=sets, out=output,
                         allow_torn=allow_torn)
    except DejaError as exc:
        _fail(exc)
    if then_replay is not None:  # its steps are re-signed into the fork: it must verify
        _load(then_replay, require_signature=True, allow_incomplete=True)
    argv = list(command) or list(plan.parent.header.get("argv") or [])
    if not argv:
        raise _no_command(cassette, plan.parent.header, "fork")
    cwd = _where_to_run(cassette, plan.parent.header, argv, given=bool(command), cwd=cwd)
    if isinstance(plan.parent.header.get("proxy"), dict):  # an agent in any language
        if then_replay is not None:
            raise BadInput("--then-replay is for runs deja launched; a run recorded through "
                           "deja proxy forks live (--upstream of deja proxy --fork)")
        edit_args = ([f"--set={pair}" for pair in sets] if sets else
                     ["--patch", str(patch_file)] if patch_file else
                     ["--replace", str(replace_file)])
        code = cli_proxy.through_proxy(
            ["--fork", str(cassette.resolve()), "--at", str(at), *edit_args,
             "-o", str(plan.out.resolve()), "--upstream", os.environ.get("ANTHROPIC_BASE_URL", "https://api.anthropic.com")],
            argv, cwd)
        sys.exit(code)
    lock = _writer_lock(plan.out, plan.run_id, "deja fork")
    try:
        code = _launch("fork", argv, plan.out, cwd, lock=lock, plan={
            "cassette": str(cassette.resolve()), "at": at, "patch": plan.patch,
            "out": str(plan.out.resolve()), "run_id": plan.run_id, "allow_torn": allow_torn,
            "then_replay": str(then_replay.resolve()) if then_replay else None})
    finally:
        lock.release()
    if _header_run(plan.out) == plan.run_id:
        click.echo(f"deja: forked run {plan.run_id} from {plan.parent.run} at step {at} "
                   f"-> {plan.out}", err=True)
        _echo_split(plan.out)
        click.echo(f"deja: compare them with: deja diff {cassette} {plan.out}", err=True)
    sys.exit(code)


def _echo_split(path: Path) -> None:
    """What a fork or a resumed run replayed and what it spent live, on stderr."""
    from recorder.cassette import load
    from recorder.cassette.rows import describe_split, run_totals
    from recorder.errors import DejaError

    try:
        written = load(path, allow_torn=True, allow_incomplete=True)
    except DejaError:  # what went wrong was said above
        return
    for line in describe_split(run_totals(written)):
        click.echo(f"deja:   {line}", err=True)


@main.command(cls=RunsCommand)
@click.argument("cassette", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@_cwd_option
def resume(cassette: Path, command: tuple[str, ...], cwd: Path | None) -> None:
    """Continue a crashed run: deja resume CASSETTE [-- CMD ...].

    Replays everything recorded (no live call, no side effect repeated), cuts a torn last
    line, settles a side effect that was in flight (the tool's settle= function), then
    continues live, appending to the same cassette after a `resumed` control line. Exits
    with the program's status; 2 if the cassette cannot be resumed.
    """
    from recorder.errors import DejaError
    from replayer.resume import plan_resume

    lock = _writer_lock(cassette, _header_run(cassette), "deja resume")  # before reading it
    try:
        try:
            loaded = plan_resume(cassette)
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
        code = _launch("resume", argv, cassette, cwd, lock=lock,
                       plan={"cassette": str(cassette.resolve())})
    finally:
        lock.release()
    from recorder.cassette.schema import run_status
    from recorder.harness.progress import cassette_end

    _, end = cassette_end(cassette)
    click.echo(f"deja: resumed run {loaded.run}: replayed {len(loaded.observations)} steps; "
               f"end status {run_status(end) if end else 'none (still unfinished)'}",
               err=True)
    _echo_split(cassette)
    sys.exit(code)


@main.command()
@click.argument("cassette_a", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("cassette_b", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@_allow_unverified_option
def diff(cassette_a: Path, cassette_b: Path, as_json: bool, allow_unverified: bool) -> None:
    """Compare two runs step by step. Exit 0 same, 1 different, 2 bad cassette.

    Collapses the identical prefix, names the first divergent step and lists the changed
    fields of every differing step (request, response, tool args and result, tokens, cost).
    Both signatures are checked first (--allow-unverified to compare a cassette signed
    with a key this machine does not have; it is then marked NOT VERIFIED).
    """
    from replayer.diff import compare, render

    a, b = (_load(c, allow_torn=True, allow_incomplete=True,
                  allow_unverified=allow_unverified) for c in (cassette_a, cassette_b))
    for c in (a, b):
        _warn_unverified(c)
    result = compare(a, b)
    if as_json:
        out = result.to_dict()
        out["signatures"] = {"a": a.verify_note, "b": b.verify_note}
        click.echo(json.dumps(out, indent=2, default=str))
    else:
        for label, c in (("a", a), ("b", b)):
            if not c.verified:
                click.secho(f"{label}: {c.path}: {c.verify_note}", fg="yellow", bold=True)
        click.echo(render(result))
    sys.exit(0 if result.same else EXIT_DIVERGED)


for command in (cli_runs.status, cli_runs.cancel, cli_stub.stub, cli_proxy.proxy,
                cli_export.export, cli_import.import_, cli_serve.worker, cli_serve.serve,
                cli_serve.submit, cli_serve.runs_, cli_serve.answer, cli_serve.schedule,
                cli_serve.check):
    main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    main()
