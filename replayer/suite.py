"""Incident suites: a changed program run against many recorded incidents, a verdict each.

After an incident a team changes the code or the prompt and wants to know what the agent
does *now* on this incident and the ones before it. ``deja suite DIR [--then live|stub
SCRIPT] -- CMD`` runs CMD against each cassette of DIR, as one *job* each, and judges it:

- ``identical`` / ``equivalent``: the replay passed (with ``--then``: the program never
  left the recording);
- ``changed``: it asked for something else at step N (with ``--then``: the step where it
  left the recording and went live);
- ``now_completes``: the recorded run failed (its end line's status is not
  ``completed``, or its exit status is not 0) and the new one completed;
- ``now_fails``: the recorded run completed and the new one did not;
- ``error``: the incident could not be judged (a bad cassette, a program that cannot
  start, a job that died).

A job is a command whose standard output ends with its record, one JSON object on one
line (``deja suite --one CASSETTE ...`` for an incident; ``deja`` at the start of a job's
command means this install's ``deja``). :func:`run_jobs` runs a list of them, in
parallel, here (:func:`run_inline`) or through another runner (the durable workers of
``deja.runs.suites``), and hands back their records in the jobs' order. The records are
plain JSON, so that a durable engine can keep them as its checkpoints.

Here, jobs start *warm* by default: one fork server imports deja and the SDKs once
(:data:`WARM_MODULES`) and each job, and the program it replays, is a fork of it
(:mod:`recorder.harness.warm`); a fresh interpreter spends over a second importing the
Anthropic SDK alone, which a hundred incidents would pay a hundred times. A command a fork
cannot start as given (another interpreter, interpreter options) starts cold.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from recorder.cassette.schema import run_status
from recorder.harness.child import preexec
from recorder.harness.warm_pool import WarmPool

__all__ = ["VERDICTS", "WARM_MODULES", "Job", "OnDone", "Record", "Runner", "command_of",
           "exit_status", "headline", "replay_record", "row", "run_inline", "run_job",
           "run_jobs", "summary", "then_live_record", "warm_pool"]

_log = logging.getLogger("deja.replayer")

VERDICTS = ("identical", "equivalent", "changed", "now_completes", "now_fails", "error")
# What a warm fork server imports once for all of a suite's jobs: deja's command line and
# the commands a job runs (replay, fork, sweep; each imports its module when it runs), the
# modules its bootstrap starts a replay with, and the SDKs deja captures (those not
# installed are left out). A fixed list: nothing in a cassette chooses what is imported.
WARM_MODULES = ("deja.cli", "deja.cli_replay", "deja.cli_sweep", "deja.boot",
                "replayer.replay", "replayer.continuation", "replayer.then_live",
                "recorder.record", "recorder.capture.vcr", "vcr.patch", "anthropic", "openai",
                "google.genai", "mcp", "httpx", "httpx2")
OUTPUT_TAIL = 6000  # characters of a job's standard error kept in its record
REPORT_LIMIT = 12000  # characters of an incident's report kept in its record

Record = dict[str, Any]
OnDone = Callable[[Record], None]


@dataclass(frozen=True)
class Job:
    """One unit of a suite: ``argv`` run in ``cwd``, its standard error kept in ``log``
    (a file, rewritten on each attempt; None: only its tail, in the record). ``key``
    names it uniquely in its suite (an incident's cassette file name). ``warm``: it may
    start as a fork of a warm server (see the module's docstring); False: always a fresh
    interpreter (``--cold``)."""

    key: str
    argv: tuple[str, ...]
    cwd: str
    log: str | None = None
    warm: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "argv": list(self.argv)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Job:
        return cls(str(data["key"]), tuple(str(a) for a in data["argv"]), str(data["cwd"]),
                   data.get("log"), data.get("warm") is not False)


class Runner(Protocol):
    """Runs jobs somewhere (``parallel`` at a time) and hands back their records in the
    jobs' order, calling ``on_done`` with each as it comes."""

    def __call__(self, jobs: Sequence[Job], parallel: int,
                 on_done: OnDone | None) -> list[Record]: ...


def command_of(argv: Sequence[str]) -> list[str]:
    """A job's command as this process runs it: a leading ``deja`` is this install's
    (``python -m deja`` with this interpreter), which a worker on another machine, or in
    another virtualenv, resolves for itself."""
    if argv and argv[0] == "deja":
        return [sys.executable, "-m", "deja", *argv[1:]]
    return list(argv)


def run_job(job: Job, *, started: Callable[[Any], None] | None = None,
            pool: WarmPool | None = None) -> Record:
    """Run one job to its end (a child that dies with this process); its record, or an
    ``error`` record saying why there is none. ``started`` is told of the child (a worker
    stops its children when it stops). The record gets the job's ``key``, its wall-clock
    ``seconds``, the tail of its standard error (``output``) and who ran it
    (``process``). With ``pool``, a job that runs this interpreter starts warm, as a fork
    of the pool's server (see :mod:`recorder.harness.warm_pool`)."""
    began = time.monotonic()
    when = time.time()
    with _error_stream(job) as err:
        start = err.tell()  # this attempt's output begins here
        try:
            child = _spawn(job, err, pool)
        except OSError as exc:
            return {"incident": job.key, "verdict": "error", "seconds": 0.0,
                    "error": f"cannot run {job.argv[0]!r} in {job.cwd}: {exc.strerror or exc}"}
        if started is not None:
            started(child)
        out, _ = child.communicate()
        err.flush()
        err.seek(start)
        tail = err.read()[-OUTPUT_TAIL:].decode("utf-8", "replace")
    record = _last_object(out)
    if record is None:
        record = {"incident": job.key, "verdict": "error",
                  "error": f"the job exited with status {child.returncode} before it "
                           f"reported a verdict: {_last_line(tail)}"}
    record.update(incident=record.get("incident") or job.key, output=tail,
                  seconds=round(time.monotonic() - began, 3),
                  process={"pid": child.pid, "host": socket.gethostname(), "started": when})
    return record


def _spawn(job: Job, err: IO[bytes], pool: WarmPool | None) -> Any:
    """The job's process: a fork of the pool's warm server when it can be one (a server
    that has gone away leaves the job to start cold), else a fresh one."""
    argv = command_of(job.argv)
    if pool is not None and job.warm:
        with contextlib.suppress(OSError):
            child = pool.start(argv, cwd=job.cwd, stderr=err)
            if child is not None:
                return child
    return subprocess.Popen(argv, cwd=job.cwd, stdout=subprocess.PIPE, stderr=err,
                            stdin=subprocess.DEVNULL, preexec_fn=preexec())


@contextlib.contextmanager
def _error_stream(job: Job) -> Iterator[IO[bytes]]:
    """Where a job's standard error goes: its log file (added to: an earlier attempt's
    output is kept above), else a temporary file; read back for the record's tail."""
    if job.log:
        Path(job.log).parent.mkdir(parents=True, exist_ok=True)
        with open(job.log, "a+b") as log:
            yield log
    else:
        with tempfile.TemporaryFile() as temporary:
            yield temporary


def _last_object(out: bytes) -> Record | None:
    """The last line of a job's standard output, as the JSON object it must be."""
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        if line.strip():
            try:
                found = json.loads(line)
            except ValueError:
                return None
            return found if isinstance(found, dict) else None
    return None


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(it printed nothing)"


def run_inline(jobs: Sequence[Job], parallel: int, on_done: OnDone | None = None
               ) -> list[Record]:
    """Run ``jobs`` here, ``parallel`` child processes at a time; their records in the
    jobs' order. Warm jobs start through one fork server that has imported deja and the
    SDKs once (:func:`warm_pool`), the others as fresh interpreters."""
    records: list[Record | None] = [None] * len(jobs)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(warm_pool()) if any(j.warm for j in jobs) else None
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=max(1, parallel),
                                                      thread_name_prefix="deja-suite"))
        futures = {pool.submit(run_job, job, pool=server): n for n, job in enumerate(jobs)}
        for future in as_completed(futures):
            record = future.result()
            records[futures[future]] = record
            if on_done is not None:
                on_done(record)
    return [record for record in records if record is not None]


