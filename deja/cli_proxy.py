"""``deja proxy``: the recording reverse proxy, for agents in any language."""

from __future__ import annotations

import gc
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from deja._common import (
    EXIT_DIVERGED,
    BadInput,
    _allow_unverified_option,
    _fail,
    _labels,
    _read_json_file,
    budgets_of,
    guard_options,
    policy_options,
    redaction_options,
    replay_policy,
    tool_policy,
    tool_policy_options,
)
from replayer.result import render as replay_report

if TYPE_CHECKING:
    from deja.proxy.server import ServeResult


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --token.")
@click.option("--port", type=click.IntRange(0, 65535), default=8787, show_default=True,
              help="Port to listen on (0 picks a free one; see --ready-file).")
@click.option("--upstream", default="https://api.anthropic.com", show_default=True,
              help="The API every request is forwarded to (the only one: never an open "
                   "relay).")
@click.option("--mcp", "mcp", metavar="URL",
              help="Also carry this MCP server (Streamable HTTP) at the proxy's /mcp: "
                   "point the agent's MCP client there, and its requests are recorded, "
                   "replayed and forked as in-process MCP calls are. A replay or fork "
                   "serves the recorded server's without it.")
@click.option("--dir", "directory", type=click.Path(path_type=Path, file_okay=False),
              default=Path("cassettes"), show_default=True,
              help="Where recorded runs are written, one <run id>.jsonl each.")
@click.option("--replay", "replay", type=click.Path(path_type=Path, dir_okay=False),
              metavar="CASSETTE", help="Serve this cassette offline instead of forwarding.")
@click.option("--then", "then", type=click.Choice(["live"]),
              help="With --replay: serve the cassette while the agent asks what it asked "
                   "before, then forward its first request the cassette does not hold, and "
                   "every later one, to --upstream, into a new cassette (-o).")
@tool_policy_options
@click.option("--fork", "fork", type=click.Path(path_type=Path, dir_okay=False),
              metavar="CASSETTE", help="Serve this cassette up to --at, the edited step, "
                                       "then go live into a new cassette.")
@click.option("--at", "at", type=int, help="With --fork: the step (seq) to edit.")
@click.option("--set", "sets", multiple=True, metavar="PATH=VALUE",
              help="With --fork: replace one field of the step's document (as deja fork).")
@click.option("--patch", "patch_file", type=click.Path(path_type=Path, dir_okay=False),
              help="With --fork: an RFC 6902 JSON patch file for the step's document.")
@click.option("--replace", "replace_file", type=click.Path(path_type=Path, dir_okay=False),
              help="With --fork: a JSON file that replaces the step's whole document.")
@click.option("-o", "--output", "output", type=click.Path(path_type=Path),
              help="With --fork or --then live: the new cassette, a file or a directory "
                   "(default: next to the parent, <run id>.jsonl).")
@click.option("--token", envvar="DEJA_PROXY_TOKEN",
              help="Clients must send this in the x-deja-token header (also "
                   "DEJA_PROXY_TOKEN); others get 401.")
@click.option("--idle", type=click.FloatRange(min=0.05), default=300.0, show_default=True,
              help="Seconds without a request after which a run is closed.")
