"""Runs out of the request cycle on the command line: ``deja serve`` (the HTTP API),
``deja worker``, and the clients: ``submit``, ``runs``, ``answer``, ``schedule`` and
``check``.

``submit``, ``runs`` and ``answer`` speak to ``deja serve`` at ``DEJA_SERVER`` through the
standard library only, so that they start at once: nothing here imports the engine or
the database layer on their path. They send the server's token themselves: ``DEJA_TOKEN``,
else, to a server on this machine, the per-install token in ``$DEJA_HOME/serve.token``.
``schedule`` and ``check`` use the runs database directly (``--db``, else
``DEJA_DATABASE_URL``, else the embedded SQLite file under ``$DEJA_HOME``).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote, urlencode

import click

from deja._common import (
    BadInput,
    RunsCommand,
    _fail,
    _labels,
    _pid_gone,
    _print_table,
    guard_options,
)

REQUEST_TIMEOUT = 30.0  # seconds a command waits for deja serve to answer


class ServerSaid(Exception):
    """A named error that ``deja serve`` answered with."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(f"{type_}: {message}")
        self.status, self.type, self.message = status, type_, message


def _api(method: str, path: str, body: Any = None) -> Any:
    """Ask ``deja serve``; its JSON answer, :class:`ServerSaid` for an error it named, or
    ``ServerUnreachable``."""
    import http.client
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    from deja.runs.auth import client_token
    from deja.runs.config import server_url
    from deja.runs.errors import ServerUnreachable
    from recorder.errors import ConfigError

    base = server_url()
    if not base.startswith(("http://", "https://")):
        raise BadInput(f"DEJA_SERVER={base!r} is not an address; give one such as "
                       "http://127.0.0.1:8977")
    local = _loopback(urlsplit(base).hostname)
    headers = {"accept": "application/json"}
    data = None
    if body is not None or method == "POST":
        data = json.dumps({} if body is None else body).encode()
        headers["content-type"] = "application/json"
    try:
        token = client_token(local=local)
    except ConfigError as exc:
        _fail(exc)
    if token:
        headers["authorization"] = f"Bearer {token}"
    request = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    # a server on this machine is reached directly, whatever proxy the environment names
    handlers = [urllib.request.ProxyHandler({})] if local else []
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(request, timeout=REQUEST_TIMEOUT) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        exc.close()
        try:
            named = json.loads(raw)["error"]
            raise ServerSaid(exc.code, str(named["type"]), str(named["message"])) from None
        except (ValueError, KeyError, TypeError):
            raise ServerSaid(exc.code, f"HTTP{exc.code}", f"{base} answered {exc.code} "
                             f"{exc.reason}; is DEJA_SERVER the address of deja serve?") \
                from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ServerUnreachable(f"deja serve does not answer at {base} ({reason}); start it "
                                "with `deja serve`, or point DEJA_SERVER at the address it "
                                "serves on") from None


def _loopback(host: str | None) -> bool:
    import ipaddress

    if host in ("localhost", None):
        return host is not None
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _ask(method: str, path: str, body: Any = None) -> Any:
    """:func:`_api` for a command: every error is the command's named error (exit 2)."""
    from deja.runs.errors import ServerUnreachable

    try:
        return _api(method, path, body)
    except ServerUnreachable as exc:
        _fail(exc)
    except ServerSaid as exc:
        _said(exc)


def _said(exc: ServerSaid) -> NoReturn:
    hint = (" (deja sends DEJA_TOKEN, else, to a server on this machine, the token in "
            "$DEJA_HOME/serve.token; is DEJA_HOME the server's? On the server's machine "
            "`deja serve --print-token` prints it)") if exc.status == 401 else ""
    raise BadInput(f"{exc.type}: {exc.message}{hint}") from None


def _run_path(run: str, tail: str = "") -> str:
    from recorder.harness.progress import valid_run_id

    if not valid_run_id(run):
        raise BadInput(f"{run!r} is not a run id (letters, digits, '_', '.' and '-', e.g. "
                       "r_01a2...); `deja runs` lists the runs")
    return f"/runs/{quote(run, safe='')}{tail}"


