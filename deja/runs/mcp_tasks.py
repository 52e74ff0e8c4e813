"""Runs as MCP tasks: what ``deja serve``'s ``/mcp`` endpoint answers, in the terms of the
MCP Tasks extension (``io.modelcontextprotocol/tasks``, SEP-2663, its 2026-07-28 text).

An MCP client submits a run by calling the tool ``run`` (the fields of ``POST /runs``:
``command``, ``cwd``, ``labels``, ``guards``) and is answered with a **task** instead of
the tool's result (``resultType: "task"``); it polls ``tasks/get``, answers the question a
run asks with ``tasks/update``, and stops it with ``tasks/cancel``. The official ``mcp``
SDK's low-level server serves the protocol (JSON-RPC, ``server/discover``, ``initialize``,
the per-request envelope); this module only says what each method does to runs.

Choices where the extension leaves room, or where a run is not a plain tool call:

- **Who may get a task.** The extension is defined on the 2026-07-28 wire, whose requests
  each carry the client's capabilities. A request whose capabilities do not name the
  extension is refused ``-32021`` (missing required client capability), as the extension
  says; so is every handshake-era (``initialize``) client, whose results cannot carry a
  task: such a client may list the tool, not call it. The extension is declared in
  ``server/discover``'s capabilities (2025-11-25's ``initialize`` result has no place for
  extensions).
- **Task ids** are 256 random bits (``secrets.token_urlsafe``), never the run's id, and are
  stored only as their SHA-256. Each is bound to the token that created it (its SHA-256
  again): for any other caller a task id is unknown, ``-32602`` "Task not found", the
  answer for an id that never existed. There is no ``tasks/list`` (the extension has none),
  nor ``tasks/result``: a completed task carries its result.
- **Statuses.** ``queued`` and ``working`` are ``working`` (and so is ``interrupted``: such
  a run is dispatched again); ``input_required`` is ``input_required`` with one elicitation
  (a form of one string field, ``answer``) under the key ``ask-N``, N the answers the run
  got before (unique for the task's life, as the extension requires); ``completed`` is
  ``completed`` with a ``CallToolResult``; ``cancelled`` is ``cancelled``. A run that
  failed, ran out of a budget, was stopped by a guard or needs attention is a tool call
  that ended in error, so ``completed`` with ``isError: true`` and the run's error: the
  extension keeps ``failed`` for JSON-RPC errors, which here means the run's record is gone
  from the runs database.
- **Answers.** ``tasks/update`` answers the run with ``inputResponses["ask-N"]``, an
  elicitation result whose action is ``accept`` and whose ``content.answer`` is a string. A
  response to any other key, ``decline`` or ``cancel`` (the question dismissed) is ignored,
  as the extension says of responses that answer nothing outstanding: the run waits on, for
  another answer or ``tasks/cancel``.
- ``ttlMs`` is null: deja keeps runs and their tasks until they are removed by hand.
  ``pollIntervalMs`` is :data:`POLL_MS`.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Callable
from typing import Any

import mcp_types as types
import sqlalchemy as sa
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from deja.runs.errors import BadRunRequest
from recorder.errors import DejaError, NoSuchRun
from recorder.launch import new_run_id

__all__ = ["CALLER", "POLL_MS", "TASKS", "TOOL", "TaskBook", "build_server", "caller_of",
           "task_of"]

TASKS = "io.modelcontextprotocol/tasks"
TOOL = "run"
POLL_MS = 1000  # the polling interval a task suggests
CALLER = "deja.caller"  # the ASGI scope key the endpoint puts the caller's identity under
_NOT_FOUND = "Failed to retrieve task: Task not found"
_WORKING = {"queued", "working", "interrupted"}

_metadata = sa.MetaData()
tasks_table = sa.Table(
    "deja_mcp_tasks", _metadata,
    sa.Column("task_key", sa.String(64), primary_key=True),  # SHA-256 of the task id
    sa.Column("run_id", sa.String(128), nullable=False),
    sa.Column("caller", sa.String(64), nullable=False),  # SHA-256 of the caller's token
    sa.Column("created", sa.Float, nullable=False),
)

INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                    "description": "The program and its arguments, e.g. [\"python\", "
                                   "\"agent.py\"]. Stored in the runs database: no secrets."},
        "cwd": {"type": "string", "description": "The absolute directory it runs in."},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "guards": {"type": "object", "description": "The guards of `deja record`: "
                   "max_turns, max_dollars, max_seconds, max_tokens, max_tokens_per_turn, "
                   "clamp_max_tokens, loop_guard, breaker."},
    },
    "required": ["command"],
    "additionalProperties": False,
}


def caller_of(token: str) -> str:
    """The identity a task is bound to: the SHA-256 of the token that created it."""
    return hashlib.sha256(token.encode()).hexdigest()


def _key(task_id: str) -> str:
    return hashlib.sha256(task_id.encode()).hexdigest()


class TaskBook:
    """Which run each task is, and whose task it is: a table beside deja's own."""

    def __init__(self, store: Any) -> None:
        from deja.runs.store import unavailable

        self.store = store
        for attempt in range(20):  # another server creating it at the same moment
            try:
                _metadata.create_all(store.engine, checkfirst=True)
                break
            except sa.exc.DBAPIError as exc:
                if attempt == 19:
                    raise unavailable(store.url, exc) from None
                time.sleep(0.05 * (attempt + 1))

    def add(self, task_id: str, run_id: str, caller: str) -> None:
        with self.store.begin() as conn:
            conn.execute(tasks_table.insert().values(
                task_key=_key(task_id), run_id=run_id, caller=caller, created=time.time()))

    def forget(self, task_id: str) -> None:
        with self.store.begin() as conn:
            conn.execute(tasks_table.delete().where(tasks_table.c.task_key == _key(task_id)))

    def run_of(self, task_id: str, caller: str) -> str | None:
        """The run of ``caller``'s task ``task_id``; None for another caller's, as for an
        id that never was."""
        with self.store.begin() as conn:
            row = conn.execute(sa.select(tasks_table.c.run_id, tasks_table.c.caller).where(
                tasks_table.c.task_key == _key(task_id))).first()
        if row is None or not secrets.compare_digest(row.caller, caller):
            return None
        return str(row.run_id)


