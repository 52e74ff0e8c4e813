"""The official openai SDK recorded and replayed: Chat Completions (JSON with a tool, and
streamed with usage) and the Responses API (JSON and streamed), against the stub server
speaking OpenAI. Replays serve the bytes the SDK got, lines carry usage with cached tokens,
cost and stop reason, a changed prompt diverges with a diff, forks deliver an edited
message through a valid stream, and ``deja proxy`` records and replays an OpenAI tool loop.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

import recorder
import replayer
from recorder.cassette import load
from recorder.testing.server import StubServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proxy"))  # proxy_helpers
from proxy_helpers import ProxyProcess, cassettes

MODEL = "gpt-4.1"  # a model the openai SDK knows and does not warn about
API_KEY = "sk-openai-test-SECRET-9d2e"
# dollars per million tokens: input, output, cache write, cache read
PRICES = {MODEL: [2.0, 8.0, 0.0, 0.5]}
CACHED = {"input_tokens": 120, "output_tokens": 9, "cache_read_input_tokens": 300}
COST = round((120 * 2.0 + 9 * 8.0 + 300 * 0.5) / 1_000_000, 8)
PLAIN = {"input_tokens": 40, "output_tokens": 6}
PLAIN_USAGE = {**PLAIN, "cache_read_input_tokens": 0}  # the stub reports 0 cached tokens
PLAIN_COST = round((40 * 2.0 + 6 * 8.0) / 1_000_000, 8)

CHAT_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                   "required": ["word"]}}}]
RESPONSE_TOOLS = [{"type": "function", "name": "lookup", "description": "Look a word up.",
                   "parameters": CHAT_TOOLS[0]["function"]["parameters"]}]
TEXTS = ["Let me look that up.", "It means 'already'."]
SCRIPT = {"select": "conversation", "turns": [
    {"text": TEXTS[0], "tool_use": {"name": "lookup", "input": {"word": "deja"}},
     "usage": CACHED},
    {"text": TEXTS[1], "usage": PLAIN}]}

Stub = Callable[[dict], StubServer]


def lookup(word: str) -> str:
    return f"{word}: French for 'already'"


def client(url: str, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=max_retries)


def agent(url: str, prompt: str = "What does 'deja' mean?") -> dict[str, Any]:
    """Every kind of call: a chat tool loop (JSON), a streamed chat completion with usage,
    a Responses call and a streamed one. Returns the bytes received and the SDK's objects."""
    bodies: list[bytes] = []
    finals: list[Any] = []
    with client(url) as c:
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                          tools=CHAT_TOOLS)
        bodies.append(raw.http_response.content)
        first = raw.parse()
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": lookup(**json.loads(call.function.arguments))}]
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                          tools=CHAT_TOOLS)
        bodies.append(raw.http_response.content)
        finals += [first.model_dump(), raw.parse().model_dump()]

        with c.chat.completions.with_streaming_response.create(
                model=MODEL, messages=messages[:1], stream=True,
                stream_options={"include_usage": True}) as r:
            bodies.append(r.read())
        with c.chat.completions.stream(model=MODEL, messages=messages[:1],
                                       stream_options={"include_usage": True}) as s:
            finals.append(s.get_final_completion().model_dump())

        raw = c.responses.with_raw_response.create(model=MODEL, input=prompt,
                                                   tools=RESPONSE_TOOLS)
        bodies.append(raw.http_response.content)
        finals.append(raw.parse().model_dump())
        with c.responses.stream(model=MODEL, input=prompt, tools=RESPONSE_TOOLS) as s:
            finals.append(s.get_final_response().model_dump())
    return {"bodies": bodies, "finals": finals}


def model_lines(path: Path) -> list[dict[str, Any]]:
    return [o for o in load(path) if o["kind"] == "model"]


def record(stub: Stub, path: Path, script: dict | None = None,
           run: Callable[[str], Any] = agent) -> Any:
    server = stub(script or SCRIPT)
    with recorder.record(path, prices=PRICES):
        result = run(server.url)
    server.stop()  # replays must not need it
    return result


def test_every_kind_of_call_replays_bit_for_bit(stub: Stub, tmp_path: Path) -> None:
    path = tmp_path / "openai.jsonl"
    recorded = record(stub, path)
    assert recorded["finals"][1]["choices"][0]["message"]["content"] == TEXTS[1]
    with replayer.replay(path) as run:
        replayed = agent("http://127.0.0.1:9")  # nothing listens there: all served
    assert run.result.identical, run.result.report()
    assert replayed["bodies"] == recorded["bodies"]
    assert replayed["finals"] == recorded["finals"]