def _db_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--db", "db", metavar="URL",
        help="The runs database (default: DEJA_DATABASE_URL, else the embedded SQLite file "
             "under $DEJA_HOME).")(func)


def _guard_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
                     help="Label the run (repeatable)."),
        click.option("--cwd", type=click.Path(file_okay=False, exists=True, path_type=Path),
                     help="The directory the command runs in (default: this one)."),
        click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED),
    ]
    for option in reversed(options):
        func = option(func)
    return guard_options()(func)


def _submission(labels: tuple[str, ...], cwd: Path | None, command: tuple[str, ...],
                **guards: Any) -> dict[str, Any]:
    chosen = {("max_tokens" if k == "max_tokens_total" else k): v for k, v in guards.items()
              if k.startswith("max_") and v is not None}
    if guards.get("clamp_max_tokens"):
        chosen["clamp_max_tokens"] = True
    if guards.get("no_loop_guard"):
        chosen["loop_guard"] = False
    if guards.get("no_breaker"):
        chosen["breaker"] = False
    return {"command": list(command), "cwd": str((cwd or Path.cwd()).resolve()),
            "labels": _labels(labels), "guards": chosen}


# -- the server and the worker


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --token.")
@click.option("--port", type=click.IntRange(0, 65535), default=8977, show_default=True,
              help="Port to listen on (0: any free port; see --ready-file).")
@click.option("--token", envvar="DEJA_TOKEN", metavar="TOKEN",
              help="The token requests must send as Authorization: Bearer TOKEN (also "
                   "DEJA_TOKEN). Default: this install's, $DEJA_HOME/serve.token, made on "
                   "first use and read by deja's commands. Required off loopback.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="A host name clients reach this server by (repeatable), beside "
                   "localhost, 127.0.0.1, [::1] and --host: e.g. behind a reverse proxy. "
                   "A request naming another Host is refused (421).")
@_db_option
@click.option("--ready-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write {url, port, pid} as JSON here once listening (removed on exit).")
@click.option("--quiet", is_flag=True, help="No line per request on stderr.")
@click.option("--mcp-tokens", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="MCP clients' own tokens, one a line (a file only you can read): each "
                   "opens /mcp and no other route, and sees only the tasks it created.")
@click.option("--print-token", is_flag=True,
              help="Print the token this server requires (made if there is none yet) and "
                   "exit: for curl, or DEJA_TOKEN on another machine.")
def serve(host: str, port: int, token: str | None, allowed_hosts: tuple[str, ...],
          db: str | None, ready_file: Path | None, quiet: bool, mcp_tokens: Path | None,
          print_token: bool) -> None:
    """Serve the runs API over HTTP: submit, list, read, cancel and answer runs.

    POST /runs, GET /runs, GET /runs/ID, POST /runs/ID/cancel, POST /runs/ID/input,
    GET /runs/ID/events (server-sent events), GET /schedules, GET /healthz, and
    POST /mcp for MCP clients (each run an MCP task). Runs are
    executed by `deja worker` processes on the same database. Every request but
    /healthz sends the token (deja's commands do it themselves), a POST is
    application/json, and no web page may call it. Stop with SIGTERM or Ctrl-C.
    """
    import logging

    from deja.runs import api
    from deja.runs.auth import server_token
    from deja.runs.config import database_url
    from recorder.errors import DejaError

    try:
        if print_token:
            click.echo(server_token(token))
            return
        api.check_binding(host, token)  # before anything heavy is imported
        callers = _mcp_tokens(mcp_tokens)
    except DejaError as exc:
        _fail(exc)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("deja serve: %(message)s"))
    logger = logging.getLogger("deja.serve")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        api.serve(host, port, token, db or database_url(), ready_file, allowed_hosts,
                  mcp_tokens=callers)
    except DejaError as exc:
        _fail(exc)