# -- what a run looks like as a task


def _text(record: dict[str, Any]) -> str:
    """The run's outcome in a sentence or two, for a person or a model."""
    said = f"run {record['run_id']} {record['status']}"
    if record.get("artefacts"):
        said += "; artefacts: " + ", ".join(a["path"] for a in record["artefacts"])
    if record.get("error"):
        said += f"; error: {record['error']}"
    return said


def _result(record: dict[str, Any]) -> dict[str, Any]:
    """The ``CallToolResult`` of an ended run."""
    shown = {k: record.get(k) for k in ("run_id", "status", "artefacts", "cassette", "turn",
                                        "tokens", "spend_usd", "error") if record.get(k)}
    result = types.CallToolResult(content=[types.TextContent(text=_text(record))],
                                  structured_content=shown,
                                  is_error=record["status"] != "completed")
    return result.model_dump(by_alias=True, mode="json", exclude_none=True)


def _progress(record: dict[str, Any]) -> str:
    status = record["status"]
    if status == "queued":
        return f"run {record['run_id']} is queued: waiting for a worker"
    turn = f"turn {record['turn']}" if record.get("turn") is not None else "starting"
    if record.get("turn_limit"):
        turn += f" of {record['turn_limit']}"
    said = f"run {record['run_id']} is {status}: {turn}"
    return said + (f", {record['step']}" if record.get("step") else "")


def _question(record: dict[str, Any], attempt: int) -> dict[str, Any]:
    """The ``inputRequests`` of a run waiting on ``recorder.ask``."""
    form = types.ElicitRequest(params=types.ElicitRequestFormParams(
        message=str(record.get("question") or ""),
        requested_schema={"type": "object", "properties": {"answer": {"type": "string"}},
                          "required": ["answer"]}))
    return {f"ask-{attempt}": form.model_dump(by_alias=True, mode="json", exclude_none=True)}


