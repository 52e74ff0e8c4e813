"""Runs as MCP tasks, end to end: a real ``python -m deja serve`` and ``python -m deja
worker``, and the official ``mcp`` SDK's client over Streamable HTTP, declaring the Tasks
extension (``io.modelcontextprotocol/tasks``). A run is submitted by calling the tool
``run`` and answered with a task; the client polls ``tasks/get`` to ``input_required``,
answers with ``tasks/update``, polls to ``completed`` and reads the result; another run
it cancels with ``tasks/cancel``. A second client, with a token of its own, gets "not
found" for the first one's task, whatever it asks. The ``/mcp`` endpoint is behind the
checks of every other route: ``Host``, ``Origin``, the token, ``Content-Type``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar, Literal

import anyio
import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from test_api import Deja, api, deja, watch  # noqa: F401 (the deja fixture)
from test_api_guard import named, raw_request

from deja.runs.auth import read_token

TASKS = "io.modelcontextprotocol/tasks"
OTHER_TOKEN = "another-clients-token-0123456789abcdef"
NOT_FOUND = "Task not found"


class CreateTaskResult(types.Result):
    """The extension's answer to a task-augmented call (``resultType: "task"``)."""

    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    status_message: str | None = None
    created_at: str
    last_updated_at: str
    ttl_ms: int | None = None
    poll_interval_ms: int | None = None


class TaskRef(types.RequestParams):
    task_id: str


class UpdateRef(TaskRef):
    input_responses: dict[str, Any]


class TaskRequest(types.Request[TaskRef, str]):
    """``tasks/get`` and ``tasks/cancel``; ``Mcp-Name`` carries the task id, as the
    extension asks of a client over Streamable HTTP."""

    name_param: ClassVar[str | None] = "taskId"


class UpdateRequest(types.Request[UpdateRef, str]):
    name_param: ClassVar[str | None] = "taskId"


class Reply(types.Result):
    """Any result, its fields kept (a ``DetailedTask``, or the empty acknowledgement)."""

    model_config = {**types.Result.model_config, "extra": "allow"}


async def _unresolved(result: CreateTaskResult, ctx: ClaimContext) -> types.CallToolResult:
    raise AssertionError("these tests drive the task themselves (allow_claimed=True)")


class Tasks(ClientExtension):
    """The client side of the extension: it claims ``resultType: "task"``."""

    identifier = TASKS

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreateTaskResult, resolve=_unresolved)]


class Caller:
    """One MCP client of ``deja serve``'s ``/mcp``, with its own token."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def submit(self, arguments: dict[str, Any]) -> CreateTaskResult:
        created = await self.client.session.call_tool("run", arguments, allow_claimed=True)
        assert isinstance(created, CreateTaskResult), created
        return created

    async def ask(self, method: str, task_id: str, **more: Any) -> dict[str, Any]:
        session = self.client.session
        if method == "tasks/update":
            request: types.Request[Any, str] = UpdateRequest(
                method=method, params=UpdateRef(task_id=task_id, **more))
        else:
            request = TaskRequest(method=method, params=TaskRef(task_id=task_id))
        reply = await session.send_request(request, Reply)
        return reply.model_dump(by_alias=True, mode="json", exclude_none=True,
                                exclude={"meta"})  # the server's name, on every result

    async def poll(self, task_id: str, until: Callable[[dict[str, Any]], bool],
                   timeout: float = 60) -> tuple[dict[str, Any], list[str]]:
        """``tasks/get`` until ``until(task)``; the task and the statuses seen."""
        seen: list[str] = []
        with anyio.fail_after(timeout):
            while True:
                task = await self.ask("tasks/get", task_id)
                if not seen or seen[-1] != task["status"]:
                    seen.append(task["status"])
                if until(task):
                    return task, seen
                await anyio.sleep(0.1)

    async def refused(self, method: str, task_id: str, **more: Any) -> MCPError:
        with pytest.raises(MCPError) as caught:
            await self.ask(method, task_id, **more)
        return caught.value


@asynccontextmanager
async def connect(url: str, token: str, *, extensions: bool = True,
                  mode: str = "auto") -> AsyncIterator[Caller]:
    http = httpx2.AsyncClient(headers={"authorization": f"Bearer {token}"}, timeout=30)
    async with http, Client(streamable_http_client(f"{url}/mcp", http_client=http),
                            extensions=[Tasks()] if extensions else None, mode=mode) as client:
        yield Caller(client)


def run_async(work: Callable[[], Awaitable[None]]) -> None:
    anyio.run(work)


@pytest.fixture
def served(deja: Deja, tmp_path: Path) -> Iterator[str]:  # noqa: F811
    """``deja serve`` with a second MCP client's token, and one worker; the address."""
    tokens = tmp_path / "mcp-tokens"
    tokens.write_text(f"# the reporting assistant\n{OTHER_TOKEN}\n")
    tokens.chmod(0o600)
    server = deja.serve("--mcp-tokens", str(tokens))
    deja.worker("w1")
    yield server.url


