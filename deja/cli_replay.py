"""What ``deja replay`` does: replay one cassette, or many in turn, and report for a person
(the report, a summary table), for a program (``--json``) and for CI (``--junit``, GitHub
Actions annotations).

The command line is ``deja replay CASSETTE|DIR... [-- CMD ...]``: everything before ``--``
is a cassette or a directory (its ``*.jsonl`` files, sorted), everything after it the
command to run. One cassette prints what it always did; several (or a directory) also end
with a table. The click command itself, its options and its help, is in :mod:`deja.cli`; its parsing
(:class:`deja._common.ReplayCommand`) in :mod:`deja._common`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from deja import cli_proxy
from deja._common import (
    EXIT_DIVERGED,
    BadInput,
    _header_run,
    _load,
    _no_command,
    _print_table,
    _python_argv,
    _warn_unverified,
    json_refusal,
    replay_policy,
)
from deja._launch import _where_to_run
from replayer.ci import Outcome, annotation, summary, write_junit
from replayer.result import render

if TYPE_CHECKING:
    from replayer.policy import ReplayPolicy

# What deja cannot do for an agent it sees only through the proxy.
PROXY_TOOLS_WARNING = ("deja: WARNING: this run was recorded through deja proxy: deja serves "
                       "the model's answers, but the agent's own tools run in its process, "
                       "for real, as they did when it was recorded")
TABLE = ["cassette", "run", "verdict", "steps", "divergence", "seconds"]


@dataclass(frozen=True)
class ReplayOptions:
    """How to replay each cassette: the flags of ``deja replay``. ``many``: one of several
    (the program's output and the reports go to stderr, the table to stdout);
    ``wants_result``: the result is needed after the replay (for a table, a JUnit report
    or an annotation), even of a run replayed through the proxy."""

    require_signature: bool = False
    allow_unverified: bool = False
    run_recorded_command: bool = False
    allow_torn: bool = False
    allow_incomplete: bool = False
    as_json: bool = False
    ignore: tuple[str, ...] = ()
    normalise: tuple[str, ...] = ()
    cwd: Path | None = None
    many: bool = False
    wants_result: bool = False
    # --then live|stub: replay until the program leaves the recording, then live (or
    # against a stub serving then_script) into ``output``, under the tool policy
    then: str | None = None
    then_script: Path | None = None
    output: Path | None = None
    tool_rules: tuple[str, ...] = ()
    live_tools: tuple[str, ...] = ()
    cold: bool = False  # of many: each program in a fresh interpreter, not a warm fork

    @property
    def quiet_stdout(self) -> bool:
        """The program's own output goes to stderr: stdout is kept for JSON or a table."""
        return self.as_json or self.many


def run(words: Sequence[str], command: Sequence[str] | None, opts: ReplayOptions, *,
        junit: Path | None = None, junit_cases: str = "cassettes") -> NoReturn:
    """Replay the cassettes ``words`` name, each with ``command`` (or its recorded one),
    and exit: one cassette with its own status (0 passed, 1 diverged, 2 bad cassette);
    many with 2 when one could not be judged, else 1 when one diverged, else 0."""
    replay_policy(opts.ignore, opts.normalise)  # a bad pointer or pattern: before anything runs
    words, command = _split(words, command)
    cassettes, many = _expand(words)
    if opts.then is not None:
        sys.exit(then_live(cassettes, command, opts, many=many))
    if opts.output is not None or opts.tool_rules or opts.live_tools:
        raise BadInput("-o, --tool and --live-tool go with --then live or --then stub SCRIPT: "
                       "a replay alone writes nothing and runs no tool")
    opts = replace(opts, many=many, wants_result=many or junit is not None or _on_github())
    if many:
        sys.exit(_many(cassettes, command, opts, junit, junit_cases))
    outcome, failed = attempt(cassettes[0], command, opts)
    if outcome.result is not None:  # one cassette: its report on stdout, as always
        click.echo(json.dumps(outcome.result, indent=2) if opts.as_json else
                   render(outcome.result, outcome.code))
    _annotate(outcome, opts)
    _write_junit(junit, [outcome], junit_cases)
    if failed is not None:
        raise failed
    sys.exit(outcome.status)


def _split(words: Sequence[str],
           command: Sequence[str] | None) -> tuple[list[str], tuple[str, ...]]:
    """The cassettes and the command. Without ``--``, words that are not all cassettes
    (``deja replay C.jsonl python agent.py``) are one cassette and its command."""
    if command is None and len(words) > 1 and not all(
            Path(word).is_dir() or word.endswith(".jsonl") for word in words):
        return [words[0]], tuple(words[1:])
    return list(words), tuple(command or ())


def _expand(words: Sequence[str]) -> tuple[list[Path], bool]:
    """The cassette files (a directory's ``*.jsonl``, sorted; each file once) and whether
    there are many (more than one word, or a directory)."""
    found: list[Path] = []
    for word in words:
        path = Path(word)
        if path.is_dir():
            inside = sorted(path.glob("*.jsonl"))
            if not inside:
                raise BadInput(f"{word} holds no cassettes (no *.jsonl files)")
            found.extend(inside)
        else:
            found.append(path)
    first: dict[Path, Path] = {}
    for path in found:
        first.setdefault(path.resolve(), path)
    cassettes = list(first.values())
    return cassettes, len(words) > 1 or any(Path(word).is_dir() for word in words)


def attempt(cassette: Path, command: tuple[str, ...],
            opts: ReplayOptions) -> tuple[Outcome, click.ClickException | None]:
    """Replay one cassette, timed, without exiting (``deja replay`` of many, one incident
    of ``deja suite``); what kept it from being judged is its outcome's error (and handed
    back, for one cassette to exit with as it always did)."""
    started = time.monotonic()
    try:
        outcome, failed = replay_one(cassette, command, opts), None
    except click.ClickException as exc:
        outcome = Outcome(str(cassette), error=exc.format_message(),
                          run=_header_run(cassette))
        failed = exc
    return replace(outcome, seconds=round(time.monotonic() - started, 3)), failed


def _many(cassettes: list[Path], command: tuple[str, ...], opts: ReplayOptions,
          junit: Path | None, junit_cases: str) -> int:
    """Replay each cassette in turn, its report on stderr as it finishes, then the table
    (or the JSON document); the status to exit with. Unless ``opts.cold``, this process
    first imports what the programs need (:data:`replayer.suite.WARM_MODULES`) and each
    program that can be is a fork of it (:mod:`recorder.harness.warm`)."""
    if not opts.cold:
        _warm_up()
    outcomes = []
    for n, cassette in enumerate(cassettes, start=1):
        click.echo(f"deja: replaying {cassette} ({n}/{len(cassettes)})", err=True)
        outcome, failed = attempt(cassette, command, opts)
        if failed is not None:
            failed.show()
        else:
            click.echo(outcome.report(), err=True)
        _annotate(outcome, opts)
        outcomes.append(outcome)
    done = summary(outcomes)
    rows = done.pop("rows")
    if opts.as_json:
        click.echo(json.dumps({"results": [_json_of(o) for o in outcomes], "summary": done},
                              indent=2))
    else:
        _print_table(rows, TABLE, title=f"deja replay: {len(outcomes)} cassettes")
        click.echo(_totals(done))
    _write_junit(junit, outcomes, junit_cases)
    return int(done["exit_status"])


def _warm_up() -> None:
    """Import deja's bootstrap and the SDKs once (those installed), and let this process's
    programs start as forks of it: each saves the second or so a fresh interpreter takes
    to import an SDK. A fixed list: nothing in a cassette chooses what is imported."""
    from recorder.harness import warm
    from replayer.suite import WARM_MODULES

    warm.preload(WARM_MODULES)
    warm.mark_warm()


def _json_of(outcome: Outcome) -> dict[str, Any]:
    return {"cassette": outcome.cassette, "run": outcome.run_id, "verdict": outcome.verdict,
            "exit_status": outcome.exit_status, "seconds": outcome.seconds,
            "error": outcome.error, "result": outcome.result}


def _totals(done: dict[str, Any]) -> str:
    return (f"total: {done['cassettes']} cassettes, {done['passed']} passed "
            f"({done['identical']} identical, {done['equivalent']} equivalent), "
            f"{done['diverged']} diverged, {done['error']} not judged, in "
            f"{done['seconds']:.2f}s; exit status {done['exit_status']}")


def _on_github() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


def _annotate(outcome: Outcome, opts: ReplayOptions) -> None:
    """On GitHub Actions, the outcome's workflow command (an error or a notice): on stdout,
    or with --json on stderr, which GitHub reads them from too."""
    if _on_github():
        line = annotation(outcome)
        if line is not None:
            click.echo(line, err=opts.as_json)


def _write_junit(junit: Path | None, outcomes: list[Outcome], cases: str) -> None:
    if junit is None:
        return
    try:
        write_junit(junit, outcomes, cases)
    except OSError as exc:
        raise BadInput(f"cannot write the JUnit report {junit}: {exc.strerror or exc}") from None


# --------------------------------------------------------------------------- one cassette

def replay_one(cassette: Path, command: tuple[str, ...], opts: ReplayOptions) -> Outcome:
    """Replay one cassette with ``command`` (or the one it records) and hand back what it
    found; a cassette that cannot be replayed raises :class:`BadInput` (exit 2)."""
    loaded = _load(cassette, as_json=opts.as_json and not opts.many,
                   require_signature=opts.require_signature,
                   allow_unverified=opts.allow_unverified, allow_torn=opts.allow_torn,
                   allow_incomplete=opts.allow_incomplete)
    recorded = list(loaded.header.get("argv") or [])
    if not loaded.verified and not command and not opts.run_recorded_command:
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
    cwd = _where_to_run(cassette, loaded.header, argv, given=bool(command), cwd=opts.cwd)
    project = _project_match(cwd or Path.cwd())  # checked before the program runs
    if isinstance(loaded.header.get("proxy"), dict):  # an agent in any language
        click.secho(PROXY_TOOLS_WARNING, err=True, fg="yellow")
        return _through_proxy(cassette, loaded.verified, argv, cwd, project, opts)
    return _in_process(cassette, loaded.verified, argv, cwd, opts)


def _project_match(cwd: Path) -> ReplayPolicy:
    """The ``[tool.deja.match]`` of the project the program runs in (what it adds to a
    replay's policy), checked before the program runs."""
    from recorder.errors import ConfigError
    from replayer.policy import ReplayPolicy

    try:
        return ReplayPolicy.configured(start=cwd)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


def _in_process(cassette: Path, verified: bool, argv: list[str], cwd: Path | None,
                opts: ReplayOptions) -> Outcome:
    """Run a Python program under the bootstrap, replaying the cassette in its process."""
    from deja import launcher
    from deja.boot import child_env

    with tempfile.TemporaryDirectory(prefix="deja-replay-") as tmp:
        report = Path(tmp) / "report.json"
        env = child_env("replay", cassette=str(cassette.resolve()), report=str(report),
                        allow_torn=opts.allow_torn, allow_incomplete=opts.allow_incomplete,
                        require_signature=opts.require_signature,
                        allow_unverified=not verified, ignore=opts.ignore,
                        normalise=opts.normalise)
        try:
            ended = launcher.run(_python_argv(argv), env=env, cwd=cwd,
                                 stdout=sys.stderr.fileno() if opts.quiet_stdout else None)
        except OSError as exc:
            raise BadInput(f"cannot run {argv[0]!r}: {exc.strerror or exc}") from None
        if ended.received is not None:  # stopped by the user: no further cassette either
            click.echo(f"deja: replay stopped by signal {ended.received}", err=True)
            sys.exit(ended.status)
        if not report.exists():
            raise BadInput(f"the program exited with status {ended.status} before the replay "
                           "could report (see the message above)")
        result = json.loads(report.read_text())
    failed = result.get("failed")
    if failed is not None:  # a line found malformed when the replay restored it
        if opts.as_json and not opts.many:
            json_refusal(failed["error"], failed["message"], cassette)
        raise BadInput(f"{failed['error']}: {failed['message']}")
    return Outcome(str(cassette), result=result, code=ended.status,
                   status=0 if result["identical"] else EXIT_DIVERGED)


def _through_proxy(cassette: Path, verified: bool, argv: list[str], cwd: Path | None,
                   project: ReplayPolicy, opts: ReplayOptions) -> Outcome:
    """Run the program against ``deja proxy --replay`` (an agent in any language)."""
    policy = [*(f"--ignore={p}" for p in (*opts.ignore, *project.ignore)),
              *(f"--normalise={n}" for n in opts.normalise),
              *(f"--normalise={p}={r}" for p, r in project.normalise)]
    args = ["--replay", str(cassette.resolve()), *policy,
            *([] if verified else ["--allow-unverified"])]
    if not opts.wants_result:  # one cassette and nothing to write of it: the proxy reports
        return Outcome(str(cassette), status=cli_proxy.through_proxy(args, argv, cwd))
    with tempfile.TemporaryDirectory(prefix="deja-replay-") as tmp:
        report = Path(tmp) / "report.json"
        # through_proxy gives the proxy a --report-file of its own, before these arguments,
        # and prints the report it finds there; click keeps an option's last value, so the
        # proxy writes this one instead, and the report is printed with the others.
        with _stdout_to_stderr(opts.quiet_stdout):
            status = cli_proxy.through_proxy([*args, "--report-file", str(report)], argv, cwd)
        if not report.is_file():
            raise BadInput(f"the replay through deja proxy ended with status {status} before "
                           "it could report (see the message above)")
        result = json.loads(report.read_text())
    # through_proxy hands back the proxy's status when it failed (1: diverged), else the
    # program's: the program's is known when the replay passed.
    return Outcome(str(cassette), result=result,
                   code=status if result["identical"] else None, status=status)


@contextlib.contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    """While ``active``, what is written to file descriptor 1 (by a program started now,
    which inherits it) goes to stderr, so that stdout holds only JSON or the table."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


# --------------------------------------------------------------------- replay, then live

def then_live(cassettes: list[Path], command: tuple[str, ...], opts: ReplayOptions, *,
              many: bool) -> int:
    """``deja replay CASSETTE --then live|stub SCRIPT``: serve the recording while the
    program asks what it asked before, then go live (:mod:`replayer.then_live`) into a
    new cassette; the status to exit with is the program's."""
    if many:
        raise BadInput("--then takes one cassette; to try a change on a folder of incidents, "
                       "run deja suite DIR --then live -- CMD")
    ran = run_then_live(cassettes[0], command, opts)
    _said_then_live(cassettes[0], ran.out, ran.target)
    return ran.code


@dataclass(frozen=True)
class ThenLiveRun:
    """What one replay-then-live did: the program's exit status, the new cassette's path
    (written once the program left the recording, or at its end) and, with ``--then
    stub``, the stub's address."""

    code: int
    out: Path
    target: str | None


def run_then_live(cassette: Path, command: tuple[str, ...], opts: ReplayOptions) -> ThenLiveRun:
    """Replay ``cassette`` with ``command`` (or its recorded one) until the program leaves
    the recording, then live (or against the stub of ``--then stub``) into
    ``opts.output``; what is wrong with the input raises :class:`BadInput` (exit 2)
    before anything runs. Nothing is printed: :func:`then_live` says what happened."""
    from deja._common import tool_policy

    if opts.then == "stub" and opts.then_script is None:
        raise BadInput("--then stub needs the stub's script: --then stub SCRIPT")
    if opts.then == "live" and opts.then_script is not None:
        raise BadInput("a script goes with --then stub, not --then live")
    policy = tool_policy(opts.tool_rules, opts.live_tools)
    loaded = _load(cassette, require_signature=True, allow_incomplete=opts.allow_incomplete)
    argv = list(command) or list(loaded.header.get("argv") or [])
    if not argv:
        raise _no_command(cassette, loaded.header, "replay")
    cwd = _where_to_run(cassette, loaded.header, argv, given=bool(command), cwd=opts.cwd)
    project = _project_match(cwd or Path.cwd())  # a bad [tool.deja.match]: said first
    with _live_target(opts) as target:
        if isinstance(loaded.header.get("proxy"), dict):  # an agent in any language
            click.secho(PROXY_TOOLS_WARNING, err=True, fg="yellow")
            code, out = _proxy_then_live(cassette, argv, cwd, opts, project, target)
        else:
            code, out = _launch_then_live(cassette, argv, cwd, opts, policy)
    return ThenLiveRun(code, out, target)


def _proxy_then_live(cassette: Path, argv: list[str], cwd: Path | None, opts: ReplayOptions,
                     project: ReplayPolicy, target: str | None) -> tuple[int, Path]:
    """A run recorded through the proxy, replayed then live through it (``deja proxy
    --replay C --then live``): live to the stub of ``--then stub``, else to where the
    program's ANTHROPIC_BASE_URL points, else to the recorded upstream."""
    from recorder.errors import DejaError
    from replayer.then_live import plan_then_live

    try:
        out = plan_then_live(cassette, out=opts.output,
                             allow_incomplete=opts.allow_incomplete).out
    except DejaError as exc:
        raise BadInput(str(exc)) from None
    recorded = (_header_proxy(cassette).get("upstream") or "https://api.anthropic.com")
    upstream = target or os.environ.get("ANTHROPIC_BASE_URL") or str(recorded)
    args = ["--replay", str(cassette.resolve()), "--then", "live", "--upstream", upstream,
            "-o", str(out.resolve()),
            *(f"--tool={rule}" for rule in opts.tool_rules),
            *(f"--live-tool={name}" for name in opts.live_tools),
            *(f"--ignore={p}" for p in (*opts.ignore, *project.ignore)),
            *(f"--normalise={n}" for n in opts.normalise),
            *(f"--normalise={p}={r}" for p, r in project.normalise)]
    return cli_proxy.through_proxy(args, argv, cwd), out


def _header_proxy(cassette: Path) -> dict[str, Any]:
    from recorder.cassette.reader import peek_header

    header: Any = peek_header(cassette) or {}
    proxy = header.get("proxy")
    return dict(proxy) if isinstance(proxy, dict) else {}


def _launch_then_live(cassette: Path, argv: list[str], cwd: Path | None, opts: ReplayOptions,
                      policy: Any) -> tuple[int, Path]:
    """Run the program in a replay-then-live; its exit status and the new cassette."""
    from deja._launch import _launch, _writer_lock
    from recorder.errors import DejaError
    from replayer.then_live import plan_then_live

    try:
        plan = plan_then_live(cassette, out=opts.output, allow_incomplete=opts.allow_incomplete)
    except DejaError as exc:
        raise BadInput(str(exc)) from None
    lock = _writer_lock(plan.out, plan.run_id, "deja replay --then")
    try:
        return _launch("fork", argv, plan.out, cwd, lock=lock,
                       cassette=str(cassette.resolve()), out=str(plan.out.resolve()),
                       run_id=plan.run_id, then_live=True, ignore=opts.ignore,
                       normalise=opts.normalise, allow_incomplete=opts.allow_incomplete,
                       tools=[f"{name}={spec}" for name, spec in policy.to_header().items()]
                       ).status, plan.out
    finally:
        lock.release()


@contextlib.contextmanager
def _live_target(opts: ReplayOptions) -> Iterator[str | None]:
    """Where the live part goes: with ``--then stub SCRIPT``, a stub server serving the
    script on 127.0.0.1, every SDK pointed at it while the program runs (its URL); with
    ``--then live``, the program's own environment (None)."""
    if opts.then != "stub" or opts.then_script is None:
        yield None
        return
    from recorder import providers
    from recorder.testing.script import StubScriptError, load_script
    from recorder.testing.server import StubServer

    try:
        script = load_script(opts.then_script)
    except (StubScriptError, OSError) as exc:
        raise BadInput(f"--then stub {opts.then_script}: {exc}") from None
    server = StubServer(script).start()
    saved = dict(os.environ)
    os.environ.update(providers.base_url_env(server.url))
    try:
        yield server.url
    finally:
        os.environ.clear()
        os.environ.update(saved)
        server.stop()


def _said_then_live(cassette: Path, out: Path, target: str | None) -> None:
    """What a replay-then-live did: where it left the recording, what the live part
    spent, the tool calls its policy answered, and how to compare the runs."""
    from deja._common import policy_rows
    from deja._launch import _echo_split
    from recorder.cassette.reader import peek_header

    header = peek_header(out) if out.exists() else None
    if header is None:
        click.echo("deja: the program stopped before it left the recording; nothing new "
                   "was written", err=True)
        return
    parent: dict[str, Any] = dict(header.get("parent") or {})
    where = f" against the stub at {target}" if target else ""
    step, why = parent.get("step"), dict(parent.get("divergence") or {})
    if isinstance(step, int):
        kind = ", ".join(str(v).replace("_", " ") for v in (why.get("kind"),
                                                               why.get("category")) if v)
        click.echo(f"deja: served the recording up to step {step}; there the program asked "
                   f"for something else ({kind}): live from there{where} -> {out}", err=True)
    else:
        click.echo(f"deja: the program never left the recording (nothing went live) -> {out}",
                   err=True)
    _echo_split(out)
    rows = policy_rows(out)
    if rows:
        click.echo(f"deja: {len(rows)} tool call(s) not run live (the tool policy):", err=True)
        click.echo("\n".join(rows), err=True)
    click.echo(f"deja: compare them with: deja diff {cassette} {out}", err=True)