def task_of(task_id: str, record: dict[str, Any], attempt: int) -> dict[str, Any]:
    """The ``DetailedTask`` of the run whose progress record is ``record`` (``attempt``:
    the answers it got so far)."""
    status = record["status"]
    extra: dict[str, Any] = {}
    if status in _WORKING:
        status, message = "working", _progress(record)
    elif status == "input_required":
        message = str(record.get("question") or "")
        extra["inputRequests"] = _question(record, attempt)
    elif status == "cancelled":
        message = f"run {record['run_id']} was cancelled"
    else:
        status, message = "completed", _text(record)
        extra["result"] = _result(record)
    return {"taskId": task_id, "status": status, "statusMessage": message,
            "createdAt": record["submitted"],
            "lastUpdatedAt": record["updated"] or record["submitted"],
            "ttlMs": None, "pollIntervalMs": POLL_MS, **extra}


def _gone(task_id: str, run_id: str) -> dict[str, Any]:
    """The task of a run whose record is no longer in the runs database: failed."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    message = f"run {run_id} is no longer in the runs database"
    return {"taskId": task_id, "status": "failed", "statusMessage": message,
            "createdAt": stamp, "lastUpdatedAt": stamp, "ttlMs": None,
            "error": {"code": types.INTERNAL_ERROR, "message": message}}


# -- the methods


class TaskParams(types.RequestParams):
    task_id: str


class UpdateParams(TaskParams):
    input_responses: dict[str, Any]


def _caller(ctx: Any) -> str:
    """The identity the endpoint found for this request, after it checked the token."""
    request = getattr(ctx, "request", None)
    caller = request.scope.get(CALLER) if request is not None else None
    if not isinstance(caller, str):
        raise MCPError(types.INTERNAL_ERROR, "deja serve: no caller identity on the request")
    return caller


def _require_tasks(ctx: Any) -> None:
    """-32021 unless this request's client declares the Tasks extension (2026-07-28)."""
    capabilities = ctx.session.client_capabilities
    declared = capabilities is not None and TASKS in (capabilities.extensions or {})
    if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS or not declared:
        raise MCPError(types.MISSING_REQUIRED_CLIENT_CAPABILITY,
                       "Missing required client capability: a deja run is a task (the "
                       f"{TASKS} extension, protocol {MODERN_PROTOCOL_VERSIONS[-1]}); declare "
                       "it in the request's client capabilities",
                       {"requiredCapabilities": {"extensions": {TASKS: {}}}})


def _answer_of(response: Any) -> str | None:
    """The answer in an elicitation result; None when it answers nothing (declined)."""
    if not isinstance(response, dict) or response.get("action") not in (
            "accept", "decline", "cancel"):
        raise MCPError(types.INVALID_PARAMS, "an input response is an elicitation result: "
                       '{"action": "accept", "content": {"answer": "TEXT"}}')
    if response["action"] != "accept":
        return None
    answer = (response.get("content") or {}).get("answer")
    if not isinstance(answer, str):
        raise MCPError(types.INVALID_PARAMS, 'the answer is content.answer, a string: '
                       '{"action": "accept", "content": {"answer": "TEXT"}}')
    return answer