@contextlib.contextmanager
def warm_pool() -> Iterator[WarmPool | None]:
    """A fork server for a suite's jobs (:data:`WARM_MODULES` imported), or None when it
    cannot start (they start cold)."""
    try:
        server = WarmPool(WARM_MODULES)
    except (OSError, RuntimeError) as exc:
        _log.warning("deja suite: no warm start (%s); each incident starts a fresh interpreter",
                     exc)
        yield None
        return
    with server:
        yield server


def run_jobs(jobs: Sequence[Job], *, parallel: int | None = None, runner: Runner | None = None,
             on_done: OnDone | None = None) -> list[Record]:
    """Run ``jobs`` (``parallel`` at a time; default: one per CPU) with ``runner``, or
    here (:func:`run_inline`); their records, in the jobs' order."""
    width = parallel or os.cpu_count() or 1
    return (runner or run_inline)(jobs, width, on_done)


# --------------------------------------------------------------------------- verdicts

def _state(status: str | None, exit_code: int | None) -> dict[str, Any]:
    """How a run ended, for a record: its status (an end line's ``error`` shown as
    ``failed``; no end line: ``incomplete``), its exit status, and whether it completed
    (status ``completed`` and exit status 0)."""
    shown = run_status({"status": status} if status else None)
    return {"status": shown, "exit_code": exit_code,
            "completed": shown == "completed" and exit_code in (0, None)}


