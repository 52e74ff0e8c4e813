"""A google-genai agent's function responses through ``deja proxy`` are tool steps, as an
Anthropic or OpenAI agent's tool results are: a real proxy process forwarding to the stub
server, the unmodified SDK running a function-calling loop (JSON and streamed). Its calls
are grouped into runs by conversation; each function response is an observed ``tool``
line with the call's name and arguments (paired by the function's name, as Gemini pairs
them when the model gives no id); a replay checks each response against the recorded one,
and a fork at one puts its edit in the request the model gets. Conversations a client
groups into one named run (``x-deja-run``) each have their tool steps, with ids unique in
the run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gemini_helpers import function_config, function_loop, text_of
from google import genai
from google.genai import errors, types
from proxy_helpers import ProxyProcess, cassettes, lines, load_verified

from recorder.testing.server import StubServer

API_KEY = "AIzaSyD-deja-proxy-TOOLS-0123456789ab"
MEANINGS = {"deja": "already", "vu": "seen"}
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Let me look.", "tool_use": {"name": "lookup", "input": {"word": "deja"}}},
    {"tool_use": {"name": "lookup", "input": {"word": "vu"}}},
    {"text": "It means already seen."}]}
CONFIG = function_config("lookup", "word", "Look a word up.")

Proxy = Callable[..., ProxyProcess]
Stub = Callable[[dict], StubServer]


def agent(url: str, stream: bool, meanings: dict[str, str] = MEANINGS) -> str:
    """Ask, run each function call the model asks for, until it answers in text."""
    def lookup(call: types.FunctionCall) -> dict[str, Any]:
        return {"meaning": meanings[str((call.args or {})["word"])]}

    turns = function_loop(url, API_KEY, "What does 'deja vu' mean?", CONFIG, lookup,
                          stream=stream)
    return text_of(turns[-1])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_function_responses_are_tool_steps_of_the_conversation_run(
        proxy: Proxy, stub: Stub, tmp_path: Path, stream: bool) -> None:
    upstream = stub(SCRIPT)
    directory = tmp_path / "runs"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory), "--idle", "60")
    assert agent(recording.url, stream) == "It means already seen."
    assert agent(recording.url, stream) == "It means already seen."  # a second conversation
    status, log = recording.stop()
    assert status == 0, log
    upstream.stop()

    # one run per conversation, each with its two function responses as tool steps
    paths = cassettes(directory)
    assert len(paths) == 2, log
    for path in paths:
        cassette = load_verified(path)
        steps = lines(cassette)
        assert [o["kind"] for o in steps] == ["model", "tool", "model", "tool", "model"]
        tools = [o for o in steps if o["kind"] == "tool"]
        # the same function twice, with no id from the model: told apart by their order
        assert [(t["name"], t["args"], t["result"], t["call_id"], t["observed"])
                for t in tools] == [
            ("lookup", {"word": "deja"}, {"meaning": "already"}, "lookup", "proxy"),
            ("lookup", {"word": "vu"}, {"meaning": "seen"}, "lookup#2", "proxy")]
        assert cassette.end is not None and cassette.end["status"] == "completed"
        assert cassette.end["totals"]["tool_calls"] == 2

    # --replay: each function response is checked against the recorded one
    replaying = proxy("--replay", str(paths[0]))
    assert agent(replaying.url, stream) == "It means already seen."
    status, log = replaying.stop()
    assert status == 0, log
    assert ": identical" in log and "steps:      5/5 served" in log, log

    replaying = proxy("--replay", str(paths[0]))
    with pytest.raises(errors.ClientError) as refused:
        agent(replaying.url, stream, {**MEANINGS, "vu": "never seen"})
    assert "diverged from the recording at step 3 (tool)" in str(refused.value), refused.value
    assert "'lookup' returned something other than the recorded result" in \
        str(refused.value)
    status, log = replaying.stop()
    assert status == 1, log


def test_a_fork_at_a_function_response_sends_the_edit_upstream(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    upstream = stub(SCRIPT)
    directory = tmp_path / "runs"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    agent(recording.url, stream=False)
    status, log = recording.stop()
    assert status == 0, log
    [parent] = cassettes(directory)
    [at, _] = [o["seq"] for o in lines(load_verified(parent)) if o["kind"] == "tool"]
    seen = len(upstream.requests)

    out = tmp_path / "fork.jsonl"
    forking = proxy("--fork", str(parent), "--at", str(at), "--set", "/result/meaning=snow",
                    "--upstream", upstream.url, "-o", str(out))
    assert agent(forking.url, stream=False) == "It means already seen."
    status, log = forking.stop()
    assert status == 0, log

    # every request after the fork carries the edited response, not what the agent sent
    live = upstream.requests[seen:]
    assert len(live) == 2
    for request in live:
        sent = [part["functionResponse"]["response"] for content in request["body"]["contents"]
                for part in content["parts"] if "functionResponse" in part]
        assert sent[0] == {"meaning": "snow"}
    fork = lines(load_verified(out))
    assert (fork[at]["name"], fork[at]["result"], fork[at].get("edited")) == \
        ("lookup", {"meaning": "snow"}, True)
    assert [o["kind"] for o in fork if o["kind"] != "control"] == \
        ["model", "tool", "model", "tool", "model"]  # the second response logged live


def named_chat(url: str, run: str, meanings: dict[str, str] = MEANINGS) -> str:
    """One conversation of the named run ``run``, as a google-genai chat (which keeps its
    own history): each function call answered, until the model answers in text."""
    with genai.Client(api_key=API_KEY, http_options=types.HttpOptions(
            base_url=url, headers={"x-deja-run": run})) as client:
        chat = client.chats.create(model="gemini-2.5-flash", config=CONFIG)
        reply = chat.send_message("What does 'deja vu' mean?")
        while reply.function_calls:
            reply = chat.send_message([types.Part.from_function_response(
                name=call.name or "", response={"meaning": meanings[str((call.args or {})[
                    "word"])]}) for call in reply.function_calls])
        return reply.text or ""


def test_conversations_of_one_named_run_each_have_their_tool_steps(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    """Two conversations in one named run, word for word the same, call ``lookup`` with
    no id twice each: four tool steps, ``lookup`` to ``lookup#4`` in the run, which a
    replay checks one by one and a fork edits in the conversation it is in alone."""
    upstream = stub(SCRIPT)
    directory = tmp_path / "runs"
    # the same calls twice in one run: not a loop here
    recording = proxy("--upstream", upstream.url, "--dir", str(directory), "--no-loop-guard")
    for _ in range(2):
        assert named_chat(recording.url, "batch") == "It means already seen."
    status, log = recording.stop()
    assert status == 0, log

    [path] = cassettes(directory)
    steps = lines(load_verified(path))
    assert [o["kind"] for o in steps] == ["model", "tool", "model", "tool", "model"] * 2
    tools = [o for o in steps if o["kind"] == "tool"]
    assert [(t["seq"], t["args"], t["result"], t["call_id"]) for t in tools] == [
        (1, {"word": "deja"}, {"meaning": "already"}, "lookup"),
        (3, {"word": "vu"}, {"meaning": "seen"}, "lookup#2"),
        (6, {"word": "deja"}, {"meaning": "already"}, "lookup#3"),
        (8, {"word": "vu"}, {"meaning": "seen"}, "lookup#4")]

    # a replay checks each conversation's responses against its own steps
    replaying = proxy("--replay", str(path))
    for _ in range(2):
        assert named_chat(replaying.url, "batch") == "It means already seen."
    status, log = replaying.stop()
    assert status == 0, log
    assert ": identical" in log and "steps:      10/10 served" in log, log

    replaying = proxy("--replay", str(path))
    named_chat(replaying.url, "batch")
    with pytest.raises(errors.ClientError) as refused:
        named_chat(replaying.url, "batch", {**MEANINGS, "vu": "never seen"})
    assert "diverged from the recording at step 8 (tool)" in str(refused.value), refused.value
    assert "(call lookup#4)" in str(refused.value)
    status, log = replaying.stop()
    assert status == 1, log

    # a fork at the second conversation's first response: the model gets the edit there
    seen = len(upstream.requests)
    out = tmp_path / "fork.jsonl"
    forking = proxy("--fork", str(path), "--at", "6", "--set", "/result/meaning=snow",
                    "--upstream", upstream.url, "-o", str(out))
    for _ in range(2):
        assert named_chat(forking.url, "batch") == "It means already seen."
    status, log = forking.stop()
    assert status == 0, log
    live = upstream.requests[seen:]  # the first conversation was served from the prefix
    assert [[part["functionResponse"]["response"] for content in r["body"]["contents"]
             for part in content["parts"] if "functionResponse" in part]
            for r in live] == [[{"meaning": "snow"}],
                               [{"meaning": "snow"}, {"meaning": "seen"}]]
    fork = lines(load_verified(out))
    assert (fork[6]["call_id"], fork[6]["result"], fork[6].get("edited")) == \
        ("lookup#3", {"meaning": "snow"}, True)
    assert [o["call_id"] for o in fork if o["kind"] == "tool"] == [
        "lookup", "lookup#2", "lookup#3", "lookup#4"]  # the last one logged live