class TaskMethods:
    """``tools/list``, ``tools/call``, ``tasks/get``, ``tasks/update`` and ``tasks/cancel``
    over ``runs`` (a :class:`deja.runs.service.Runs`); database work runs in a thread."""

    def __init__(self, runs: Any) -> None:
        self.runs = runs
        self.book = TaskBook(runs.store)

    async def _off_loop(self, work: Callable[[], Any]) -> Any:
        try:
            return await asyncio.to_thread(work)
        except (MCPError, BadRunRequest):  # the latter: the tool's error (call_tool)
            raise
        except DejaError as exc:  # the database away, above all
            raise MCPError(types.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}") from None

    async def list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[types.Tool(
            name=TOOL, title="Run an agent under deja",
            description="Submit a command as a durable deja run (recorded, guarded, resumed "
                        "if its worker dies). Answered with a task: poll it, answer the "
                        "question it asks, cancel it.",
            input_schema=INPUT_SCHEMA)])

    async def call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> Any:
        if params.name != TOOL:
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {params.name!r}; deja serve "
                           f"offers {TOOL!r}")
        _require_tasks(ctx)
        caller = _caller(ctx)
        arguments = dict(params.arguments or {})
        if "run_id" in arguments:  # a chosen id could name another caller's run
            return _tool_error("a run submitted as a task gets its own id; leave out run_id")
        try:
            return await self._off_loop(lambda: self._submit(arguments, caller))
        except BadRunRequest as exc:
            return _tool_error(str(exc))

    def _submit(self, arguments: dict[str, Any], caller: str) -> dict[str, Any]:
        task_id, run_id = secrets.token_urlsafe(32), new_run_id()
        self.book.add(task_id, run_id, caller)  # first: no run is ever left without its task
        try:
            self.runs.submit({**arguments, "run_id": run_id})
        except BaseException:
            self.book.forget(task_id)
            raise
        return {"resultType": "task", **self._task(task_id, run_id)}

    def _task(self, task_id: str, run_id: str) -> dict[str, Any]:
        row = self.runs.store.get_run(run_id)  # before the record: its attempt is not newer
        try:
            record = self.runs.get(run_id)
        except NoSuchRun:
            return _gone(task_id, run_id)
        return task_of(task_id, record, int((row or {}).get("attempt") or 0))

    def _run(self, task_id: str, caller: str) -> str:
        run_id = self.book.run_of(task_id, caller)
        if run_id is None:
            raise MCPError(types.INVALID_PARAMS, _NOT_FOUND)
        return run_id

    async def get(self, ctx: Any, params: TaskParams) -> dict[str, Any]:
        _require_tasks(ctx)
        caller = _caller(ctx)
        task: dict[str, Any] = await self._off_loop(
            lambda: self._task(params.task_id, self._run(params.task_id, caller)))
        return {"resultType": "complete", **task}

    async def update(self, ctx: Any, params: UpdateParams) -> dict[str, Any]:
        _require_tasks(ctx)
        caller = _caller(ctx)
        answers = {key: _answer_of(value) for key, value in params.input_responses.items()}
        await self._off_loop(lambda: self._answer(self._run(params.task_id, caller), answers))
        return {"resultType": "complete"}

    def _answer(self, run_id: str, answers: dict[str, str | None]) -> None:
        row = self.runs.store.get_run(run_id)
        answer = answers.get(f"ask-{int((row or {}).get('attempt') or 0)}")
        if row is None or answer is None:
            return  # nothing outstanding is answered: ignored
        try:
            self.runs.answer(run_id, answer)
        except BadRunRequest as exc:
            if "not waiting for an answer" not in str(exc):
                raise MCPError(types.INVALID_PARAMS, str(exc)) from None
            # answered meanwhile, or not asking yet: nothing outstanding, ignored

    async def cancel(self, ctx: Any, params: TaskParams) -> dict[str, Any]:
        _require_tasks(ctx)
        caller = _caller(ctx)
        await self._off_loop(lambda: self.runs.cancel(self._run(params.task_id, caller)))
        return {"resultType": "complete"}


def _tool_error(message: str) -> types.CallToolResult:
    """A call refused before any run or task was made: the tool's error, for the model."""
    return types.CallToolResult(content=[types.TextContent(text=message)], is_error=True)


def build_server(runs: Any, version: str = "") -> Server[Any]:
    """The MCP server of ``deja serve``: the ``run`` tool, answered with tasks."""
    methods = TaskMethods(runs)
    server: Server[Any] = Server("deja", version=version, title="deja runs",
                                 instructions="Submit durable agent runs with the tool 'run'; "
                                              "each is a task to poll, answer and cancel.")
    server.add_request_handler("tools/list", types.PaginatedRequestParams, methods.list_tools)
    server.add_request_handler("tools/call", types.CallToolRequestParams, methods.call_tool)
    server.add_request_handler("tasks/get", TaskParams, methods.get)
    server.add_request_handler("tasks/update", UpdateParams, methods.update)
    server.add_request_handler("tasks/cancel", TaskParams, methods.cancel)
    server.extensions[TASKS] = {}
    return server