def _verdict(recorded: Mapping[str, Any], now: Mapping[str, Any] | None, changed: bool,
             passed: str) -> str:
    """A ended run against its recording: a change of outcome first, then a change of
    path, else the replay's own verdict."""
    if now is not None and recorded["completed"] and not now["completed"]:
        return "now_fails"
    if now is not None and not recorded["completed"] and now["completed"]:
        return "now_completes"
    return "changed" if changed else passed


def _clip(text: str) -> str:
    return text if len(text) <= REPORT_LIMIT else text[:REPORT_LIMIT] + "\n…(cut)"


def replay_record(incident: str, cassette: str, result: Mapping[str, Any] | None,
                  code: int | None, error: str | None, report: str,
                  run: str | None = None) -> Record:
    """The record of a plain replay (``result``: :meth:`replayer.ReplayResult.to_dict`,
    None when it could not be judged; ``code``: the program's exit status). A diverged
    replay is ``changed``: what the program did after it is unknown, since a replay
    answers nothing it did not record. A passing one is judged by the program's exit
    status against the recorded run's."""
    base: Record = {"incident": incident, "cassette": cassette, "run": run,
                    "changed_at": None, "change": None, "now": None,
                    "live": _no_live(), "new_cassette": None, "error": error,
                    "report": _clip(report), "replay": dict(result) if result else None}
    if result is None:
        return {**base, "verdict": "error", "recorded": None}
    recorded = _state(result.get("recorded_status"), result.get("recorded_exit_code"))
    verdict = str(result.get("verdict") or ("identical" if result.get("identical")
                                             else "diverged"))
    d = result.get("divergence") or {}
    if verdict == "diverged":
        now = {"status": "diverged", "exit_code": code, "completed": False}
        step = d.get("step") if d.get("step") is not None else result.get("steps_recorded")
        return {**base, "run": result.get("run"), "recorded": recorded, "now": now,
                "verdict": "changed", "changed_at": step,
                "change": d.get("category") or d.get("kind")}
    same = code is not None and code == recorded["exit_code"]
    now = recorded if same else _state("completed" if code == 0 else "error", code)
    return {**base, "run": result.get("run"), "recorded": recorded, "now": now,
            "verdict": _verdict(recorded, now, False, verdict)}


def _no_live() -> dict[str, Any]:
    return {"model_calls": 0, "tool_calls": 0, "http_calls": 0, "cost_usd": 0.0}


def then_live_record(incident: str, cassette: Path, new: Path | None, code: int | None, *,
                     reused: bool = False, shown: str | None = None) -> Record:
    """The record of a replay-then-live of ``cassette`` into ``new`` (None or missing:
    the program stopped before anything was written). The new run's status is its end
    line's; ``changed_at`` is the step it left the recording at; ``live`` is what its
    live part spent (:func:`recorder.cassette.rows.run_totals`). ``reused``: the new
    cassette was finished by an earlier attempt of the same suite, and judged again
    without running anything."""
    from recorder.harness.progress import cassette_end

    _, end = cassette_end(cassette)
    end = end or {}
    recorded = _state(end.get("status"), end.get("exit_code"))
    base: Record = {"incident": incident, "cassette": shown or str(cassette),
                    "run": _header_run(cassette), "recorded": recorded, "error": None,
                    "changed_at": None, "change": None, "live": _no_live(),
                    "new_cassette": None, "reused": reused, "replay": None}
    if new is None or not new.exists():
        now = {"status": "failed", "exit_code": code, "completed": False}
        return {**base, "now": now, "verdict": _verdict(recorded, now, False, "identical"),
                "report": f"the program stopped (exit status {code}) before it left the "
                          "recording: nothing new was written"}
    return {**base, **_judged_new(new, recorded, code)}


