"""What every ``deja`` command shares: its errors and exit statuses, the options several
commands take, loading a cassette for a command, and printing."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

EXIT_DIVERGED = 1
EXIT_BAD = 2


class BadInput(click.ClickException):
    exit_code = EXIT_BAD


def _fail(exc: Exception) -> NoReturn:
    raise BadInput(f"{type(exc).__name__}: {exc}") from exc


class RunsCommand(click.Command):
    """A command that runs a program given after ``--``: a mistyped deja option is
    click's usual "No such option", never the program to run, and the error says where
    the program's own options go."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            raise click.UsageError(
                f"{exc.format_message()}\n(a program's own options go after --: "
                f"deja {self.name} ... -- python agent.py --its-option)", ctx) from None


class ReplayCommand(RunsCommand):
    """``deja replay``'s parsing: click alone cannot tell where the cassettes end and the
    command begins, so the first ``--`` splits them; what comes before it is parsed as
    usual (options anywhere, the cassettes and directories), what comes after it is the
    command, given to the callback as ``command`` (None when there is no ``--``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        command = None
        if "--" in args:
            at = args.index("--")
            args, command = args[:at], args[at + 1:]
        args = _then_stub_script(args)
        rest = super().parse_args(ctx, args)
        ctx.params["command"] = tuple(command) if command is not None else None
        return rest

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[-- CMD ...]"]


def _then_stub_script(args: list[str]) -> list[str]:
    """``--then stub SCRIPT`` as click takes it: ``--then stub --then-script SCRIPT``."""
    out = list(args)
    for n, word in enumerate(out[:-2]):
        if word == "--then" and out[n + 1] == "stub" and not out[n + 2].startswith("-"):
            out[n + 2:n + 2] = ["--then-script"]
            break
    return out


def _allow_unverified_option(func: Any) -> Any:
    return click.option(
        "--allow-unverified", is_flag=True,
        help="Use a cassette whose signature cannot be checked here (signed with a key "
             "this machine does not have; also DEJA_ALLOW_UNVERIFIED=1). Its output says "
             "NOT VERIFIED.")(func)


def _cwd_option(func: Any) -> Any:
    return click.option(
        "--cwd", type=click.Path(path_type=Path, file_okay=False, exists=True),
        help="Run the command in this directory (default: the directory it was recorded "
             "in, found from where the cassette lies; with -- CMD, this one).")(func)


def restored(loaded: Any) -> None:
    """Every line of a loaded cassette restored whole once: one found malformed only
    then raises here (CorruptCassette), before a command uses or serves any of it."""
    for _ in loaded.observations:
        pass


def _load(cassette: Path, *, as_json: bool = False, restore: bool = False,
          **options: Any) -> Any:
    """Load (and check) a cassette for a command; a bad one exits 2 with a named error
    (with ``as_json``, for a command asked for ``--json``, also as JSON on stdout:
    ``{"ok": false, "error": NAME, "message": ..., "path": ...}``). ``restore``: every
    line is also restored whole once, so that one found malformed only then is refused
    here too."""
    from recorder.cassette import load
    from recorder.errors import DejaError

    if options.get("allow_unverified") is False:
        options["allow_unverified"] = None  # no flag: the environment may still allow it
    try:
        loaded = load(cassette, **options)
        if restore:
            restored(loaded)
        return loaded
    except DejaError as exc:
        if as_json:
            json_refusal(type(exc).__name__, str(exc), cassette)
        _fail(exc)


def json_refusal(error: str, message: str, path: Path | str | None = None) -> None:
    """What a command asked for ``--json`` prints on stdout when it refuses, before it
    exits 2: ``{"ok": false, "error": NAME, "message": ..., "path": ...}``."""
    said: dict[str, Any] = {"ok": False, "error": error, "message": message}
    if path is not None:
        said["path"] = str(path)
    click.echo(json.dumps(said, indent=2))


def _warn_unverified(cassette: Any) -> None:
    if not cassette.verified:
        click.secho(f"deja: WARNING: {cassette.path}: {cassette.verify_note}. Its content is "
                    "shown as recorded, unchecked.", err=True, fg="yellow")


def _python_argv(argv: list[str]) -> list[str]:
    """Run a recorded ``python ...`` command with this interpreter (the one deja runs in)."""
    if argv and Path(argv[0]).name.startswith("python"):
        return [sys.executable, *argv[1:]]
    return argv


def _print_table(rows: list[dict[str, Any]], columns: list[str], title: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=shown(title) if title is not None else None, show_lines=False,
                  header_style="bold")
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*(shown("" if row.get(c) is None else _fmt(row.get(c))) for c in columns))
    Console(width=table_width()).print(table)


def shown(value: str) -> Any:
    """``value`` as a table shows it (a :class:`rich.text.Text`): as it is, never read as
    rich's markup or emoji codes (a cassette's names, labels and errors are data, and
    ``[/]`` in one would stop the table with a traceback), each character a terminal would
    act on written as its escape (:func:`recorder.terminal.visible`)."""
    from rich.text import Text

    from recorder.terminal import visible

    return Text(visible(value))


def table_width() -> int:
    """On a terminal, its width (at least 100); piped or captured, wide enough that no
    column is cut whatever ``COLUMNS`` says."""
    if sys.stdout.isatty():
        return max(100, shutil.get_terminal_size((120, 20)).columns)
    return 200


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6f}".rstrip("0").rstrip(".") if value < 1 else f"{value:.3f}"
    return str(value)


def _header_run(path: Path) -> str | None:
    """The run id a cassette's first line names (None: no such file, or not a cassette)."""
    from recorder.cassette.reader import peek_header

    header = peek_header(path)
    return header.get("run") if header is not None else None