def test_each_line_has_usage_cached_tokens_cost_and_stop_reason(stub: Stub,
                                                                tmp_path: Path) -> None:
    path = tmp_path / "openai.jsonl"
    recorded = record(stub, path)
    lines = model_lines(path)
    assert [o["provider"] for o in lines] == ["openai"] * 6
    assert [o["stream"] for o in lines] == [False, False, True, True, False, True]
    # each call here is the first of its conversation except the chat loop's second
    assert [o["usage"] for o in lines] == [CACHED, PLAIN_USAGE, CACHED, CACHED, CACHED,
                                         CACHED]
    assert [o["cost_usd"] for o in lines] == [COST, PLAIN_COST, COST, COST, COST, COST]
    assert [o["stop_reason"] for o in lines] == ["tool_calls", "stop", "tool_calls",
                                                 "tool_calls", "completed", "completed"]
    finals = recorded["finals"]
    assert [o["message_id"] for o in lines] == [
        finals[0]["id"], finals[1]["id"], json.loads(
            recorded["bodies"][2].split(b"\n")[0][6:])["id"],
        finals[2]["id"], finals[3]["id"], finals[4]["id"]]
    # the usage the SDK saw is the usage recorded: cached tokens inside the prompt tokens
    assert finals[2]["usage"]["prompt_tokens"] == 420
    assert finals[2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 300
    assert finals[4]["usage"]["input_tokens_details"]["cached_tokens"] == 300


def test_a_changed_prompt_diverges_with_a_readable_diff(stub: Stub, tmp_path: Path) -> None:
    path = tmp_path / "openai.jsonl"
    record(stub, path)
    with pytest.raises(recorder.Divergence) as info, replayer.replay(path):
        agent("http://127.0.0.1:9", prompt="What does 'vu' mean?")
    assert info.value.step == 0
    assert not isinstance(info.value, openai.APIConnectionError)
    assert "-" in info.value.diff and "What does 'deja' mean?" in info.value.diff
    assert "What does 'vu' mean?" in info.value.diff


def test_an_openai_compatible_base_url_records_and_replays_the_same(stub: Stub,
                                                                    tmp_path: Path) -> None:
    """A compatible server is any host with these paths: recorded at ``localhost``,
    replayed against another base URL."""
    path = tmp_path / "compatible.jsonl"

    def at_localhost(url: str) -> Any:
        return agent(url.replace("127.0.0.1", "localhost"))

    recorded = record(stub, path, run=at_localhost)
    lines = model_lines(path)
    assert all(o["url"].startswith("http://localhost:") for o in lines)
    assert [o["usage"] for o in lines][:2] == [CACHED, PLAIN_USAGE]
    with replayer.replay(path) as run:
        replayed = agent("http://127.0.0.1:9")
    assert run.result.identical
    assert replayed["bodies"] == recorded["bodies"]


# ------------------------------------------------------------------------------ forks


def _streamed_chat(url: str) -> str:
    with client(url) as c, c.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "Say hi"}], tools=CHAT_TOOLS,
            stream_options={"include_usage": True}) as s:
        final = s.get_final_completion()
    message = final.choices[0].message
    assert final.usage is not None and final.usage.prompt_tokens_details is not None
    return f"{message.content}|{message.tool_calls[0].function.arguments}|" \
           f"{final.usage.prompt_tokens_details.cached_tokens}"


def _streamed_response(url: str) -> str:
    with client(url) as c, c.responses.stream(model=MODEL, input="Say hi",
                                              tools=RESPONSE_TOOLS) as s:
        final = s.get_final_response()
    return f"{final.output_text}|{final.output[1].arguments}|{final.usage.output_tokens}"


@pytest.mark.parametrize(("run", "edit"), [
    (_streamed_chat, "choices.0.message.content=EDITED hello"),
    (_streamed_response, "output.0.content.0.text=EDITED hello")])