def _mcp_tokens(path: Path | None) -> list[str]:
    """The MCP clients' tokens in ``path`` (none without one)."""
    if path is None:
        return []
    from deja.runs.mcp_http import read_mcp_tokens

    return read_mcp_tokens(path)


@click.command()
@click.option("--id", "worker_id", metavar="NAME",
              help="This worker's id: unique per worker, the same across its restarts "
                   "(default: HOSTNAME-1).")
@_db_option
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs at a time.")
def worker(worker_id: str | None, db: str | None, jobs: int) -> None:
    """Take submitted runs from the queue and run each under the harness, durably.

    A run whose worker died is dispatched again and resumed from its cassette (recorded
    turns replay; nothing is paid twice). Stop with SIGTERM or Ctrl-C: runs in flight
    are picked up again by the next worker with this id, or by a live peer.
    """
    from deja.runs import worker as runs_worker
    from recorder.errors import DejaError

    try:
        runs_worker.serve(worker_id or runs_worker.default_worker_id(), db, jobs)
    except DejaError as exc:
        _fail(exc)


# -- the clients of deja serve


@click.command(cls=RunsCommand, context_settings={"allow_interspersed_args": False})
@_guard_options
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def submit(as_json: bool, **given: Any) -> None:
    """Submit a run to deja serve and print its id: deja submit [OPTIONS] -- CMD ...

    The run is queued at once and a `deja worker` runs it under the harness, with these
    guards and labels, in --cwd. Follow it with `deja status RUN`, stop it with `deja
    cancel RUN`. The server is DEJA_SERVER (default http://127.0.0.1:8977), its token
    DEJA_TOKEN. The command line is stored: pass secrets through the worker's
    environment, never as arguments.
    """
    result = _ask("POST", "/runs", _submission(**given))
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(result["run_id"])
    click.echo(f"deja: run {result['run_id']} {result['status']}; follow it with: deja status "
               f"{result['run_id']}", err=True)


@click.command("runs")
@click.option("--status", "statuses", multiple=True, metavar="STATUS",
              help="Only runs in this lifecycle status (repeatable): queued, working, "
                   "input_required, completed, failed, cancelled, exhausted, stopped, "
                   "interrupted.")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Only runs with this label (repeatable: all must match).")
@click.option("--schedule", metavar="NAME", help="Only the runs of this schedule.")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True,
              help="At most this many runs, newest first.")
@click.option("--json", "as_json", is_flag=True, help="Print {\"runs\": [...]} as JSON.")
def runs_(statuses: tuple[str, ...], labels: tuple[str, ...], schedule: str | None,
          limit: int, as_json: bool) -> None:
    """List submitted runs, newest first, from deja serve (DEJA_SERVER)."""
    query: list[tuple[str, str]] = [("status", s) for s in statuses]
    query += [("label", f"{k}={v}") for k, v in _labels(labels).items()]
    if schedule:
        query.append(("schedule", schedule))
    query.append(("limit", str(limit)))
    found = _ask("GET", f"/runs?{urlencode(query)}")
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    rows = [{"run": r["run_id"], "status": r["status"],
             "labels": ", ".join(f"{k}={v}" for k, v in (r.get("labels") or {}).items()),
             "submitted": r.get("submitted"), "worker": r.get("worker"), "turn": r.get("turn"),
             "step": r.get("question") if r["status"] == "input_required" else r.get("step")}
            for r in found["runs"]]
    if not rows:
        click.echo("deja: no runs match")
        return
    _print_table(rows, ["run", "status", "labels", "submitted", "worker", "turn", "step"])


