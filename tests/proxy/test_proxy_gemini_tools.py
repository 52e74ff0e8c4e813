"""A google-genai agent's function responses through ``deja proxy`` are tool steps, as an
Anthropic or OpenAI agent's tool results are: a real proxy process forwarding to the stub
server, the unmodified SDK running a function-calling loop (JSON and streamed). Its calls
are grouped into runs by conversation; each function response is an observed ``tool``
line with the call's name and arguments (paired by the function's name, as Gemini pairs
them when the model gives no id); a replay checks each response against the recorded one,
and a fork at one puts its edit in the request the model gets."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gemini_helpers import function_config, function_loop, text_of
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