def _judged_new(new: Path, recorded: Mapping[str, Any], code: int | None) -> Record:
    """What the new cassette of a replay-then-live says: how it ended, where it left the
    recording, and what its live part spent."""
    from recorder.cassette import load
    from recorder.cassette.rows import describe_split, run_totals
    from recorder.errors import DejaError

    try:
        run = load(new, allow_incomplete=True, allow_torn=True, allow_unverified=True)
    except DejaError as exc:
        return {"verdict": "error", "now": None, "new_cassette": str(new),
                "error": f"{new}: {exc}", "report": f"{new}: {exc}"}
    end: Mapping[str, Any] = run.end or {}
    exit_code = end.get("exit_code") if isinstance(end.get("exit_code"), int) else code
    now = _state(end.get("status"), exit_code)
    parent: Mapping[str, Any] = run.header.get("parent") or {}
    step = parent.get("step") if isinstance(parent.get("step"), int) else None
    why: Mapping[str, Any] = parent.get("divergence") or {}
    totals = run_totals(run)
    live = totals["live"] or _no_live()
    split = describe_split(totals)
    report = [f"left the recording at step {step} ({why.get('category') or why.get('kind')}"
              f"): {why.get('reason')}" if step is not None else
              "never left the recording: nothing went live",
              *split, f"ended {now['status']}, exit status {now['exit_code']}; new run "
              f"{run.run} -> {new}"]
    return {"now": now, "new_cassette": str(new), "changed_at": step,
            "change": why.get("category") or why.get("kind"),
            "live": {k: live.get(k, 0) for k in _no_live()},
            "verdict": _verdict(recorded, now, step is not None, "identical"),
            "report": "\n".join(report)}


def _header_run(path: Path) -> str | None:
    from recorder.cassette.reader import peek_header

    header = peek_header(path)
    return header.get("run") if header is not None else None


# --------------------------------------------------------------------------- the lot

def headline(record: Mapping[str, Any]) -> str:
    """A record's verdict in words: ``changed at step 3 (changed_request)``, ``now
    completes (changed at step 1, extra_call)``, ``not judged``."""
    verdict = record.get("verdict")
    step, change = record.get("changed_at"), record.get("change")
    where = f"step {step}" if step is not None else "the end"
    if verdict == "changed":
        return f"changed at {where}" + (f" ({change})" if change else "")
    if verdict in ("now_completes", "now_fails"):
        said = str(verdict).replace("_", " ")
        if step is not None or change:
            said += f" (changed at {where}" + (f", {change})" if change else ")")
        return said
    if verdict == "error":
        return "not judged"
    return str(verdict)


def _ended(state: Mapping[str, Any] | None) -> str | None:
    if not state:
        return None
    code = state.get("exit_code")
    return str(state["status"]) + (f", exit {code}" if code not in (0, None) else "")


def row(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record as a row of the suite's table."""
    live = record.get("live") or _no_live()
    calls = [f"{live[key]} {what}" for key, what in (("model_calls", "model"),
                                                      ("http_calls", "HTTP"),
                                                      ("tool_calls", "tool")) if live.get(key)]
    return {"incident": record.get("incident"), "recorded": _ended(record.get("recorded")),
            "now": _ended(record.get("now")), "verdict": headline(record),
            "live calls": ", ".join(calls) or "0", "cost": f"${live['cost_usd']:.6f}",
            "new cassette": record.get("new_cassette"),
            "seconds": f"{float(record.get('seconds') or 0):.2f}"}


def exit_status(records: Iterable[Mapping[str, Any]], *, then: bool) -> int:
    """2 when an incident could not be judged; else 1 when one regressed (``now_fails``,
    or, without ``--then``, a replay that diverged: ``changed``); else 0."""
    verdicts = {record.get("verdict") for record in records}
    if "error" in verdicts:
        return 2
    if "now_fails" in verdicts or (not then and "changed" in verdicts):
        return 1
    return 0


def summary(records: Sequence[Mapping[str, Any]], *, then: bool, seconds: float) -> dict[str, Any]:
    """The counts by verdict, what the live parts spent, the wall-clock ``seconds`` and the
    status to exit with."""
    counts = {verdict: sum(r.get("verdict") == verdict for r in records) for verdict in VERDICTS}
    live = _no_live()
    for record in records:
        for key, value in (record.get("live") or {}).items():
            live[key] = live.get(key, 0) + value
    live["cost_usd"] = round(live["cost_usd"], 6)
    return {"incidents": len(records), **counts, "live": live, "seconds": round(seconds, 3),
            "exit_status": exit_status(records, then=then)}