def _no_command(cassette: Path, header: Any, verb: str) -> BadInput:
    """The error of a replay, fork or resume of a cassette that records no command to run:
    for a run recorded through ``deja proxy``, how to do it there."""
    if isinstance(header, dict) and isinstance(header.get("proxy"), dict):
        how = {"replay": f"deja proxy --replay {cassette}",
               "fork": f"deja proxy --fork {cassette} --at STEP --set PATH=VALUE",
               "resume": f"deja proxy --fork {cassette} --at STEP (with the last step "
                         "as it was, or edited)"}[verb]
        return BadInput(f"{cassette} was recorded through deja proxy, from an agent deja did "
                        f"not launch: {verb} it there ({how}) and point the agent at that "
                        "proxy (ANTHROPIC_BASE_URL), or give the command after --")
    return BadInput(f"{cassette} records no command; give one after --")


def _labels(items: tuple[str, ...]) -> dict[str, str]:
    """``--label KEY=VALUE`` options as a dict (a malformed one is click's usage error)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--label")
        out[key] = value
    return out


def _read_json_file(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"{what} {path}: {exc}") from None


def _pid_gone(pid: Any) -> bool:
    """Process ``pid`` of this host has exited (a zombie nobody has reaped yet included)."""
    try:
        pid = int(pid or 0)
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, TypeError):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def _stack(func: Any, options: list[Any]) -> Any:
    for option in reversed(options):
        func = option(func)
    return func


def guard_options(per: str = "") -> Any:
    """The harness's budget and guard flags (``deja record``, ``proxy``, ``submit``);
    :func:`budgets_of` turns them into ``[tool.deja.budgets]`` form. ``per`` says what a
    budget is counted over ("per run" for the proxy's many runs)."""
    budget = f"Budget{' ' + per if per else ''}"

    def decorate(func: Any) -> Any:
        return _stack(func, [
            click.option("--max-turns", type=click.IntRange(min=0),
                         help=f"{budget}: model turns."),
            click.option("--max-tokens", "max_tokens_total", type=click.IntRange(min=0),
                         help=f"{budget}: cumulative input + output tokens."),
            click.option("--max-tokens-per-turn", type=click.IntRange(min=0),
                         help="Ceiling on a request's max_tokens; a request asking for more "
                              "is refused."),
            click.option("--clamp-max-tokens", is_flag=True,
                         help="Clamp a request over the per-turn ceiling instead of refusing "
                              "it."),
            click.option("--max-seconds", type=click.FloatRange(min=0),
                         help=f"{budget}: wall-clock seconds."),
            click.option("--max-dollars", type=click.FloatRange(min=0),
                         help=f"{budget}: dollars, from the price table."),
            click.option("--no-loop-guard", is_flag=True,
                         help="Do not stop repeated identical tool calls."),
            click.option("--no-breaker", is_flag=True,
                         help="Do not use the per-host circuit breaker."),
        ])
    return decorate


def budgets_of(max_turns: int | None = None, max_tokens_total: int | None = None,
               max_tokens_per_turn: int | None = None, clamp_max_tokens: bool = False,
               max_seconds: float | None = None, max_dollars: float | None = None,
               **_other: Any) -> dict[str, Any]:
    """The budgets given by :func:`guard_options`' flags, in settings form."""
    return {k: v for k, v in {
        "turns": max_turns, "tokens": max_tokens_total, "max_tokens": max_tokens_per_turn,
        "seconds": max_seconds, "dollars": max_dollars,
        "max_tokens_mode": "clamp" if clamp_max_tokens else None}.items() if v is not None}


def redaction_options(func: Any) -> Any:
    """What else to keep out of a cassette, beyond the defaults (``record``, ``proxy``)."""
    return _stack(func, [
        click.option("--redact-header", "redact_headers", multiple=True, metavar="NAME",
                     help="Another header never to write (authorization, x-api-key and "
                          "cookies always are)."),
        click.option("--redact-body", "redact_body", multiple=True, metavar="POINTER",
                     help="A JSON pointer into request bodies never to write, e.g. "
                          "/metadata/user_id (repeatable)."),
        click.option("--redact-pattern", "redact_patterns", multiple=True, metavar="REGEX",
                     help="A regular expression for secrets to redact wherever they appear; "
                          "with a group, only the group (repeatable). Key shapes (sk-..., "
                          "AKIA..., ghp_..., JWTs) always are."),
        click.option("--redact-query", "redact_query", multiple=True, metavar="NAME",
                     help="Another query parameter whose value is never written (key, "
                          "token, access_token, signature ... always are)."),
    ])


def policy_options(func: Any) -> Any:
    """What may differ between the recording and the replay (``replay``, ``proxy``)."""
    return _stack(func, [
        click.option("--ignore", "ignore", multiple=True, metavar="POINTER",
                     help="A JSON pointer left out of every request when it is matched, "
                          "such as /metadata/user_id; * stands for any key or index "
                          "(repeatable)."),
        click.option("--normalise", "--normalize", "normalise", multiple=True,
                     metavar="PATTERN=REPLACEMENT",
                     help="Rewrite every string of a request before it is matched, such as "
                          "'[0-9]{4}-[0-9]{2}-[0-9]{2}=DATE' for today's date in a prompt "
                          "(repeatable)."),
    ])


def replay_policy(ignore: tuple[str, ...], normalise: tuple[str, ...],
                  *, configured: bool = False) -> Any:
    """The :class:`replayer.policy.ReplayPolicy` of ``--ignore`` and ``--normalise``,
    checked here, before anything runs; ``configured``: added to the project's
    ``[tool.deja.match]`` and the providers' declared volatile fields, as a replay does."""
    from recorder.errors import ConfigError
    from replayer.policy import ReplayPolicy

    try:
        given = ReplayPolicy.parse(ignore, normalise)
        return ReplayPolicy.configured(given) if configured else given
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


def then_options(where: str) -> Any:
    """``--then live|stub SCRIPT`` (SCRIPT reaches the command as the hidden
    ``--then-script``, see :class:`ReplayCommand`); ``where``: where the
    new cassette goes, for the help."""
    def add(func: Any) -> Any:
        func = click.option("--then-script", type=click.Path(path_type=Path, dir_okay=False,
                                                             exists=True), hidden=True)(func)
        return click.option(
            "--then", "then", type=click.Choice(["live", "stub"]),
            help="Replay until the program asks for something the recording does not hold, "
                 "then go live (live: the program's own base URL; stub SCRIPT: a stub "
                 f"serving SCRIPT) into a new cassette {where}.")(func)
    return add


def tool_policy_options(func: Any) -> Any:
    """``--live-tool NAME`` and ``--tool NAME=RULE``: the tool policy of a run's live part
    (:mod:`replayer.tool_policy`)."""
    func = click.option(
        "--tool", "tool_rules", multiple=True, metavar="NAME=RULE",
        help="What tool NAME does in the live part (after the fork step; with --then, once "
             "the program leaves the recording): live, recorded (the recorded "
             "answer to the same arguments, else refused), refuse, or static:JSON. NAME * "
             "is every tool without a rule of its own (but *=live never runs a side "
             "effect).")(func)
    return click.option(
        "--live-tool", "live_tools", multiple=True, metavar="NAME",
        help="Run side-effecting tool NAME for real in the live part. Without it a "
             "tool declared side_effect=True never runs live: it is served its recorded "
             "answer, or refused.")(func)


def tool_policy(rules: tuple[str, ...], live: tuple[str, ...]) -> Any:
    """The :class:`replayer.tool_policy.ToolPolicy` of ``--tool`` and ``--live-tool``,
    checked before anything runs."""
    from recorder.errors import ConfigError
    from replayer.tool_policy import ToolPolicy

    try:
        return ToolPolicy.parse(rules, live)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


def policy_rows(path: Path) -> list[str]:
    """The report's rows of the tool calls a run's tool policy answered without running
    them (its lines marked ``policy``), read back from the cassette."""
    from recorder.cassette import load
    from recorder.errors import DejaError

    try:
        run = load(path, allow_incomplete=True, allow_torn=True, allow_unverified=True)
    except DejaError:  # the run's own report said what is wrong with it
        return []
    rows = []
    for obs in run.observations:
        rule = obs.get("policy")
        if not rule:
            continue
        said = {"refuse": "refused: not run",
                "static": "not run: answered with the static value given",
                "recorded": "not run: served the recorded answer"}.get(str(rule), str(rule))
        source = obs.get("from")
        if isinstance(source, dict):
            said += f" (run {source.get('run')} step {source.get('seq')})"
        rows.append(f"  step {obs['seq']}: tool {obs.get('name')!r} {said}")
    return rows
