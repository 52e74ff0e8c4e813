"""``deja drift``: run a recorded program live again and see whether the provider still
answers as it did (:mod:`replayer.drift`)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from deja._common import (
    EXIT_DIVERGED,
    BadInput,
    RunsCommand,
    _allow_unverified_option,
    _cwd_option,
    _fail,
    _header_run,
    _load,
    _no_command,
    _warn_unverified,
)
from deja._launch import _launch, _where_to_run, _writer_lock


def base_url_env(url: str) -> dict[str, str]:
    """The environment that points every SDK deja records at the server ``url``
    (:func:`recorder.providers.base_url_env`), checked."""
    from recorder import providers

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BadInput(f"--base-url {url!r} is not an http:// or https:// address")
    return providers.base_url_env(url)


@contextlib.contextmanager
def _program_output_on_stderr(on: bool) -> Iterator[None]:
    """While the program runs, its standard output goes to our standard error (``--json``
    keeps stdout for the report)."""
    if not on:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _recorded_settings(header: Mapping[str, Any]) -> dict[str, Any]:
    """What the live run is recorded with: the recorded run's guards, budgets, redaction
    and fsync, so that both runs are written (and redacted) alike."""
    def table(key: str) -> dict[str, Any]:
        value = header.get(key)
        return value if isinstance(value, dict) else {}

    redact, loop, breaker, labels = (table(k) for k in ("redact", "loop", "breaker", "labels"))
    budgets = table("budgets")

    def strings(key: str) -> list[str]:
        value = redact.get(key)
        return [str(v) for v in value] if isinstance(value, list) else []

    return {"redact_headers": strings("headers"), "redact_body": strings("body_paths"),
            "redact_patterns": strings("patterns"), "redact_query": strings("query"),
            "budgets": budgets or None,
            "loop_guard": loop.get("enabled", True) is not False,
            "breaker": breaker.get("enabled", True) is not False,
            "fsync": header.get("fsync") if isinstance(header.get("fsync"), str) else None,
            "labels": {**labels, "drift_of": str(header.get("run"))}}


def _live_file(cassette: Path, output: Path | None, force: bool, run_id: str,
               tmp: str) -> Path:
    """Where the live run is recorded: ``-o``'s file (or ``<run id>.jsonl`` in its
    directory), refused if it exists unless ``--force`` and never the recorded cassette;
    else a temporary file."""
    from recorder.cassette.schema import run_file
    from recorder.errors import ConfigError

    if output is None:
        return Path(tmp) / f"{run_id}.jsonl"
    try:
        path = run_file(output, run_id)
    except ConfigError as exc:
        _fail(exc)
    if path.resolve() == cassette.resolve():
        raise BadInput(f"-o {output} is the recorded cassette: deja drift never writes it; "
                       "choose another file")
    if path.exists() and not force:
        raise BadInput(f"{path} already exists; pass --force to overwrite it or choose "
                       "another -o")
    return path


def _command(cassette: Path, loaded: Any, command: tuple[str, ...],
             run_recorded_command: bool) -> list[str]:
    """The command to run live: CMD, else the recorded one (never an unverified
    header's, unless --run-recorded-command)."""
    header = loaded.header
    if isinstance(header.get("proxy"), dict):
        raise BadInput(
            f"{cassette} was recorded through deja proxy, from an agent deja did not launch: "
            "deja drift does not run it. Record it again through the proxy (deja proxy "
            "--dir DIR --upstream URL, the agent pointed at it) and compare the two: deja "
            f"drift {cassette} --against DIR/<run>.jsonl")
    recorded = list(header.get("argv") or [])
    if not loaded.verified and not command and not run_recorded_command:
        raise BadInput(
            f"{cassette}: {loaded.verify_note}. deja does not run the command an unverified "
            f"header names ({' '.join(recorded) or '(none)'}), since anyone could have "
            f"written it there. Give the command yourself: deja drift {cassette} "
            "--allow-unverified -- CMD ..., or pass --run-recorded-command if you have read "
            "it and trust it")
    argv = list(command) or recorded
    if not argv:
        raise _no_command(cassette, header, "replay")
    return argv


def _run_live(argv: list[str], cwd: Path | None, path: Path, run_id: str,
              header: Mapping[str, Any], as_json: bool) -> None:
    """Record ``argv`` live into ``path`` as run ``run_id``, as ``deja record`` does; a
    program that did not start recording is bad input (nothing to compare)."""
    lock = _writer_lock(path, run_id, "deja drift")
    try:
        with _program_output_on_stderr(as_json):
            code = _launch("record", argv, path, cwd, lock=lock,
                           cassette=str(path.resolve()), run_id=run_id, argv=argv,
                           overwrite=True, **_recorded_settings(header)).status
    finally:
        lock.release()
    if _header_run(path) != run_id:
        raise BadInput(f"the program (exit status {code}) did not start recording (see the "
                       "message above): there is no live run to compare")


def _report(loaded: Any, live: Path | Any, kept: bool, as_json: bool,
            allow_unverified: bool) -> None:
    """Compare, print the report (or its JSON) and exit: 0 nothing changed, 1 changed."""
    from dataclasses import replace

    from recorder.errors import DejaError
    from replayer.drift import drift as compare_runs
    from replayer.drift import dumps

    try:
        report = replace(compare_runs(loaded, live, allow_unverified=allow_unverified or None),
                         live_kept=kept)
    except DejaError as exc:
        _fail(exc)
    click.echo(dumps(report) if as_json else report.render())
    sys.exit(EXIT_DIVERGED if report.changed else 0)


@click.command(cls=RunsCommand)
@click.argument("cassette", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--base-url", metavar="URL",
              help="Point the program's SDKs at this server instead of the provider: sets "
                   "ANTHROPIC_BASE_URL, ANTHROPIC_BEDROCK_BASE_URL, GOOGLE_GEMINI_BASE_URL "
                   "and OPENAI_BASE_URL (with /v1). Default: the program's own environment.")
@click.option("-o", "--output", "output", type=click.Path(path_type=Path),
              help="Keep the live run in this cassette file (or <run id>.jsonl in this "
                   "directory). Default: a temporary file, removed.")
@click.option("--force", is_flag=True,
              help="Overwrite -o's file if it exists (never the recorded cassette).")
@click.option("--against", type=click.Path(path_type=Path, dir_okay=False),
              help="Compare with this run, recorded already (through deja proxy, say), "
                   "instead of running the program.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON on stdout (the program's own output goes to "
                   "stderr).")
@_allow_unverified_option
@click.option("--run-recorded-command", is_flag=True,
              help="Run the command an unverified cassette's header names (never done "
                   "without this flag or -- CMD: the header is not checked).")
@_cwd_option
def drift(cassette: Path, command: tuple[str, ...], base_url: str | None,
          output: Path | None, force: bool, against: Path | None, as_json: bool,
          allow_unverified: bool, run_recorded_command: bool, cwd: Path | None) -> None:
    """Has the provider drifted? deja drift CASSETTE [-- CMD ...].

    Runs the recorded command (or CMD) live, recorded as deja record does (with the
    recorded run's guards and redaction) into a temporary cassette, or -o NEW to keep it,
    and compares it with CASSETTE step by step: same, equivalent (only token counts,
    cost, the serving model's snapshot and effect values differ) or changed, with the
    changed fields (recorded -> live). Steps after the first change are counted as after
    it, not as drifts of their own. Both runs' SDK, model and API versions are shown.
    The API keys are the program's own. CASSETTE is never written. A run recorded through
    deja proxy is not run: record it again there and compare with --against.
    Exit 0 nothing changed (same or equivalent), 1 changed, 2 bad input.
    """
    loaded = _load(cassette, as_json=as_json, allow_unverified=allow_unverified,
                   allow_incomplete=True)
    if against is not None:
        if command or base_url or output is not None:
            raise BadInput("--against compares two recorded runs: it runs nothing, so it "
                           "takes no command, --base-url or -o")
        live = _load(against, as_json=as_json, allow_unverified=allow_unverified,
                     allow_incomplete=True)
        _warn_unverified(live)
        _report(loaded, live, True, as_json, allow_unverified)
    argv = _command(cassette, loaded, command, run_recorded_command)
    _warn_unverified(loaded)
    env = base_url_env(base_url) if base_url is not None else {}
    where = _where_to_run(cassette, loaded.header, argv, given=bool(command), cwd=cwd)
    from recorder.launch import new_run_id

    run_id = new_run_id()
    with tempfile.TemporaryDirectory(prefix="deja-drift-") as tmp:
        path = _live_file(cassette, output, force, run_id, tmp)
        os.environ.update(env)  # the program's environment, for the child deja starts
        _run_live(argv, where, path, run_id, loaded.header, as_json)
        _report(loaded, path, output is not None, as_json, allow_unverified)