@click.command()
@click.argument("run")
@click.argument("text")
def answer(run: str, text: str) -> None:
    """Answer the question a run waits on (recorder.ask); the run resumes with it.

    A submitted run is answered through deja serve (DEJA_SERVER), even while no worker
    is up. A run recorded here with `deja record` that waits in recorder.ask gets its
    answer left under $DEJA_HOME/runs.
    """
    from deja.runs.errors import ServerUnreachable
    from recorder.errors import DejaError

    path = _run_path(run, "/input")
    try:
        result = _api("POST", path, {"answer": text})
    except (ServerUnreachable, ServerSaid) as exc:
        if isinstance(exc, ServerSaid) and exc.type != "NoSuchRun":
            _said(exc)
        if _answer_locally(run, text):
            return
        if isinstance(exc, ServerSaid):
            _said(exc)
        _fail(exc)
    except DejaError as exc:
        _fail(exc)
    click.echo(f"deja: answered run {run}" + (f" ({result['question']!r})" if result.get(
        "question") else "") + "; it resumes with the answer")


def _answer_locally(run: str, text: str) -> bool:
    """Leave the answer of a ``deja record`` run of this machine that waits on it."""
    import socket

    from recorder.errors import ConfigError
    from recorder.harness.progress import leave_answer, read_status

    record = read_status(run)
    if record is None or record.get("status") != "input_required":
        return False
    if record.get("host") == socket.gethostname() and _pid_gone(record.get("pid")):
        return False  # its process is gone: nobody here reads an answer left for it
    try:
        where = leave_answer(run, text)
    except ConfigError as exc:
        _fail(exc)
    click.echo(f"deja: answer left for run {run} ({where}); it asked: "
               f"{record.get('question')!r}")
    return True


# -- schedules and alerts (the database itself)


class _EngineClient:
    """The engine's client, opened on first use: reading schedules, and every error found
    in deja's own tables first, never import or migrate the engine."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client: Any = None

    def __getattr__(self, name: str) -> Any:
        from deja.runs.engine import ENGINE_ERRORS, Client

        if self.client is None:
            self.client = Client(self.url)
        method = getattr(self.client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except ENGINE_ERRORS as exc:
                raise BadInput(f"the runs engine refused ({type(exc).__name__}: {exc})"
                               ) from None

        return call

    def close_if_open(self) -> None:
        if self.client is not None:
            self.client.close()


def _with_service(db: str | None, work: Callable[[Any], Any]) -> Any:
    """``work(runs)`` on a :class:`deja.runs.service.Runs` of the database; every error is the
    command's named error."""
    from deja.runs.config import database_url
    from deja.runs.service import Runs
    from deja.runs.store import Store
    from recorder.errors import DejaError

    url = db or database_url()
    try:
        store = Store(url)
        client = _EngineClient(url)
        try:
            return work(Runs(store, client))
        finally:
            client.close_if_open()
            store.close()
    except DejaError as exc:
        _fail(exc)


@click.group()
def schedule() -> None:
    """Scheduled runs: add, ls, rm, run-now. A worker submits each occurrence.

    Each occurrence is a run with a deterministic id, so a backfill after downtime never
    submits one twice. With --deadline, an occurrence without a verified artefact by then
    raises an absence alert (see `deja check`).
    """


@schedule.command("add", cls=RunsCommand)
@click.argument("name")
@click.option("--cron", required=True, metavar="EXPR",
              help='When it runs: five cron fields, e.g. "0 6 * * 1" (Mondays at 06:00).')
@click.option("--tz", default="UTC", show_default=True, help="The cron's time zone (IANA name).")
@click.option("--deadline", metavar="HH:MM|DELAY",
              help="A verified artefact is due by this time of day (07:00) or this long "
                   "after the occurrence (90m, 2h): else an absence alert.")
@click.option("--alert", metavar="CMD|URL",
              help="Where alerts go: a URL gets a JSON POST, a command the JSON on stdin.")
