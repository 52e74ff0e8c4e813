"""Running the proxy: its four modes put together, and the server around them.

``record`` (the default) starts a recorded run per client run (:mod:`deja.proxy.runs`) in
``directory``; ``replay`` serves one cassette offline; ``then_live`` serves it while the
agent asks what it asked before, then goes live (:mod:`deja.proxy._then_live`); ``fork``
serves a cassette's steps up to the fork step, the edited step, then goes live. A new
cassette's header names its parent.

The server is uvicorn: a readiness file once the socket listens, one log line per request,
a client that does not send a request's headers within ``header_timeout`` seconds is
dropped (:mod:`recorder.serving`, which also binds the socket and reads each request body
within bounds for it and ``deja serve``), and on SIGTERM or SIGINT a graceful stop (no new
connections; in-flight streams get ``grace`` seconds to finish), after which every open
cassette gets its end line.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from deja.proxy._bounds import BODY_TIMEOUT, MAX_RESPONSE
from deja.proxy._mcp import recorded_server
from deja.proxy._then_live import AgentTools
from deja.proxy._wire import Callers
from deja.proxy.app import Proxy
from deja.proxy.runs import ProxyRun
from recorder.capture.redact import Redaction
from recorder.cassette import load
from recorder.cassette.keys import load_keyring, require_signing_key
from recorder.errors import ConfigError
from recorder.record import RecordSession
from recorder.serving import (
    HEADER_TIMEOUT,
    MAX_WAITING,
    bind,
    guarded_httptools,
    is_loopback,
    run_until_stopped,
    write_ready,
)
from replayer.tool_policy import ToolPolicy

if TYPE_CHECKING:
    from replayer.policy import ReplayPolicy
    from replayer.replay import ReplaySession

__all__ = ["ProxyOptions", "ServeResult", "build", "ran_in_agent", "serve", "then_live_report"]

log = logging.getLogger("deja.proxy")

DEFAULT_UPSTREAM = "https://api.anthropic.com"
DEFAULT_PORT = 8787


@dataclass
class ProxyOptions:
    """Everything ``deja proxy`` takes (see its ``--help``)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    upstream: str = DEFAULT_UPSTREAM
    directory: Path = Path("cassettes")
    token: str | None = None
    max_body: int = 32 * 1024 * 1024
    body_timeout: float = BODY_TIMEOUT  # seconds a request body may stall between pieces
    max_response: int = MAX_RESPONSE  # bytes of a response, as received and as inflated
    header_timeout: float = HEADER_TIMEOUT  # seconds a client gets to send its headers
    max_waiting: int = MAX_WAITING  # connections waiting for their headers at once
    allowed_hosts: tuple[str, ...] = ()  # names besides loopback and --host it answers to
    idle: float = 300.0
    grace: float = 10.0
    ready_file: Path | None = None
    # record (and a fork's live part): what `deja record` takes
    record: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    # replay
    replay: Path | None = None
    allow_unverified: bool | None = None
    policy: ReplayPolicy | None = None  # what may differ from the recording (--ignore ...)
    then: str | None = None  # "live": a replay that goes live at its first miss
    tools: ToolPolicy | None = None  # the tool policy of its live part
    # fork
    fork: Path | None = None
    at: int | None = None
    edit: dict[str, Any] = field(default_factory=dict)  # patch= / replace= / sets=
    out: Path | None = None  # a fork's or a replay-then-live's new cassette
    # an MCP server carried at /mcp (deja proxy --mcp URL; a served run: the recorded one)
    mcp: str | None = None

    @property
    def mode(self) -> str:
        if self.replay:
            return "then_live" if self.then == "live" else "replay"
        return "fork" if self.fork else "record"


@dataclass
class ServeResult:
    """What a proxy did, once it has stopped."""

    mode: str
    requests: int
    replay: dict[str, Any] | None = None  # a replay's result (ReplayResult.to_dict())
    identical: bool | None = None  # a replay: no divergence, every step asked for
    fork: str | None = None  # a fork's new cassette
    then_live: dict[str, Any] | None = None  # a replay-then-live's report (Following.report)
    # a fork: the agent's tools that ran though its tool policy would not have run them
    ran_in_agent: list[dict[str, Any]] = field(default_factory=list)