def test_a_fork_delivers_an_edited_stream_to_the_sdk(stub: Stub, tmp_path: Path,
                                                     run: Callable[[str], str],
                                                     edit: str) -> None:
    path = tmp_path / "parent.jsonl"
    recorded = record(stub, path, run=run)
    assert recorded == f'{TEXTS[0]}|{{"word":"deja"}}|' + ("300" if run is _streamed_chat
                                                           else "9")
    out = tmp_path / "fork.jsonl"
    with replayer.fork(path, at=0, sets=[edit], out=out):
        forked = run("http://127.0.0.1:9")  # the fork step is served, edited
    assert forked == recorded.replace(TEXTS[0], "EDITED hello")
    [edited] = [o for o in model_lines(out) if o.get("edited")]
    assert edited["usage"] == CACHED  # (its cost is by the default price table)
    assert edited["stop_reason"] == ("tool_calls" if run is _streamed_chat else "completed")
    with replayer.replay(out) as again:  # the fork replays like any run
        assert run("http://127.0.0.1:9") == forked
    assert again.result.identical


# ------------------------------------------------------------------------- deja proxy


def chat_tool_loop(url: str) -> tuple[list[bytes], list[Any]]:
    """A chat tool loop through ``url`` (OPENAI_BASE_URL): the bytes of each response and
    the completions."""
    bodies: list[bytes] = []
    finals: list[Any] = []
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What does 'deja' mean?"}]
    with openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0) as c:
        for _ in range(3):
            raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                              tools=CHAT_TOOLS)
            bodies.append(raw.http_response.content)
            completion = raw.parse()
            finals.append(completion.model_dump())
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return bodies, finals
            messages += [{"role": "tool", "tool_call_id": call.id,
                          "content": lookup(**json.loads(call.function.arguments))}
                         for call in message.tool_calls]
    raise AssertionError("no final answer")


def test_a_chat_tool_loop_through_deja_proxy_records_and_replays(
        proxy: Callable[..., ProxyProcess], stub: Stub, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    upstream = stub(SCRIPT)
    directory = tmp_path / "runs"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    monkeypatch.setenv("OPENAI_BASE_URL", f"{recording.url}/v1")
    bodies, finals = chat_tool_loop(f"{recording.url}/v1")
    status, log = recording.stop()
    assert status == 0, log
    upstream.stop()
    assert finals[-1]["choices"][0]["message"]["content"] == TEXTS[1]

    [path] = cassettes(directory)
    lines = [o for o in load(path) if o.get("kind") in ("model", "tool")]
    assert [o["kind"] for o in lines] == ["model", "tool", "model"]
    tool = lines[1]
    assert (tool["name"], tool["args"], tool["result"], tool["observed"]) == \
        ("lookup", {"word": "deja"}, "deja: French for 'already'", "proxy")
    assert lines[0]["usage"] == CACHED and lines[0]["stop_reason"] == "tool_calls"
    end = load(path).end
    assert end is not None and end["status"] == "completed"

    replaying = proxy("--replay", str(path))
    replayed_bodies, replayed_finals = chat_tool_loop(f"{replaying.url}/v1")
    status, log = replaying.stop()
    assert status == 0, log
    assert ": identical" in log and "steps:      3/3 served" in log, log
    assert replayed_bodies == bodies
    assert replayed_finals == finals


def test_a_fork_at_an_openai_tool_step_through_deja_proxy_sends_the_edit(
        proxy: Callable[..., ProxyProcess], stub: Stub, tmp_path: Path) -> None:
    """Forked at the observed tool step with an edited result: the proxy puts the edit in
    the `role: tool` message the model receives, and the model answers it differently."""
    script = {**SCRIPT, "rules": [{"when": {"tool_result_contains": "EDITED"},
                                   "text": "The edited meaning."}]}
    upstream = stub(script)
    directory = tmp_path / "runs"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    chat_tool_loop(f"{recording.url}/v1")
    status, log = recording.stop()
    assert status == 0, log
    [path] = cassettes(directory)
    tool_step = next(o["seq"] for o in load(path) if o.get("kind") == "tool")

    forked = tmp_path / "fork.jsonl"
    forking = proxy("--fork", str(path), "--at", str(tool_step), "--set",
                    '/result="EDITED: deja"', "--upstream", upstream.url, "-o", str(forked))
    before = len(upstream.requests)
    _, finals = chat_tool_loop(f"{forking.url}/v1")
    status, log = forking.stop()
    assert status == 0, log
    assert finals[-1]["choices"][0]["message"]["content"] == "The edited meaning."
    live = upstream.requests[before:]  # only the step after the edit went upstream
    assert len(live) == 1, live
    tool_messages = [m for m in live[0]["body"]["messages"] if m.get("role") == "tool"]
    assert [m["content"] for m in tool_messages] == ["EDITED: deja"]
    fork = load(forked)
    assert fork.header["parent"]["step"] == tool_step
    assert fork.end is not None and fork.end["status"] == "completed"