@_guard_options
@_db_option
def schedule_add(name: str, cron: str, tz: str, deadline: str | None, alert: str | None,
                 db: str | None, **given: Any) -> None:
    """Add a schedule: deja schedule add NAME --cron "0 6 * * 1" [OPTIONS] -- CMD ..."""
    from deja.runs import schedules
    from recorder.errors import DejaError

    try:  # checked before the database is opened
        schedules.check_name(name)
        schedules.check_cron(cron)
        schedules.check_tz(tz)
        schedules.check_deadline(deadline)
    except DejaError as exc:
        _fail(exc)
    payload = _submission(**given)
    added = _with_service(db, lambda s: s.add_schedule(name, cron, tz, deadline, alert,
                                                       payload))
    click.echo(f"deja: schedule {name} added: {cron} ({tz}); next occurrence "
               f"{added['next']}" + (f", artefact due {deadline}" if deadline else ""))


@schedule.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print the schedules as JSON.")
@_db_option
def schedule_ls(as_json: bool, db: str | None) -> None:
    """List the schedules: next occurrence, last verified artefact, recent alerts."""
    found = _with_service(db, lambda s: s.schedules())
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo("deja: no schedules (deja schedule add NAME --cron ... -- CMD)")
        return
    rows = [{"name": s["name"], "cron": s["cron"], "tz": s["tz"], "deadline": s["deadline"],
             "next": s["next"], "command": shlex.join(s["command"]),
             "last artefact": (s["last_verified_artefact"] or {}).get("occurrence"),
             "alerts": len(s["alerts"])} for s in found]
    _print_table(rows, ["name", "cron", "tz", "deadline", "next", "command", "last artefact",
                        "alerts"])


@schedule.command("rm")
@click.argument("name")
@_db_option
def schedule_rm(name: str, db: str | None) -> None:
    """Remove a schedule (its past runs stay)."""
    _with_service(db, lambda s: s.remove_schedule(name))
    click.echo(f"deja: schedule {name} removed")


@schedule.command("run-now")
@click.argument("name")
@_db_option
def schedule_run_now(name: str, db: str | None) -> None:
    """Submit an occurrence of a schedule now (a worker runs it)."""
    done = _with_service(db, lambda s: s.run_now(name))  # an unknown name: NoSuchSchedule
    click.echo(f"deja: schedule {name} triggered: run {done['run_id']} is queued; it shows "
               f"in: deja runs --schedule {name}")


@click.command()
@_db_option
@click.option("--now", "at", metavar="TIME",
              help="Evaluate deadlines as of this time: ISO 8601 with its zone "
                   "(2026-12-07T07:30:00+00:00) or ahead of now (+7d, +36h, +90m; "
                   "default: now).")
@click.option("--json", "as_json", is_flag=True, help="Print the new alerts as JSON.")
def check(db: str | None, at: str | None, as_json: bool) -> None:
    """Raise the alerts that are due: failed scheduled runs, and occurrences with no
    verified artefact by their deadline. Exit 1 when any alert fired, else 0.

    Reads the runs database only, so it works with no worker alive: run it from system
    cron, which mails what it prints. Each alert fires once.
    """
    from datetime import UTC, datetime, timedelta

    from deja.runs import schedules
    from deja.runs.config import database_url
    from deja.runs.store import Store
    from recorder.errors import DejaError

    when = None
    ahead = re.fullmatch(r"\+(\d+)([smhd])", at or "")
    if ahead is not None:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[ahead.group(2)]
        when = datetime.now(UTC) + timedelta(**{unit: int(ahead.group(1))})
    elif at is not None:
        try:
            when = datetime.fromisoformat(at)
        except ValueError:
            raise BadInput(f"--now {at!r} is not an ISO 8601 time (2026-12-07T07:30:00+00:00) "
                           "nor a time ahead of now (+7d)") from None
        if when.tzinfo is None:
            raise BadInput(f"--now {at!r} has no time zone; add one, e.g. {at}+00:00")
    try:
        store = Store(db or database_url())
        try:
            raised = schedules.check(store, when)
        finally:
            store.close()
    except DejaError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(raised, indent=2))
    else:
        for alert in raised:
            click.echo(f"deja: ALERT {alert['kind']}: {alert['message']}")
    sys.exit(1 if raised else 0)
