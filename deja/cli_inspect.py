"""``deja verify``, ``repair``, ``show``, ``ls``, ``diff`` and ``view``: looking at recorded
runs without running them (``repair`` alone writes, and only what a power loss left)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from deja._common import (
    EXIT_DIVERGED,
    BadInput,
    _allow_unverified_option,
    _fail,
    _fmt,
    _load,
    _print_table,
    _warn_unverified,
    shown,
    table_width,
)
from recorder.terminal import visible


@click.command()
@click.argument("cassette", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--allow-torn", is_flag=True, help="Check the intact part of a torn cassette.")
@click.option("--allow-incomplete", is_flag=True,
              help="Accept a cassette without an end line (a run still going, or crashed).")
@click.option("--json", "as_json", is_flag=True,
              help='Print the verdict as JSON: {"ok": true, "run", "steps", "verified", '
                   '"verify_note", "status", ...}, or {"ok": false, "error", "message"}.')
def verify(cassette: Path, allow_torn: bool, allow_incomplete: bool, as_json: bool) -> None:
    """Check a cassette's format, its signature chain and every line's contents; name
    the first bad line.

    Needs the key it was signed with (DEJA_KEY, the key file, or DEJA_OLD_KEYS). A
    cassette without its end line is refused: lines cut off at a line boundary leave no
    other trace (--allow-incomplete accepts a run that is still going or crashed).
    Exit 0 ok, 2 refused.
    """
    c = _load(cassette, require_signature=True, allow_torn=allow_torn,
              allow_incomplete=allow_incomplete, as_json=as_json, restore=True)
    from recorder.cassette.rows import step_count
    from recorder.cassette.schema import run_status
    from recorder.harness.progress import read_status

    # Without an end line the run's status record says more (a worker failed it).
    status = run_status(c.end, None if c.end else (read_status(c.run) or {}).get("status"))
    if as_json:
        click.echo(json.dumps({"ok": True, "path": str(cassette), "run": c.run,
                               "steps": step_count(c), "verified": c.verified,
                               "verify_note": c.verify_note, "status": status,
                               "end_line": c.end is not None,
                               "torn": c.torn_offset is not None}, indent=2))
        return
    end = status if c.end else f"{status} (no end line)"
    click.echo(visible(f"ok: {cassette}: run {c.run}, {step_count(c)} steps, "
                       f"{c.verify_note}, end: {end}"))


@click.command()
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


@click.command()
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

    c = _load(cassette, allow_torn=True, allow_unverified=allow_unverified, as_json=as_json)
    _warn_unverified(c)
    rows, totals = step_rows(c), run_totals(c)
    summary = run_summary(c, rows=rows, totals=totals)
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
    said = [f"run {summary['run']}  status {summary['status']}  created {summary['created']}"]
    if summary["parent_run"]:
        said.append(f"  forked from {summary['parent_run']} at step {summary['parent_step']}")
    said += [f"  fork {child['run']} at step {child['step']}: {child['path']}"
             for child in children]
    said.append(f"  {summary['steps']} steps: {describe_totals(summary)}; "
                f"{summary['verify_note']}")
    said += [f"    {line}" for line in describe_split(totals)]
    click.echo(visible("\n".join(said)))  # a header's text is the cassette's
    for row in rows:
        row["tokens"] = (f"{row['input_tokens']}/{row['output_tokens']}"
                         if row["input_tokens"] is not None else None)
    _print_table(rows, ["seq", "kind", "name", "status", "tokens", "cost_usd", "ms", "error"])


@click.command(name="ls")
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
    table = Table(title=shown(f"runs in {directory}"), header_style="bold", box=box.SIMPLE_HEAD)
    for col in columns:
        table.add_column(col, no_wrap=col == "run", overflow="fold", min_width=keep.get(col))
    for row in cells:
        table.add_row(*(shown(row[c]) for c in columns))
    Console(width=width).print(table)


@click.command()
@click.argument("cassettes", nargs=-1, required=True,
                type=click.Path(path_type=Path, dir_okay=False), metavar="A B [C ...]")
@click.option("--json", "as_json", is_flag=True,
              help='Print the comparison as JSON (for three runs or more: {"runs", "rows": '
                   '[{"cells", "same", "changed"}], "first_divergence", "same"}).')
@_allow_unverified_option
def diff(cassettes: tuple[Path, ...], as_json: bool, allow_unverified: bool) -> None:
    """Compare runs step by step. Exit 0 same, 1 different, 2 bad cassette.

    The runs are aligned by what their steps mean (the longest common subsequence of
    their steps), so a step one run has and another has not leaves the rest aligned. Two
    runs: collapses the identical prefix, names the first divergent step and lists the
    changed fields of every differing step (request, response, tool args and result,
    tokens, cost). Three runs or more: a column per run and a row per aligned step, each
    run compared with the first (A), its first divergence from A marked. Every signature
    is checked first (--allow-unverified to compare a cassette signed with a key this
    machine does not have; it is then marked NOT VERIFIED).
    """
    from replayer.diff import compare, render

    if len(cassettes) < 2:
        raise BadInput("deja diff compares two runs or more: give at least two cassettes")
    loaded = [_load(c, allow_torn=True, allow_incomplete=True,
                    allow_unverified=allow_unverified, as_json=as_json) for c in cassettes]
    for c in loaded:
        _warn_unverified(c)
    if len(loaded) > 2:
        _diff_many(loaded, as_json)
    result = compare(loaded[0], loaded[1], align="meaning")
    if as_json:
        out = result.to_dict()
        out["signatures"] = {"a": loaded[0].verify_note, "b": loaded[1].verify_note}
        click.echo(json.dumps(out, indent=2, default=str))
    else:
        for label, c in zip(("a", "b"), loaded, strict=True):
            if not c.verified:
                click.secho(f"{label}: {c.path}: {c.verify_note}", fg="yellow", bold=True)
        click.echo(render(result))
    sys.exit(0 if result.same else EXIT_DIVERGED)


def _diff_many(loaded: list[Any], as_json: bool) -> NoReturn:
    """``deja diff`` of three runs or more: a column per run (see
    :mod:`replayer.diff_many`); exits 0 when every run means the same as the first."""
    from replayer.diff_many import TAGS, compare_many, dumps

    if len(loaded) > len(TAGS):
        raise BadInput(f"deja diff compares up to {len(TAGS)} runs, not {len(loaded)}")
    result = compare_many(loaded)
    if as_json:
        click.echo(dumps(result, signatures={tag: c.verify_note
                                             for tag, c in zip(TAGS, loaded, strict=False)}))
    else:
        for tag, c in zip(TAGS, loaded, strict=False):
            if not c.verified:
                click.secho(f"{tag}: {c.path}: {c.verify_note}", fg="yellow", bold=True)
        click.echo(result.render())
    sys.exit(0 if result.same else EXIT_DIVERGED)


@click.command()
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
    from deja.runs.auth import server_token
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
    argv = _streamlit_argv(Path(viewer.__file__).resolve().parent, port, allow_hosts,
                           directory)
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
    sys.exit(_run_streamlit(argv, env, terminated))


def _streamlit_argv(package: Path, port: int, allow_hosts: tuple[str, ...],
                    directory: Path) -> list[str]:
    """``streamlit run`` of the viewer's ``serve.py`` (the page script behind the viewer's
    Host and Origin checks) on 127.0.0.1:``port``, with Streamlit's own checks on too."""
    from streamlit import config as streamlit_config

    argv = [sys.executable, "-m", "streamlit", "run", str(package / "serve.py"),
            "--server.address", "127.0.0.1", "--server.port", str(port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--client.toolbarMode", "viewer",  # no Deploy button, no developer menu
            "--server.enableCORS", "true", "--server.enableXsrfProtection", "true",
            # No "magic": the page scripts are compiled from their text, without the
            # ast.parse that Python 3.11 cannot run while another thread formats a
            # traceback ("AST constructor recursion depth mismatch"); they use no magic.
            "--runner.magicEnabled", "false"]
    if "server.allowedHosts" in streamlit_config.get_config_options():  # its own check too
        for name in ("localhost", "127.0.0.1", "::1", *allow_hosts):
            argv += ["--server.allowedHosts", name.strip("[]")]
    if "logger.hideWelcomeMessage" in streamlit_config.get_config_options():
        argv += ["--logger.hideWelcomeMessage", "true"]  # its address lacks the token
    return [*argv, "--", str(directory)]


def _run_streamlit(argv: list[str], env: dict[str, str], terminated: list[int]) -> int:
    """Run the viewer's server until it stops; a SIGTERM (or one that came while it
    started, in ``terminated``) stops it with us. Its exit status."""
    import signal

    from recorder.harness.child import wait

    process = subprocess.Popen(argv, env=env)
    signal.signal(signal.SIGTERM, lambda *_: process.terminate())
    if terminated:
        process.terminate()
    try:
        return wait(process)  # a SIGTERM that lands just before the wait stops it too
    except KeyboardInterrupt:  # the viewer has the same Ctrl-C and stops on its own
        try:
            return process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()