def build(options: ProxyOptions) -> Proxy:
    """The proxy of ``options``, checked: every bad input is a named error here, before
    anything listens or is written."""
    if not is_loopback(options.host) and not options.token:
        raise ConfigError(f"deja proxy binds to {options.host}, which is not loopback: give "
                          "--token (clients send it in the x-deja-token header)")
    upstream = options.upstream.rstrip("/")
    if not upstream.startswith(("http://", "https://")):
        raise ConfigError(f"--upstream must be an http:// or https:// URL, not {upstream!r}")
    if options.mcp is not None and not options.mcp.startswith(("http://", "https://")):
        raise ConfigError(f"--mcp must be an MCP server's http:// or https:// URL, not "
                          f"{options.mcp!r}")
    common: dict[str, Any] = {"token": options.token, "max_body": options.max_body,
                              "body_timeout": options.body_timeout, "idle": options.idle,
                              "mode": options.mode,
                              "max_response": options.max_response,
                              "callers": Callers.of(options.host, options.allowed_hosts)}
    if options.replay is not None and options.then == "live":
        return _then_living(options, upstream, common)
    if options.replay is not None:
        return _replaying(options, upstream, common)
    if options.fork is not None:
        return _forking(options, upstream, common)
    keyring = load_keyring()
    require_signing_key(keyring)
    options.directory.mkdir(parents=True, exist_ok=True)
    record = dict(options.record)
    shown = Redaction().url(upstream)

    def new_run(name: str | None, labels: dict[str, str]) -> ProxyRun:
        header: dict[str, Any] = {"proxy": {"upstream": shown}}
        if options.mcp is not None:
            header["proxy"]["mcp"] = Redaction().url(options.mcp)
        if name is not None:
            header["proxy"]["name"] = name
        session = RecordSession(options.directory, labels={**options.labels, **labels},
                                argv=[], keyring=keyring, header=header, **record)
        return ProxyRun(session.start(intercept=False), name=name)

    RecordSession(options.directory, argv=[], keyring=keyring, **record)  # check the options
    return Proxy(upstream=upstream, new_run=new_run, mcp=options.mcp, **common)


def _recorded_upstream(header: Mapping[str, Any], given: str) -> str:
    proxy = header.get("proxy")
    recorded = proxy.get("upstream") if isinstance(proxy, dict) else None
    return recorded if isinstance(recorded, str) and recorded else given


def _replaying(options: ProxyOptions, upstream: str, common: dict[str, Any]) -> Proxy:
    from replayer.replay import ReplaySession

    assert options.replay is not None
    cassette = load(options.replay, keyring=load_keyring(create=False),
                    allow_unverified=options.allow_unverified)
    run = ProxyRun(ReplaySession(cassette, policy=options.policy))
    run.remember(cassette.observations)
    if not cassette.verified:
        log.warning("%s: %s; serving it unchecked", cassette.path, cassette.verify_note)
    return Proxy(upstream=_recorded_upstream(cassette.header, upstream), single=run,
                 mcp=_mcp_of(options, cassette.observations), **common)


def _forking(options: ProxyOptions, upstream: str, common: dict[str, Any]) -> Proxy:
    from replayer.fork import plan_fork, start_fork

    assert options.fork is not None and options.at is not None
    ring = load_keyring()
    plan = plan_fork(options.fork, options.at, out=options.out or options.fork.parent,
                     keyring=ring, **options.edit)
    session = start_fork(plan, keyring=ring, fsync=options.record.get("fsync") or "turn",
                         ran_in=Path.cwd(), tools=options.tools)
    session.start(intercept=False)
    run = AgentTools(session, plan.parent, options.tools or ToolPolicy()).attach(
        ProxyRun(session))
    run.remember([*plan.parent.observations[:plan.at], plan.edited])
    log.info("forked run %s from %s at step %d -> %s", plan.run_id, plan.parent.run, plan.at,
             plan.out)
    return Proxy(upstream=upstream, single=run,
                 mcp=_mcp_of(options, plan.parent.observations), **common)


def _mcp_of(options: ProxyOptions, observations: Any) -> str | None:
    """The MCP server a served run carries at /mcp: ``--mcp``, else the one its recording
    names (None: neither; the proxy has no /mcp of its own)."""
    return options.mcp if options.mcp is not None else recorded_server(observations)