@click.option("--grace", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds in-flight streams get to finish on SIGTERM.")
@click.option("--max-body", type=click.IntRange(min=1), default=32 * 1024 * 1024,
              show_default=True, help="Largest request body accepted, in bytes (413 above).")
@click.option("--max-response", type=click.IntRange(min=1), default=64 * 1024 * 1024,
              show_default=True,
              help="Largest upstream response passed on and recorded, in bytes, as received "
                   "and as a gzip or deflate body inflates: a whole response over it is a "
                   "502, a stream is cut there with an error event (ResponseTooLarge).")
@click.option("--body-timeout", type=click.FloatRange(min=0.1), default=60.0,
              show_default=True,
              help="Seconds a request's body may stall (no byte arrives) before the proxy "
                   "answers 408 and closes the connection.")
@click.option("--header-timeout", type=click.FloatRange(min=0.1), default=10.0,
              show_default=True,
              help="Seconds a client gets to send a request's headers; slower connections "
                   "are closed.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Also answer requests that name this host (repeatable); by default only "
                   "loopback names and --host are (a web page's request is refused).")
@click.option("--ready-file", type=click.Path(path_type=Path, dir_okay=False),
              help="Write {url, port, pid, mode} as JSON here once the proxy listens.")
@click.option("--report-file", type=click.Path(path_type=Path, dir_okay=False),
              hidden=True, help="With --replay: write the replay's result here as JSON "
                                "instead of printing its report (deja replay does).")
@click.option("--fsync", type=click.Choice(["sync", "turn", "exit"]), default=None,
              help="When lines are forced to disk (default: [tool.deja] fsync, else turn).")
@guard_options("per run")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Label every run (repeatable; clients add x-deja-labels).")
@redaction_options
@click.option("-q", "--quiet", is_flag=True, help="No log line per request.")
@_allow_unverified_option
@policy_options
def proxy(host: str, port: int, upstream: str, mcp: str | None, directory: Path,
          replay: Path | None, then: str | None, tool_rules: tuple[str, ...],
          live_tools: tuple[str, ...], fork: Path | None, at: int | None,
          sets: tuple[str, ...], patch_file: Path | None,
          replace_file: Path | None, output: Path | None, token: str | None, idle: float,
          grace: float, max_body: int, max_response: int, body_timeout: float,
          header_timeout: float,
          allowed_hosts: tuple[str, ...], ready_file: Path | None,
          report_file: Path | None, fsync: str | None,
          max_turns: int | None, max_tokens_total: int | None,
          max_tokens_per_turn: int | None, clamp_max_tokens: bool,
          max_seconds: float | None, max_dollars: float | None, no_loop_guard: bool,
          no_breaker: bool, labels: tuple[str, ...], redact_headers: tuple[str, ...],
          redact_body: tuple[str, ...], redact_patterns: tuple[str, ...],
          redact_query: tuple[str, ...], quiet: bool, allow_unverified: bool,
          ignore: tuple[str, ...], normalise: tuple[str, ...]) -> None:
    """An Anthropic-compatible recording proxy, for agents in any language.

    Point the agent at it (ANTHROPIC_BASE_URL=http://127.0.0.1:8787) and every call is
    forwarded to --upstream, streamed back as it arrives, and recorded into --dir: one
    signed cassette per run, with the guards of deja record. A client names its run with
    an x-deja-run header; without one, a run is one conversation. --replay CASSETTE serves
    a recording offline (a divergence is a 400 naming the step; exit 1 if the replay was
    not identical); with --then live it serves the recording while the agent asks what it
    asked before and goes live to --upstream at the first request it does not hold (or
    the first tool result other than the recorded one), into a new cassette that names
    the parent and that step. --fork CASSETTE --at N with --set/--patch/--replace serves
    the steps before N, the edited step, then goes live into a new cassette. Stop with
    SIGTERM or Ctrl-C: in-flight streams finish (--grace) and every open run gets its end
    line.
    """
    from deja.proxy.server import ProxyOptions, serve
    from recorder.errors import DejaError
    from recorder.harness.settings import resolve as resolve_settings

    edit = _fork_edit(replay, fork, at, sets, patch_file, replace_file,
                      output if then is None else None)
    tools = _tool_options(replay, then, fork, tool_rules, live_tools, allow_unverified)
    label_map = _labels(labels)
    budgets = budgets_of(max_turns, max_tokens_total, max_tokens_per_turn, clamp_max_tokens,
                         max_seconds, max_dollars)
    record: dict[str, Any] = {
        "fsync": fsync, "budgets": budgets or None,
        "loop_guard": False if no_loop_guard else None,
        "breaker": False if no_breaker else None,
        "redact_headers": redact_headers, "redact_body": redact_body,
        "redact_patterns": redact_patterns, "redact_query": redact_query}
    _log_to_stderr(quiet)
    options = ProxyOptions(host=host, port=port, upstream=upstream, directory=directory,
                           token=token, max_body=max_body, max_response=max_response,
                           body_timeout=body_timeout, header_timeout=header_timeout,
                           allowed_hosts=allowed_hosts,
                           idle=idle, grace=grace,
                           ready_file=ready_file, record=record, labels=label_map,
                           replay=replay, allow_unverified=allow_unverified or None,
                           # a replay-then-live adds the configured rules itself
                           policy=replay_policy(ignore, normalise, configured=then is None),
                           then=then, tools=tools, fork=fork, at=at, edit=edit, out=output,
                           mcp=mcp)
    try:
        resolve_settings(budgets=budgets, loop_guard=record["loop_guard"],
                         breaker=record["breaker"], redact_headers=redact_headers,
                         redact_body=redact_body, redact_patterns=redact_patterns,
                         redact_query=redact_query)
        from deja.proxy.server import build

        app = build(options)
    except DejaError as exc:
        _fail(exc)
    except OSError as exc:
        raise BadInput(f"deja proxy: {exc}") from None
    # This process is the proxy's own: what start-up made (the modules, the app) lives as
    # long as it does. Out of the collector's sight, a full collection walks only what
    # serving makes (about half the collector's CPU a proxied call, bench/proxy_steps.py).
    gc.freeze()
    try:
        result = serve(options, app)
    except OSError as exc:  # the port is taken, say
        raise BadInput(f"deja proxy: cannot listen on {host}:{port}: {exc}") from None
    _report(result, fork, report_file)


def _report(result: ServeResult, fork: Path | None, report_file: Path | None) -> None:
    """What the proxy did, said once it has stopped; exit 1 when its replay diverged."""
    if result.replay is not None:  # the report of deja replay, on stdout as there
        if report_file is not None:
            report_file.write_text(json.dumps(result.replay, default=str))
        else:
            click.echo(replay_report(result.replay, None))
    if result.fork is not None:
        from deja.proxy.server import ran_in_agent

        for line in ran_in_agent(result.ran_in_agent):
            click.echo(f"deja: {line}", err=True)
        click.echo(f"deja: the fork was written to {result.fork}; compare it with: deja diff "
                   f"{fork} {result.fork}", err=True)
    if result.then_live is not None:
        from deja.proxy.server import then_live_report

        for line in then_live_report(result.then_live):
            click.echo(f"deja: {line}", err=True)
    if result.identical is False:
        sys.exit(EXIT_DIVERGED)


def _tool_options(replay: Path | None, then: str | None, fork: Path | None,
                  rules: tuple[str, ...], live: tuple[str, ...], allow_unverified: bool) -> Any:
    """The tool policy of a fork's or a replay-then-live's live part (None for another
    mode), its options checked."""
    if fork is not None and then is None:
        return tool_policy(rules, live)
    if then is None:
        if rules or live:
            raise BadInput("--tool and --live-tool go with --replay CASSETTE --then live, "
                           "or with --fork CASSETTE")
        return None
    if replay is None:
        raise BadInput("--then live goes with --replay CASSETTE")
    if allow_unverified:
        raise BadInput("--then live copies the recording into a new signed run: its "
                       "signature must verify (no --allow-unverified)")
    return tool_policy(rules, live)


def _fork_edit(replay: Path | None, fork: Path | None, at: int | None,
               sets: tuple[str, ...], patch_file: Path | None, replace_file: Path | None,
               output: Path | None) -> dict[str, Any]:
    """The options of a mode checked together, and a fork's edit as ProxyOptions takes
    it (empty unless --fork)."""
    if replay is not None and fork is not None:
        raise BadInput("give --replay or --fork, not both")
    edits = [x for x in (sets or None, patch_file, replace_file) if x]
    if fork is not None:
        if at is None:
            raise BadInput("--fork needs --at STEP")
        if len(edits) != 1:
            raise BadInput("--fork needs exactly one edit: --set PATH=VALUE (repeatable), "
                           "--patch FILE or --replace FILE")
    elif at is not None or edits or output is not None:
        raise BadInput("--at, --set, --patch, --replace and -o go with --fork CASSETTE "
                       "(-o also with --replay CASSETTE --then live)")
    if sets:
        return {"sets": list(sets)}
    if patch_file is not None:
        return {"patch": _read_json_file(patch_file, "patch file")}
    if replace_file is not None:
        return {"replace": _read_json_file(replace_file, "replacement file")}
    return {}


def _log_to_stderr(quiet: bool) -> None:
    """The proxy's log lines (one per request unless ``quiet``) and the warnings of the
    sessions it runs, on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("deja proxy: %(message)s"))
    for name in ("deja.proxy", "deja.replayer", "deja.recorder"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING if quiet and name == "deja.proxy" else
                        logging.INFO if name == "deja.proxy" else logging.WARNING)


def through_proxy(proxy_args: list[str], command: list[str], cwd: Path | None) -> int:
    """Run ``command`` against a ``deja proxy PROXY_ARGS`` started for it on a free port
    (its ANTHROPIC_BASE_URL points there), then stop the proxy: how ``deja replay`` and
    ``deja fork`` take a run recorded through the proxy, whatever language its agent is
    in (a replay-then-live, ``--replay C --then live``, is a fork: it goes live, with the
    client's own key). Returns the proxy's exit status when it failed (1: the replay
    diverged), else the command's."""
    import os
    import signal
    import subprocess
    import tempfile
    import time

    with tempfile.TemporaryDirectory(prefix="deja-through-proxy-") as tmp:
        ready, report = Path(tmp) / "ready.json", Path(tmp) / "report.json"
        offline = "--replay" in proxy_args and "--then" not in proxy_args
        extra = ["--report-file", str(report)] if offline else []
        server = subprocess.Popen([sys.executable, "-m", "deja", "proxy", "--port", "0",
                                   "--ready-file", str(ready), "-q", *extra, *proxy_args])
        try:
            while not ready.is_file():
                if server.poll() is not None:
                    return server.returncode or 2
                time.sleep(0.02)
            url = json.loads(ready.read_text())["url"]
            click.echo(f"deja: {command[0]} talks to the proxy at {url}", err=True)
            env = {**os.environ, "ANTHROPIC_BASE_URL": url, "DEJA_MODE":
                   "replay" if offline else "fork" if {"--fork", "--then"} & set(proxy_args)
                   else "record"}
            if offline:  # a client needs no real key
                from recorder.providers import placeholder_keys

                env.update(placeholder_keys(env))
            try:
                code = subprocess.call(command, cwd=cwd, env=env)
            except OSError as exc:
                raise BadInput(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
            served = server.wait()
        if report.is_file():  # one report, as deja replay prints it for a Python program
            click.echo(replay_report(json.loads(report.read_text()), code))
    return served or code