def the_run(url: str, command: str) -> dict[str, Any]:
    """The one run, as the REST API shows it to the install's token, of ``command``."""
    status, body = api("GET", f"{url}/runs?limit=100")
    assert status == 200, body
    found = [r for r in body["runs"] if r["command"][-1] == command]
    assert len(found) == 1, body
    return dict(found[0])


def test_a_run_is_a_task_polled_answered_completed_and_another_cancelled(
        served: str, deja: Deja) -> None:  # noqa: F811
    url = served

    async def work() -> None:
        async with connect(url, str(read_token())) as owner, \
                connect(url, OTHER_TOKEN) as other:
            discovered = owner.client.session.discover_result
            assert discovered is not None and TASKS in (
                discovered.capabilities.extensions or {}), discovered
            tools = (await owner.client.list_tools()).tools
            assert [t.name for t in tools] == ["run"]
            assert tools[0].input_schema["required"] == ["command"]

            created = await owner.submit({"command": ["python", "ask_agent.py"],
                                          "cwd": str(deja.work), "guards": {"max_turns": 9}})
            task_id = created.task_id
            assert created.status == "working" and created.poll_interval_ms == 1000
            assert len(task_id) >= 40 and not task_id.startswith("r_")
            asked, seen = await owner.poll(task_id, lambda t: t["status"] == "input_required")
            assert seen[-1] == "input_required" and set(seen) <= {"working", "input_required"}
            assert asked["statusMessage"] == "Ship the weekly report?"
            request = asked["inputRequests"]["ask-0"]
            assert request["method"] == "elicitation/create"
            assert request["params"]["message"] == "Ship the weekly report?"

            # the other client: not found, whatever it asks; the run goes on waiting
            for method, more in (("tasks/get", {}), ("tasks/cancel", {}), (
                    "tasks/update", {"input_responses": {"ask-0": {
                        "action": "accept", "content": {"answer": "no"}}}})):
                refused = await other.refused(method, task_id, **more)
                assert (refused.code, refused.message) == (
                    types.INVALID_PARAMS, f"Failed to retrieve task: {NOT_FOUND}"), method
            unknown = await owner.refused("tasks/get", "no-such-task-" + "0" * 30)
            assert unknown.message == f"Failed to retrieve task: {NOT_FOUND}"

            # an answer to no outstanding request, or declined, answers nothing
            await owner.ask("tasks/update", task_id, input_responses={
                "ask-7": {"action": "accept", "content": {"answer": "no"}},
                "ask-0": {"action": "decline"}})
            assert (await owner.ask("tasks/get", task_id))["status"] == "input_required"
            ack = await owner.ask("tasks/update", task_id, input_responses={
                "ask-0": {"action": "accept", "content": {"answer": "yes, ship it"}}})
            assert ack == {"resultType": "complete"}, ack
            done, seen = await owner.poll(task_id, lambda t: t["status"] == "completed")
            result = done["result"]
            assert result["isError"] is False, done
            assert "completed" in result["content"][0]["text"]
            assert [a["path"] for a in result["structuredContent"]["artefacts"]] == [
                "report.txt"]
            assert (deja.work / "report.txt").read_text().startswith("shipped: yes, ship it")

            looping = await owner.submit({"command": ["python", "loop_agent.py"],
                                          "cwd": str(deja.work)})
            ticking, _ = await owner.poll(looping.task_id, lambda t: "tool tick" in t[
                "statusMessage"] or t["status"] != "working")  # the agent's tool, called
            assert ticking["status"] == "working", ticking
            assert (await other.refused("tasks/cancel", looping.task_id)).code == \
                types.INVALID_PARAMS
            assert (await owner.ask("tasks/cancel", looping.task_id)) == {
                "resultType": "complete"}
            cancelled, _ = await owner.poll(looping.task_id,
                                            lambda t: t["status"] != "working", timeout=30)
            assert cancelled["status"] == "cancelled", cancelled

    run_async(work)
    asked = the_run(url, "ask_agent.py")
    assert asked["status"] == "completed" and asked["labels"] == {}
    stopped, _ = watch(url, the_run(url, "loop_agent.py")["run_id"],
                       lambda r: bool(r.get("ended")), timeout=20)
    assert stopped["status"] == "cancelled"
    last = json.loads(Path(stopped["cassette"]).read_text().splitlines()[-1])
    assert last["kind"] == "end" and last["status"] == "cancelled"  # the agent stopped


