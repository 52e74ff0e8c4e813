"""The OpenAI Responses API through ``deja proxy``: tool results an agent sends back as
``function_call_output`` items are logged as tool steps, whether it resends its items or
continues a response by ``previous_response_id``; the pieces of proxy/runs.py that read
them, then an unmodified openai SDK agent through a real proxy process against the stub
server, recorded, replayed and forked."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
from proxy_helpers import ProxyProcess, cassettes

from deja.proxy.runs import ProxyRun, Registry, conversation_items, tool_calls, tool_results
from recorder.cassette import load
from recorder.testing.server import StubServer

MODEL = "gpt-4.1"  # a model the openai SDK knows and does not warn about
API_KEY = "sk-openai-test-SECRET-5b1e"
PROMPT = "What does 'deja' mean?"
TOOLS = [{"type": "function", "name": "lookup", "description": "Look a word up.",
          "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                         "required": ["word"]}}]
TEXTS = ["Let me look that up.", "It means 'already'."]
SCRIPT = {"select": "conversation", "turns": [
    {"text": TEXTS[0], "tool_use": {"name": "lookup", "input": {"word": "deja"}},
     "usage": {"input_tokens": 50, "output_tokens": 9}},
    {"text": TEXTS[1], "usage": {"input_tokens": 70, "output_tokens": 6}}]}

Proxy = Callable[..., ProxyProcess]
Stub = Callable[[dict], StubServer]


def lookup(word: str) -> str:
    return f"{word}: French for 'already'"


# =================================================================== proxy/runs.py, unit


def test_a_responses_input_is_the_conversation() -> None:
    items = [{"role": "user", "content": "hi"}, {"type": "function_call_output",
                                                 "call_id": "c1", "output": "x"}]
    assert conversation_items({"input": items}) is items
    assert conversation_items({"input": "hi"}) == [{"role": "user", "content": "hi"}]
    messages = [{"role": "user", "content": "hi"}]
    assert conversation_items({"messages": messages, "input": items}) is messages
    assert conversation_items({"model": "m"}) is None
    assert conversation_items({"input": 3}) is None


def test_function_calls_and_their_outputs_are_tool_calls_and_results() -> None:
    items: list[Any] = [
        {"role": "user", "content": "find x"},
        {"type": "message", "role": "assistant", "id": "msg_1",
         "content": [{"type": "output_text", "text": "looking"}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "search",
         "arguments": '{"q":"x"}', "status": "completed"},
        {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "fetch",
         "arguments": "not json"},
        {"type": "function_call", "id": "fc_3", "name": "no call id"},
        {"type": "function_call_output", "call_id": "call_1", "output": "found"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "page"}]},
        {"type": "function_call_output", "output": "no call id"},
    ]
    assert tool_calls(items) == {"call_1": ("search", {"q": "x"}),
                                 "call_2": ("fetch", "not json")}
    results = tool_results(items)
    assert [(r["tool_use_id"], r["content"]) for r in results] == [
        ("call_1", "found"), ("call_2", [{"type": "input_text", "text": "page"}])]
    results[0]["content"] = "edited"  # a copy: the item is as it was
    assert items[5]["output"] == "found"


class _Session:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id


def _run(run_id: str, who: str = "a") -> ProxyRun:
    return ProxyRun(_Session(run_id), who=who)  # type: ignore[arg-type]


def test_registry_finds_the_run_a_previous_response_came_from() -> None:
    reg = Registry()
    one, two = _run("r_1"), _run("r_2")
    reg.add(one)
    reg.add(two)
    reg.replied(one, "resp_a")
    reg.replied(two, "resp_b")
    reg.replied(one, "resp_c")
    assert reg.find("a", None, ["k"], previous="resp_a") is one
    assert reg.find("a", None, ["k"], previous="resp_c") is one
    assert reg.find("a", None, ["k"], previous="resp_b") is two
    assert reg.find("b", None, ["k"], previous="resp_a") is None  # another API key
    assert reg.find("a", None, ["k"], previous="resp_unknown") is None
    reg.retire(one, keep=False)
    assert reg.find("a", None, ["k"], previous="resp_a") is None
    two.stopped = RuntimeError("stopped")  # type: ignore[assignment]
    reg.retire(two, keep=True)  # a stopped run is still found, until it is forgotten
    assert reg.find("a", None, ["k"], previous="resp_b") is two
    reg.forget_stopped(older_than=time.monotonic() + 1)
    assert reg.find("a", None, ["k"], previous="resp_b") is None


def test_a_run_whose_last_reply_asked_for_a_tool_is_interrupted() -> None:
    run = _run("r_1")
    run.last_stop_reason = "completed"  # a Responses reply's status
    assert run.end_status()[0] == "completed"
    run.awaiting_tools = True
    assert run.end_status()[0] == "interrupted"


# ======================================== an openai SDK agent through a real proxy


def resend_loop(url: str) -> tuple[list[bytes], list[Any]]:
    """A Responses tool loop that resends its items each turn: the bytes of each
    response, and the responses."""
    bodies: list[bytes] = []
    finals: list[Any] = []
    items: list[Any] = [{"role": "user", "content": PROMPT}]
    with openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0) as c:
        for _ in range(3):
            raw = c.responses.with_raw_response.create(model=MODEL, input=items, tools=TOOLS)
            bodies.append(raw.http_response.content)
            response = raw.parse()
            finals.append(response.model_dump())
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls:
                return bodies, finals
            items += [o.model_dump(exclude_none=True) for o in response.output]
            items += [{"type": "function_call_output", "call_id": call.call_id,
                       "output": lookup(**json.loads(call.arguments))} for call in calls]
    raise AssertionError("no final answer")


def chained_loop(url: str, prompt: str = PROMPT, *, stop_after_tool: bool = False,
                 client: openai.OpenAI | None = None) -> list[Any]:
    """A streamed Responses tool loop that sends only the function call outputs, continuing
    the last response by ``previous_response_id``: the final responses."""
    finals: list[Any] = []
    c = client or openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0)
    payload: Any = prompt
    previous: Any = openai.NOT_GIVEN
    try:
        for _ in range(3):
            with c.responses.stream(model=MODEL, input=payload, tools=TOOLS,
                                    previous_response_id=previous) as s:
                response = s.get_final_response()
            finals.append(response.model_dump())
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls or stop_after_tool:
                return finals
            payload = [{"type": "function_call_output", "call_id": call.call_id,
                        "output": lookup(**json.loads(call.arguments))} for call in calls]
            previous = response.id
    finally:
        if client is None:
            c.close()
    raise AssertionError("no final answer")


def _steps(path: Path) -> list[dict[str, Any]]:
    return [o for o in load(path) if o.get("kind") in ("model", "tool")]


def _check_tool_step(path: Path, call_id: str) -> None:
    lines = _steps(path)
    assert [o["kind"] for o in lines] == ["model", "tool", "model"]
    tool = lines[1]
    assert (tool["name"], tool["args"], tool["result"], tool["observed"], tool["call_id"]) == \
        ("lookup", {"word": "deja"}, "deja: French for 'already'", "proxy", call_id)
    assert lines[0]["stop_reason"] == "completed" and lines[2]["stop_reason"] == "completed"
    end = load(path).end
    assert end is not None and end["status"] == "completed"


def test_a_responses_tool_loop_that_resends_its_items_records_tool_steps_and_replays(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    upstream = stub(SCRIPT)
    directory = tmp_path / "runs"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    bodies, finals = resend_loop(f"{recording.url}/v1")
    status, log = recording.stop()
    assert status == 0, log
    upstream.stop()
    assert finals[-1]["output"][0]["content"][0]["text"] == TEXTS[1]

    [path] = cassettes(directory)  # one conversation, one run
    _check_tool_step(path, finals[0]["output"][1]["call_id"])

    replaying = proxy("--replay", str(path))
    replayed_bodies, replayed_finals = resend_loop(f"{replaying.url}/v1")
    status, log = replaying.stop()
    assert status == 0, log
    assert ": identical" in log and "steps:      3/3 served" in log, log
    assert replayed_bodies == bodies
    assert replayed_finals == finals


def test_a_streamed_responses_loop_by_previous_response_id_records_tool_steps_and_replays(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    """The agent sends only the function call output: the call it answers is read from
    the response it continues, and the request joins that response's run."""
    upstream = stub(SCRIPT)
    directory = tmp_path / "runs"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    finals = chained_loop(f"{recording.url}/v1")
    status, log = recording.stop()
    assert status == 0, log
    upstream.stop()
    assert finals[-1]["previous_response_id"] == finals[0]["id"]
    second = upstream.requests[1]["body"]
    assert [i["type"] for i in second["input"]] == ["function_call_output"]  # no call in it

    [path] = cassettes(directory)
    _check_tool_step(path, finals[0]["output"][1]["call_id"])
    assert [o.get("stream") for o in _steps(path)] == [True, None, True]

    replaying = proxy("--replay", str(path))
    replayed = chained_loop(f"{replaying.url}/v1")
    status, log = replaying.stop()
    assert status == 0, log
    assert ": identical" in log and "steps:      3/3 served" in log, log
    assert replayed == finals