def _then_living(options: ProxyOptions, upstream: str, common: dict[str, Any]) -> Proxy:
    """Serve the cassette while the agent asks what it asked before, then go live into a
    new cassette (:mod:`deja.proxy._then_live`)."""
    from deja.proxy._then_live import Following
    from replayer.then_live import plan_then_live, start_then_live

    assert options.replay is not None
    ring = load_keyring()
    plan = plan_then_live(options.replay, out=options.out, keyring=ring)
    tools = options.tools or ToolPolicy()
    session = start_then_live(plan, policy=options.policy, tools=tools, keyring=ring,
                              fsync=options.record.get("fsync") or "turn", ran_in=Path.cwd())
    session.start(intercept=False)
    run = Following(session, plan.parent, tools).attach(ProxyRun(session))
    log.info("replaying %s, then live into %s (run %s)", plan.parent.path, plan.out, plan.run_id)
    return Proxy(upstream=upstream, single=run,
                 mcp=_mcp_of(options, plan.parent.observations), **common)


def serve(options: ProxyOptions, proxy: Proxy | None = None) -> ServeResult:
    """Run the proxy until SIGTERM or SIGINT; close every run; say what it did."""
    import uvicorn

    app = proxy or build(options)
    config = uvicorn.Config(app, host=options.host, port=options.port, lifespan="on",
                            http=guarded_httptools(options.header_timeout,
                                                   options.max_waiting), loop="uvloop",
                            log_level="warning", access_log=False, server_header=False,
                            date_header=False, backlog=2048, timeout_keep_alive=30,
                            proxy_headers=False,  # X-Forwarded-*: nothing here reads them
                            # a float is what asyncio.wait_for takes; the hint says int
                            timeout_graceful_shutdown=options.grace)  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    sock = bind(options.host, options.port)  # here, so that a taken port is an OSError

    def listening(port: int) -> None:
        url = f"http://{options.host}:{port}"
        log.info("%s mode, listening on %s%s", options.mode, url,
                 f", forwarding to {app.upstream}" if options.mode != "replay" else "")
        if options.ready_file is not None:
            write_ready(options.ready_file, {"url": url, "port": port, "pid": os.getpid(),
                                             "mode": options.mode})

    # by the time uvicorn stops every run is closed; the outcome is told by the exit status
    try:
        run_until_stopped(server, sock, listening=listening,
                          after=app.shutdown)  # the lifespan may have been skipped
    finally:
        if options.ready_file is not None:
            options.ready_file.unlink(missing_ok=True)
    return _result(app, options)


def _result(app: Proxy, options: ProxyOptions) -> ServeResult:
    result = ServeResult(mode=options.mode, requests=app.requests)
    run = app.single
    if run is not None and options.mode == "replay":  # the session _replaying made
        replayed = cast("ReplaySession", run.session).finish()
        result.replay, result.identical = replayed.to_dict(), replayed.identical
    elif run is not None and options.mode == "fork":
        result.fork = str(run.session.path)
        result.ran_in_agent = run.policy.rows() if run.policy is not None else []
    elif run is not None and run.following is not None:
        result.then_live = run.following.report()
    return result


def then_live_report(report: dict[str, Any]) -> list[str]:
    """A replay-then-live's report (:meth:`deja.proxy._then_live.Following.report`) as the
    lines the proxy prints when it stops."""
    from deja.proxy._then_live import left_at

    left = report["left"]
    where = "never left it: nothing went live" if left is None else \
        f"left it at {left_at(left)}; {report['live_calls']} live call(s)"
    lines = [f"replay, then live: served {report['served']} step(s) of run "
             f"{report['parent_run']}, {where}"]
    lines += ran_in_agent(report["ran_in_agent"])
    lines.append(f"the new run was written to {report['out']}; compare it with: deja diff "
                 f"{report['parent']} {report['out']}")
    return lines


def ran_in_agent(rows: list[dict[str, Any]]) -> list[str]:
    """The agent's tools that ran though the tool policy would not have run them (a
    report's ``ran_in_agent``), as the proxy says them when it stops."""
    from deja.proxy._then_live import told

    return [told(row) for row in rows]