def test_a_client_without_the_extension_cannot_make_a_task(served: str,
                                                           deja: Deja) -> None:  # noqa: F811
    """A 2026-07-28 client that does not declare the extension, and a handshake-era one
    (``initialize``), may list the tool; calling it is ``-32021``, and no run is made."""
    url = served

    async def work() -> None:
        for mode in ("auto", "legacy"):
            async with connect(url, str(read_token()), extensions=False, mode=mode) as plain:
                assert [t.name for t in (await plain.client.list_tools()).tools] == ["run"]
                with pytest.raises(MCPError) as caught:
                    await plain.client.session.call_tool(
                        "run", {"command": ["python", "ask_agent.py"]}, allow_claimed=True)
                assert caught.value.code == types.MISSING_REQUIRED_CLIENT_CAPABILITY, mode
                assert caught.value.data == {"requiredCapabilities": {"extensions": {
                    TASKS: {}}}}
        async with connect(url, OTHER_TOKEN) as client:
            refused = await client.client.session.call_tool(
                "run", {"command": ["python", "a.py", "--api-key", "sk-ant-api03-xxxxxxxxxx"]},
                allow_claimed=True)
            assert isinstance(refused, types.CallToolResult) and refused.is_error
            assert "looks like a secret" in refused.content[0].text  # type: ignore[union-attr]

    run_async(work)
    assert api("GET", f"{url}/runs")[1]["runs"] == []


MCP_BODY = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {
    "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
              "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS: {}}}}}})


def test_the_mcp_endpoint_has_the_checks_of_every_route(deja: Deja,  # noqa: F811
                                                        tmp_path: Path) -> None:
    tokens = tmp_path / "mcp-tokens"
    tokens.write_text(f"{OTHER_TOKEN}\n")
    tokens.chmod(0o600)
    url = deja.serve("--mcp-tokens", str(tokens)).url
    token = str(read_token())
    host = url.removeprefix("http://")
    good = {"host": host, "authorization": f"Bearer {token}",
            "content-type": "application/json", "accept": "application/json, text/event-stream",
            "mcp-protocol-version": "2026-07-28", "mcp-method": "tools/list"}

    def post(**changed: str | None) -> tuple[int, dict[str, str], bytes]:
        headers = {k: v for k, v in {**good, **changed}.items() if v is not None}
        return raw_request(url, "POST", "/mcp", MCP_BODY.encode(), headers)

    status, _, data = post()
    assert status == 200 and json.loads(data)["result"]["tools"][0]["name"] == "run"
    assert post(authorization=f"Bearer {OTHER_TOKEN}")[0] == 200
    cases: list[tuple[dict[str, str | None], int, str]] = [
        ({"host": "attacker.example"}, 421, "MisdirectedRequest"),  # DNS rebinding
        ({"host": "attacker.example:80", "origin": "http://attacker.example"}, 421,
         "MisdirectedRequest"),
        ({"origin": "http://attacker.example"}, 403, "ForeignOrigin"),  # a page's fetch
        ({"sec-fetch-site": "cross-site"}, 403, "ForeignOrigin"),
        ({"content-type": "text/plain"}, 415, "UnsupportedMediaType"),  # a form's post
        ({"content-type": "application/x-www-form-urlencoded"}, 415, "UnsupportedMediaType"),
        ({"authorization": None}, 401, "Unauthorized"),
        ({"authorization": f"Bearer {token}x"}, 401, "Unauthorized"),
        ({"authorization": f"Bearer {OTHER_TOKEN[:-1]}"}, 401, "Unauthorized"),
    ]
    for changed, code, kind in cases:
        status, headers, data = post(**changed)
        assert (status, named(data)) == (code, kind), changed
        assert "access-control-allow-origin" not in headers
    status, headers, data = raw_request(url, "GET", "/mcp", None, {
        k: v for k, v in good.items() if k != "content-type"})
    assert (status, named(data), headers["allow"]) == (405, "MethodNotAllowed", "POST")
    # an MCP client's token opens /mcp alone
    status, body = api("GET", f"{url}/runs", token=OTHER_TOKEN)
    assert (status, body["error"]["type"]) == (401, "Unauthorized")
    status, body = api("POST", f"{url}/runs", {"command": ["python", "a.py"]},
                       token=OTHER_TOKEN)
    assert status == 401 and api("GET", f"{url}/runs")[1]["runs"] == []


def test_a_tokens_file_others_can_read_is_refused(deja: Deja, tmp_path: Path) -> None:  # noqa: F811
    tokens = tmp_path / "mcp-tokens"
    tokens.write_text(f"{OTHER_TOKEN}\n")
    tokens.chmod(0o644)
    refused = deja("serve", "--port", "0", "--mcp-tokens", str(tokens))
    assert refused.returncode == 2 and "can be read by others" in refused.stderr
    tokens.chmod(0o600)
    tokens.write_text("short\n")
    refused = deja("serve", "--port", "0", "--mcp-tokens", str(tokens))
    assert refused.returncode == 2 and "line 1, is not a token" in refused.stderr