def test_conversations_continued_by_previous_response_id_are_runs_of_their_own(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    """Two conversations of one client, interleaved: each continuation joins the run of
    the response it continues; the one left after a tool call ends interrupted."""
    upstream = stub(SCRIPT)
    directory = tmp_path / "runs"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory), "--idle", "0.3")
    with openai.OpenAI(base_url=f"{recording.url}/v1", api_key=API_KEY,
                       max_retries=0) as c:
        left = chained_loop("", "Walk away", stop_after_tool=True, client=c)
        done = chained_loop("", client=c)
        deadline = time.monotonic() + 30
        while len([p for p in cassettes(directory)
                   if load(p).end is not None]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    status, log = recording.stop()
    assert status == 0, log
    assert "idle for 0.3s" in log
    by_first = {}
    for path in cassettes(directory):
        lines = _steps(path)
        first = load(path).request_of(lines[0]["seq"])
        by_first[first["input"]] = (path, lines)
    assert set(by_first) == {"Walk away", PROMPT}
    path, lines = by_first["Walk away"]
    assert [o["kind"] for o in lines] == ["model"]
    end = load(path).end
    assert end is not None and end["status"] == "interrupted"
    path, lines = by_first[PROMPT]
    assert [o["kind"] for o in lines] == ["model", "tool", "model"]
    assert lines[1]["call_id"] == done[0]["output"][1]["call_id"]
    end = load(path).end
    assert end is not None and end["status"] == "completed"
    assert left[0]["id"] != done[0]["id"]


def test_a_fork_at_a_responses_tool_step_sends_the_edit(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    """Forked at the observed tool step with an edited result: the proxy puts the edit in
    the ``function_call_output`` item the model receives."""
    script = {**SCRIPT, "rules": [{"when": {"tool_result_contains": "EDITED"},
                                   "text": "The edited meaning."}]}
    upstream = stub(script)
    directory = tmp_path / "runs"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    resend_loop(f"{recording.url}/v1")
    status, log = recording.stop()
    assert status == 0, log
    [path] = cassettes(directory)
    tool_step = next(o["seq"] for o in load(path) if o.get("kind") == "tool")

    forked = tmp_path / "fork.jsonl"
    forking = proxy("--fork", str(path), "--at", str(tool_step), "--set",
                    '/result="EDITED: deja"', "--upstream", upstream.url, "-o", str(forked))
    before = len(upstream.requests)
    _, finals = resend_loop(f"{forking.url}/v1")
    status, log = forking.stop()
    assert status == 0, log
    assert finals[-1]["output"][0]["content"][0]["text"] == "The edited meaning."
    live = upstream.requests[before:]  # only the step after the edit went upstream
    assert len(live) == 1, live
    outputs = [i["output"] for i in live[0]["body"]["input"]
               if i.get("type") == "function_call_output"]
    assert outputs == ["EDITED: deja"]
    fork = load(forked)
    assert fork.header["parent"]["step"] == tool_step
    assert fork.end is not None and fork.end["status"] == "completed"
