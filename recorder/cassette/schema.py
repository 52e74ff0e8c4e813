"""What a cassette line holds, and the rules every reader of a line shares.

A cassette is JSON Lines: a header, then one observation per line, each with a dense
``seq`` and a ``kind`` (:class:`Kind`); a finished run's last line is the ``end`` line.
This module is the one home of what those lines mean:

- the names: the line kinds (:class:`Kind`), the statuses a run ends with
  (:class:`EndStatus`) and the events of a control line (:class:`Control`). Being
  ``StrEnum`` members they compare and hash equal to the strings on disk; the one
  vocabulary of a run's status, whoever shows it (:class:`RunStatus`, :func:`run_status`);
- a typed record per line kind (:class:`Header`, :class:`ModelLine` ... :class:`EndLine`),
  told apart by ``kind``;
- the decisions more than one reader makes about a line: which control lines are
  bookkeeping (:func:`is_bookkeeping`), what a step counts for in a run's totals
  (:func:`add_step`, :func:`totals_of`: the end line, ``deja show``, ``ls``, ``diff``, the
  index and the viewer all count with them), which path a run's ``<run>.jsonl`` goes to
  (:func:`run_file`), and the timestamps lines carry (:func:`utc_stamp`).

The records are ``TypedDict``s, not classes: a line is loaded as the dict ``json`` builds,
and a ``TypedDict`` types that very dict. Nothing is copied, converted or validated per
line (the reader checks field types once, in :mod:`recorder.cassette._validate`), so
loading and replaying a cassette of thousands of lines costs what parsing the JSON costs;
a dataclass per line would double that, and every writer and reader would have to convert
at the edges.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Required, TypedDict

from recorder.errors import ConfigError


class Kind(enum.StrEnum):
    """The kind of a cassette line after the header (the order is the format's)."""

    MODEL = "model"  # a call to a model API
    HTTP = "http"  # any other HTTP exchange
    TOOL = "tool"  # a tool call and its result (an MCP server's tools/call among them)
    MCP = "mcp"  # another request to an MCP server (initialize, tools/list, resources/read)
    INTENT = "intent"  # a side-effecting tool is about to run
    OUTCOME = "outcome"  # what that tool did
    EFFECT = "effect"  # a nondeterministic value the program asked for (time, uuid ...)
    CONTROL = "control"  # a decision about the run (see Control)
    END = "end"  # the run is over: its status and totals


class EndStatus(enum.StrEnum):
    """The ``status`` of an end line."""

    COMPLETED = "completed"
    ERROR = "error"  # the program raised, or exited non-zero
    INTERRUPTED = "interrupted"  # a signal or a failed disk stopped it: it can be resumed
    STOPPED = "stopped"  # a guard stopped it (a loop, an open circuit)
    EXHAUSTED = "exhausted"  # a budget ran out
    CANCELLED = "cancelled"  # someone asked it to stop
    NEEDS_ATTENTION = "needs_attention"  # a side effect's fate needs a person


class Control(enum.StrEnum):
    """The ``event`` of a control line."""

    BUDGET_EXHAUSTED = "budget_exhausted"
    CANCELLED = "cancelled"
    LOOP_DETECTED = "loop_detected"
    CIRCUIT_OPEN = "circuit_open"
    MAX_TOKENS_CLAMPED = "max_tokens_clamped"  # a request's max_tokens was lowered
    FORK_EDIT = "fork_edit"  # a fork's edited step: the patch
    RESUMED = "resumed"  # a resumed run goes on from here
    SENDING = "sending"  # a destructive MCP tool call goes to its server; its line follows
    CONTINUES = "continues"  # the tool body it is within runs again a call under way


# Control lines that refused a call: a replay raises them at the same point.
STOPS = frozenset({Control.BUDGET_EXHAUSTED, Control.CANCELLED, Control.LOOP_DETECTED,
                   Control.CIRCUIT_OPEN})
# Control lines that only mark how the log was made; they stand for nothing the agent did.
BOOKKEEPING = frozenset({Control.FORK_EDIT, Control.RESUMED, Control.SENDING,
                         Control.CONTINUES})


class RunStatus(enum.StrEnum):
    """A run's status as every reader shows it (``deja status``, ``deja runs``, the runs
    API, ``deja show`` and ``ls``, the viewer, alerts), derived by :func:`run_status`.

    The end statuses are the end line's, but for ``error``, shown as ``failed``; the
    others say where a run without a final end line is."""

    QUEUED = "queued"  # submitted, waiting for a worker
    WORKING = "working"  # a worker runs it (a submitted run)
    RUNNING = "running"  # a process on this machine writes it (``deja record``)
    INPUT_REQUIRED = "input_required"  # it waits for an answer (``recorder.ask``)
    COMPLETED = "completed"
    FAILED = "failed"  # end line ``error``: the program raised, exited non-zero, never started
    CANCELLED = "cancelled"
    EXHAUSTED = "exhausted"
    STOPPED = "stopped"
    INTERRUPTED = "interrupted"  # resumable; under a worker only a full disk leaves it so
    NEEDS_ATTENTION = "needs_attention"
    CRASHED = "crashed"  # no end line, and the process that wrote it is gone
    INCOMPLETE = "incomplete"  # no end line, nothing says who writes it (a copy, a cut file)
    TORN = "torn"  # the last line is cut short


def run_status(end: Mapping[str, Any] | None, state: str | None = None) -> str:
    """A run's status: its end line first, then ``state`` (what the queue, the engine or
    the status record says of a run whose cassette holds no final end line).

    An end line is final but for ``interrupted``, which a resume cuts: while ``state`` is
    known (a worker dispatches the run again, a disk-full run waits for room, retries
    ran out) it says more. Without either: ``incomplete``."""
    status = end.get("status") if end is not None else None
    if isinstance(status, str) and status and not (
            status == EndStatus.INTERRUPTED and state):
        return RunStatus.FAILED.value if status == EndStatus.ERROR else status
    return state or RunStatus.INCOMPLETE.value


# -------------------------------------------------------------------- the records
# A line's ``kind`` is typed as its Kind member: a line read from disk holds the equal
# string, and a type checker narrows a Line by comparing its kind with Kind (a bare
# string compared with it is an error under mypy's strict equality).


class Parent(TypedDict, total=False):
    """A fork's header names the run and step it was forked from."""

    run: str
    step: int
    prefix_sig: str
    path: str


class Header(TypedDict, total=False):
    """Line 1. ``format`` comes first; the reader removes ``sig``."""

    format: Required[str]
    features: list[str]  # the optional features of the format the cassette uses
    run: Required[str]
    key_id: str
    parent: Parent | None
    created: str | None
    argv: list[str] | None
    cwd: str | None
    cassette: str | None
    entry: str | None
    versions: dict[str, str] | None
    labels: dict[str, Any] | None
    budgets: dict[str, Any] | None
    loop: dict[str, Any] | None
    breaker: dict[str, Any] | None
    fsync: str | None
    redact: dict[str, Any] | None
    sig: str


class ErrorRecord(TypedDict, total=False):
    """An exception as stored: ``type``, ``module``, ``message``."""

    type: str
    module: str
    message: str
    has_response: bool  # model and HTTP lines: whether a response came before it
    code: int  # an MCP server's JSON-RPC error: its code (and ``data``, if it sent any)
    data: Any


class Usage(TypedDict, total=False):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cache_creation_1h_input_tokens: int  # of the cache writes, those kept for an hour


class Response(TypedDict, total=False):
    status: Required[int]
    reason: str
    headers: list[list[str] | None]
    body: str  # text, or base64 with ``encoding``
    encoding: str | None
    body_json: Any  # on disk only: the body as JSON (see compact)
    headers_base: int | None  # on disk only


class _Step(TypedDict, total=False):
    """What any observation line may carry."""

    seq: Required[int]
    t: float | None  # when it started (seconds since the epoch)
    ms: float | None  # how long it took
    fp: str  # what a replay matches it by
    within: str  # made inside this tool call's body
    call: str  # a tool line's, outcome's or intent's: the call its body's lines are within
    edited: bool  # a fork's edited step
    error: ErrorRecord | None
    usage: Usage | None
    cost_usd: float | None
    sig: str  # removed by the reader


class ModelLine(_Step, total=False):
    kind: Required[Literal[Kind.MODEL]]
    provider: str
    url: str  # on disk, possibly the seq of an earlier line with the same URL
    request: Any  # on disk, a delta of the conversation; the reader keeps the full body apart
    request_headers: list[list[str]]
    response: Response
    api_error: ErrorRecord  # the error the response body reports
    stop_reason: str | None
    message_id: str | None
    model: str | None
    stream: bool
    ttft_ms: float
    clamped_max_tokens: int


class HttpRequest(TypedDict):
    headers: list[list[str]]
    body: Any


class HttpLine(_Step, total=False):
    kind: Required[Literal[Kind.HTTP]]
    method: Required[str]
    url: Required[str]
    request: Required[HttpRequest]
    response: Response
    ttft_ms: float


class McpServer(TypedDict, total=False):
    """An MCP server as its lines name it: ``stdio`` with its command, or ``http`` with its
    URL; the name and version it gave."""

    transport: Required[str]
    command: list[str]
    url: str
    name: str
    version: str


class McpPart(TypedDict, total=False):
    """What a line of an MCP exchange says of it: the server, the JSON-RPC method, the
    server's notifications before its answer (``{"method", "params"}``, in order), and
    whether the tool called is one the server annotated ``destructiveHint: true``."""

    server: Required[McpServer]
    method: Required[str]
    notifications: list[dict[str, Any]]
    destructive: bool


class ToolLine(_Step, total=False):
    kind: Required[Literal[Kind.TOOL]]
    name: Required[str]
    args: Any
    result: Any
    mcp: McpPart  # a tool of an MCP server: its result is the CallToolResult as sent
    # A tool the agent ran itself, seen at a boundary (``"proxy"``: a tool_result block of
    # the next model request): never asked for on replay. ``call_id`` is the model's id of
    # the call (its tool_use block), ``is_error`` the block's flag.
    observed: str
    call_id: str
    is_error: bool


class McpLine(_Step, total=False):
    """A request to an MCP server other than a tool call: its ``params`` (without
    ``_meta``), and its ``result`` or ``error``."""

    kind: Required[Literal[Kind.MCP]]
    mcp: Required[McpPart]
    params: dict[str, Any]
    result: Any


class IntentLine(_Step, total=False):
    kind: Required[Literal[Kind.INTENT]]
    name: Required[str]
    args: Any
    key: str


class OutcomeLine(_Step, total=False):
    kind: Required[Literal[Kind.OUTCOME]]
    name: Required[str]
    intent: Required[int]  # the seq of its intent
    key: Required[str]
    result: Any


class EffectLine(_Step, total=False):
    kind: Required[Literal[Kind.EFFECT]]
    name: Required[str]
    value: Any
    site: Any  # where in the program it was asked for


class ControlLine(_Step, total=False):
    kind: Required[Literal[Kind.CONTROL]]
    event: Required[str]  # a Control
    detail: dict[str, Any] | None


class Totals(TypedDict):
    """What a run (or a part of it) spent; see :func:`add_step`."""

    model_calls: int
    http_calls: int
    tool_calls: int
    effects: int
    input_tokens: int
    output_tokens: int
    cost_usd: float
    errors: int


class StepTotals(Totals):
    steps: int


class EndTotals(Totals, total=False):
    duration_s: float
    observations: int  # the run's step count
    replayed: dict[str, int | float]  # a fork or a resumed run: what it replayed


class EndLine(TypedDict, total=False):
    seq: Required[int]
    kind: Required[Literal[Kind.END]]
    status: Required[str]  # an EndStatus
    totals: EndTotals | None
    error: ErrorRecord | None
    reason: str | None
    exit_code: int | None
    sig: str


Observation = (ModelLine | HttpLine | ToolLine | McpLine | IntentLine | OutcomeLine
               | EffectLine | ControlLine)
"""A step: any line with a seq but the end line."""
Line = Observation | EndLine


# ------------------------------------------------------------------ the decisions


def control_event(obs: Mapping[str, Any]) -> str | None:
    """The event of a control line (a :class:`Control`); None for any other line."""
    return obs.get("event") if obs.get("kind") == Kind.CONTROL else None


def is_bookkeeping(obs: Mapping[str, Any]) -> bool:
    """A control line that marks how the log was made (a fork's edit, a resume), not
    something the agent did: ``deja diff`` leaves these out when it aligns two runs."""
    return control_event(obs) in BOOKKEEPING


def error_of(obs: Mapping[str, Any]) -> ErrorRecord | None:
    """The error a step ended with: its own (an exception), else the one its response
    body reports. A step with one counts as an error in the totals."""
    return obs.get("error") or obs.get("api_error") or None


def zero_totals() -> Totals:
    """Totals of nothing, in the order the end line writes them."""
    return {"model_calls": 0, "http_calls": 0, "tool_calls": 0, "effects": 0,
            "input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0, "errors": 0}


def add_step(t: Totals, obs: Mapping[str, Any]) -> None:
    """Add what ``obs`` counts for to ``t``: the one rule, for a cassette's steps and for
    a live run's end line. A ``model`` line is a model call, ``http`` an HTTP call,
    ``tool`` and ``outcome`` a tool call (an MCP server's too), ``effect`` an effect
    (intents, control lines and an MCP server's other requests are none); its tokens and
    cost are added, and it is an error when :func:`error_of` finds one or its response
    has an HTTP error status. ``cost_usd`` is summed as is (round it when you show it)."""
    kind = obs.get("kind")
    if kind == Kind.MODEL:
        t["model_calls"] += 1
    elif kind == Kind.HTTP:
        t["http_calls"] += 1
    elif kind in (Kind.TOOL, Kind.OUTCOME):
        t["tool_calls"] += 1
    elif kind == Kind.EFFECT:
        t["effects"] += 1
    usage = obs.get("usage") or {}
    t["input_tokens"] += usage.get("input_tokens") or 0
    t["output_tokens"] += usage.get("output_tokens") or 0
    t["cost_usd"] += obs.get("cost_usd") or 0.0
    response = obs.get("response")
    status = response.get("status") if isinstance(response, Mapping) else None
    if error_of(obs) or (isinstance(status, int) and status >= 400):
        t["errors"] += 1


def totals_of(observations: Iterable[Mapping[str, Any]]) -> StepTotals:
    """The steps of ``observations`` and what they count for (:func:`add_step`); the cost
    rounded to 8 places, as the end line has it."""
    t = zero_totals()
    steps = 0
    for obs in observations:
        steps += 1
        add_step(t, obs)
    return step_totals(t, steps)


def step_totals(t: Totals, steps: int) -> StepTotals:
    """The totals ``t`` of ``steps`` steps as :func:`totals_of` gives them."""
    return {"steps": steps, "model_calls": t["model_calls"], "http_calls": t["http_calls"],
            "tool_calls": t["tool_calls"], "effects": t["effects"],
            "input_tokens": t["input_tokens"], "output_tokens": t["output_tokens"],
            "errors": t["errors"], "cost_usd": round(t["cost_usd"], 8)}


def replayed_totals(observations: Iterable[Mapping[str, Any]]) -> dict[str, int | float]:
    """What a fork or resumed run's end line says it replayed (``totals.replayed``)."""
    t = totals_of(observations)
    return {"model_calls": t["model_calls"], "http_calls": t["http_calls"],
            "tool_calls": t["tool_calls"], "effects": t["effects"],
            "input_tokens": t["input_tokens"], "output_tokens": t["output_tokens"],
            "cost_usd": t["cost_usd"]}


def run_file(path: str | Path, run_id: str) -> Path:
    """The cassette file a run writes when it is told ``path``.

    An existing directory, or a name that ends in a separator or has no suffix, is a
    directory: the file is ``<run_id>.jsonl`` in it. A name with a suffix (``run.jsonl``)
    is the file itself. An existing file without a suffix is refused with
    :class:`ConfigError`, rather than guessed at.
    """
    text = os.fspath(path)
    target = Path(text)
    if target.is_dir() or text.endswith(("/", os.sep)):
        return target / f"{run_id}.jsonl"
    if target.suffix:
        return target
    if not target.exists() or target.is_dir():  # (made since: by a run starting beside)
        return target / f"{run_id}.jsonl"
    raise ConfigError(f"{target} is a file without a suffix, not a cassette (.jsonl) nor a "
                      "directory: name a file ending in .jsonl, or a directory to create "
                      "<run id>.jsonl in")


def utc_stamp(timespec: Literal["seconds", "milliseconds"] = "milliseconds") -> str:
    """Now, in UTC, as lines and status records store it: ``2025-01-31T12:00:00.123Z``."""
    return datetime.now(UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


__all__ = [
    "BOOKKEEPING",
    "STOPS",
    "Control",
    "ControlLine",
    "EffectLine",
    "EndLine",
    "EndStatus",
    "EndTotals",
    "ErrorRecord",
    "Header",
    "HttpLine",
    "IntentLine",
    "Kind",
    "Line",
    "McpLine",
    "McpPart",
    "McpServer",
    "ModelLine",
    "Observation",
    "OutcomeLine",
    "Parent",
    "Response",
    "RunStatus",
    "StepTotals",
    "ToolLine",
    "Totals",
    "Usage",
    "add_step",
    "control_event",
    "error_of",
    "is_bookkeeping",
    "replayed_totals",
    "run_file",
    "run_status",
    "step_totals",
    "totals_of",
    "utc_stamp",
    "zero_totals",
]
