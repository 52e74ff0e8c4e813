"""``deja stub --from CASSETTE`` and the README's fork against the bundled stub, through
the real CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from click.testing import CliRunner
from stub_helpers import ROOT, create

import recorder
from deja.cli import main as cli
from recorder.cassette import load
from recorder.testing.server import StubServer

# --------------------------------------------------------------------------------------------
# deja stub --from CASSETTE, and the README's fork, through the real CLI
# --------------------------------------------------------------------------------------------

SPIRAL_STUB = ROOT / "examples" / "retry_spiral.stub.json"
# The README's fork edit ("Fork a step"), word for word.
README_FIX = ('result={"results": [{"path": "auth/session.py", '
              '"snippet": "def refresh_token(self): ..."}]}')
RETRY_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry")
# The streaming example's model, overloaded once before its first answer.
OVERLOADED_STREAM = {
    "select": "conversation",
    "turns": [
        {
            "error": {"status": 529, "retry_after": 0.01},
            "then": [
                {
                    "text": "Let me check the weather in Lyon first.",
                    "tool_use": {"id": "toolu_weather_1", "name": "get_weather",
                                 "input": {"city": "Lyon"}},
                }
            ],
        },
        {"text": "It is overcast and 14 °C in Lyon. Rain is likely later: take the umbrella."},
    ],
}


def deja(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed CLI, run as a user runs it, from the repository root."""
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=ROOT, timeout=120)


@contextlib.contextmanager
def cli_stub(tmp_path: Path, *args: str) -> Iterator[str]:
    """``deja stub ARGS --port 0`` in its own process; yields its base URL."""
    ready = tmp_path / f"stub-{len(list(tmp_path.glob('stub-*')))}.url"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deja", "stub", *args, "--port", "0", "--ready-file", str(ready)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, f"deja stub exited: {proc.communicate()[1]}"
            assert time.monotonic() < deadline, "deja stub did not start within 60 s"
            time.sleep(0.05)
        yield ready.read_text()
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "serving" in stderr, stderr


def _record(out: Path, url: str, agent: str, *flags: str) -> subprocess.CompletedProcess:
    return deja("record", *flags, "-o", str(out), "--", "python", f"examples/{agent}",
                env={"ANTHROPIC_BASE_URL": url})


def _responses(path: Path) -> list[tuple[int, dict, str]]:
    """What each model call of a run received: status, retry headers, and a 200's body."""
    out = []
    for obs in load(path).observations:
        if obs["kind"] == "model":
            response = obs["response"]
            headers = {k.lower(): v for k, v in response["headers"]}
            retry = {name: headers[name] for name in RETRY_HEADERS if name in headers}
            out.append((response["status"], retry,
                        response["body"] if response["status"] == 200 else ""))
    return out


def test_stub_from_a_cassette_serves_what_the_run_received(tmp_path: Path) -> None:
    parent = tmp_path / "spiral.jsonl"
    with StubServer(SPIRAL_STUB) as server:
        first = _record(parent, server.url, "retry_spiral.py", "--no-loop-guard")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "turn 5: end_turn: The search tool keeps returning malformed data" in first.stdout

    again = [tmp_path / "again-1.jsonl", tmp_path / "again-2.jsonl"]
    with cli_stub(tmp_path, "--from", str(parent)) as url:  # served, no file written
        for run in again:  # a second run gets the same answers: no state is used up
            proc = _record(run, url, "retry_spiral.py", "--no-loop-guard")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert proc.stdout == first.stdout
    assert not list(tmp_path.glob("*.json"))
    for run in again:
        assert _responses(run) == _responses(parent)  # bodies as recorded, ids included
        diff = deja("diff", str(parent), str(run))
        assert diff.returncode == 0, diff.stdout + diff.stderr  # the same run, step by step


def test_stub_from_a_cassette_writes_a_script_that_replays_retries_and_streams(
    tmp_path: Path,
) -> None:
    parent = tmp_path / "stream.jsonl"
    with StubServer(OVERLOADED_STREAM) as server:
        first = _record(parent, server.url, "streaming_agent.py")
    assert first.returncode == 0, first.stdout + first.stderr
    recorded = _responses(parent)
    assert [status for status, _, _ in recorded] == [529, 200, 200]  # the SDK retried once
    assert recorded[0][1] == {"retry-after": "0.01", "retry-after-ms": "10"}

    script = tmp_path / "stream.stub.json"
    made = CliRunner().invoke(cli, ["stub", "--from", str(parent), "-o", str(script)])
    assert made.exit_code == 0, made.output
    assert f"wrote {script}" in made.output and "3 model calls" in made.output
    rules = json.loads(script.read_text())["rules"]
    assert [r["when"]["position"] for r in rules] == [0, 1]
    assert {r["when"]["first_user"] for r in rules} == {"Should I take an umbrella in Lyon today?"}
    assert rules[0]["error"]["status"] == 529 and rules[0]["_seq"] == [0, 1]
    assert rules[0]["error"]["headers"] == {"retry-after": "0.01", "retry-after-ms": "10"}
    assert rules[0]["then"][0]["sse"] == recorded[1][2]

    again = tmp_path / "again.jsonl"
    with cli_stub(tmp_path, "--script", str(script)) as url:
        proc = _record(again, url, "streaming_agent.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == first.stdout
    # The same 529 with its retry headers, then the same event streams byte for byte.
    assert _responses(again) == recorded
    diff = json.loads(deja("diff", str(parent), str(again), "--json").stdout)
    assert diff["same_prefix"] == 2  # the 529 and its retry
    for step in diff["steps"]:  # only the weather's clock differs, and what carries it
        if step["kind_a"] == "model":
            assert all(c["path"].startswith("/request/") for c in step["changes"]), step


def test_stub_from_refuses_what_it_cannot_serve(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    script = tmp_path / "s.json"
    script.write_text('{"turns": []}')
    for args in ([], ["--script", str(script), "--from", str(script)],
                 ["--script", str(script), "-o", str(tmp_path / "x.json")]):
        bad = runner.invoke(cli, ["stub", *args])
        assert bad.exit_code == 2, bad.output
        assert "--from CASSETTE" in bad.output
    missing = runner.invoke(cli, ["stub", "--from", str(tmp_path / "none.jsonl")])
    assert missing.exit_code == 2 and "no cassette at" in missing.output

    no_model = tmp_path / "effects.jsonl"
    with recorder.record(no_model):
        recorder.value("seed", lambda: 42)
    empty = runner.invoke(cli, ["stub", "--from", str(no_model), "-o", str(script)])
    assert empty.exit_code == 2, empty.output
    assert "holds no model call a stub can answer" in empty.output
    assert script.read_text() == '{"turns": []}'  # nothing written

    parent = tmp_path / "spiral.jsonl"
    with StubServer(SPIRAL_STUB) as server:
        assert _record(parent, server.url, "retry_spiral.py").returncode == 3  # loop guard
    monkeypatch.setenv("DEJA_KEY", "")
    monkeypatch.setenv("DEJA_HOME", str(tmp_path / "no-keys"))
    refused = runner.invoke(cli, ["stub", "--from", str(parent), "-o", str(script)])
    assert refused.exit_code == 2 and "UnverifiedCassette" in refused.output
    allowed = runner.invoke(cli, ["stub", "--from", str(parent), "-o", str(script),
                                  "--allow-unverified"])
    assert allowed.exit_code == 0, allowed.output
    assert "NOT VERIFIED" in allowed.output
    assert len(json.loads(script.read_text())["rules"]) == 3


def test_the_readme_fork_ends_fixed_against_the_bundled_stub(tmp_path: Path) -> None:
    """README "Fork a step": fixing the search result at step 1 ends the run with the fix."""
    parent = tmp_path / "retry_spiral.jsonl"
    fixed = tmp_path / "demo" / "fixed.jsonl"
    with cli_stub(tmp_path, "--script", "examples/retry_spiral.stub.json") as url:
        spiral = _record(parent, url, "retry_spiral.py")
        assert spiral.returncode == 3, spiral.stdout + spiral.stderr  # the loop guard stops it
        assert "stopped by the harness" in spiral.stdout
        forked = deja("fork", str(parent), "--at", "1", "-o", str(fixed), "--set", README_FIX,
                      env={"ANTHROPIC_BASE_URL": url})
        assert forked.returncode == 0, forked.stdout + forked.stderr
        # Runs after it against the same server get the same answers.
        again = _record(tmp_path / "again.jsonl", url, "retry_spiral.py")
        assert again.returncode == 3 and again.stdout.splitlines()[:-1] == \
            spiral.stdout.splitlines()[:-1]
        refork = deja("fork", str(parent), "--at", "1", "-o", str(tmp_path / "fixed-2.jsonl"),
                      "--set", README_FIX, env={"ANTHROPIC_BASE_URL": url})
        assert refork.returncode == 0 and refork.stdout == forked.stdout
    assert '-> [{"path": "auth/session.py", "snippet": "def refresh_token' in forked.stdout
    assert "turn 2: end_turn: Fixed: refresh_token now " in forked.stdout
    assert "search failed" not in forked.stdout
    lines = [json.loads(line) for line in fixed.read_text().splitlines()]
    assert lines[-1]["status"] == "completed" and lines[-1]["exit_code"] == 0
    final = [o for o in load(fixed).observations if o["kind"] == "model"][-1]
    answer = json.loads(final["response"]["body"])
    assert answer["stop_reason"] == "end_turn"
    assert answer["content"][0]["text"].startswith("Fixed: refresh_token now ")
    # The stub is gone; the fixed run replays on its own.
    replayed = deja("replay", str(fixed))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "turn 2: end_turn: Fixed: refresh_token now " in replayed.stdout


def test_a_script_from_a_cassette_tells_conversations_apart(tmp_path: Path) -> None:
    """Two conversations with the same task: the same first request, then different ones."""
    from replayer.stub import script_from_cassette

    def talk(url: str, results: list[str]) -> list[str]:
        got = []
        with anthropic.Anthropic(base_url=url, api_key="sk-test", max_retries=2) as client:
            for result in results:
                task = [{"role": "user", "content": "the task"}]
                first = create(client, messages=task)
                asked = [*task, {"role": "assistant", "content": first.content[0].text},
                         {"role": "user", "content": result}]
                got += [first.content[0].text, create(client, messages=asked).content[0].text]
        return got

    recorded_script = {"turns": [
        {"text": "start"}, {"error": {"status": 529, "retry_after": 0.001}},
        {"text": "after x"}, {"text": "start again"}, {"text": "after y"}]}
    cassette = tmp_path / "two.jsonl"
    with StubServer(recorded_script) as server, recorder.record(cassette):
        assert talk(server.url, ["x", "y"]) == ["start", "after x", "start again", "after y"]
    made = script_from_cassette(load(cassette))
    assert made.calls == 5 and made.skipped == ()
    rules = made.script["rules"]
    assert [r["when"] for r in rules] == [
        {"position": 0, "first_user": "the task"},
        {"position": 1, "first_user": "the task", "last_user": "x"},
        {"position": 1, "first_user": "the task", "last_user": "y"},
        {"position": 1, "first_user": "the task"},
    ]
    assert rules[0]["_seq"] == [0]  # the same request sent again later: its first answer
    assert rules[1]["_seq"] == [1, 2] and rules[1]["error"]["status"] == 529
    with StubServer(made.script) as server:
        # "z" was never asked: the first request recorded at its place answers it. The 529
        # of that request is retried by the SDK, as when it was recorded.
        assert talk(server.url, ["y", "x", "z"]) == [
            "start", "after y", "start", "after x", "start", "after x"]
        assert len(server.requests) == 6 + 2


# --------------------------------------------------------------------------------------------
# deja stub --from a cassette of OpenAI calls
# --------------------------------------------------------------------------------------------

OPENAI_MODEL = "gpt-4.1"  # a model the openai SDK knows and does not warn about
PROMPT = "What does 'deja' mean?"
MEANING = "French for 'already'"
WORD = {"type": "object", "properties": {"word": {"type": "string"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": WORD}}]
RESPONSE_TOOLS = [{"type": "function", "name": "lookup", "parameters": WORD}]
# Every conversation's first request is refused once with a 429 the SDK retries.
OPENAI_SCRIPT = {"select": "conversation", "turns": [
    {"error": {"status": 429, "retry_after": 0.01}, "then": [
        {"text": "Let me look that up.", "tool_use": {"name": "lookup", "input": {"word": "deja"}},
         "usage": {"input_tokens": 30, "output_tokens": 8, "cache_read_input_tokens": 100}}]},
    {"text": "It means 'already'."}]}


def openai_agent(url: str) -> list[object]:
    """Every kind of OpenAI call: a chat tool loop (JSON), a streamed chat completion, a
    Responses tool loop that resends its items (JSON), and a streamed one that continues
    its response by previous_response_id. Returns what the SDK made of each answer."""
    import openai

    out: list[object] = []
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=2) as c:
        messages: list[dict] = [{"role": "user", "content": PROMPT}]
        first = c.chat.completions.create(model=OPENAI_MODEL, messages=messages,
                                          tools=CHAT_TOOLS)
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": MEANING}]
        second = c.chat.completions.create(model=OPENAI_MODEL, messages=messages,
                                           tools=CHAT_TOOLS)
        out += [first.model_dump(), second.model_dump()]
        with c.chat.completions.stream(model=OPENAI_MODEL, messages=messages[:1],
                                       tools=CHAT_TOOLS,
                                       stream_options={"include_usage": True}) as s:
            out.append(s.get_final_completion().model_dump())

        items: list[dict] = [{"role": "user", "content": PROMPT}]
        response = c.responses.create(model=OPENAI_MODEL, input=items, tools=RESPONSE_TOOLS)
        items += [o.model_dump(exclude_none=True) for o in response.output]
        items.append({"type": "function_call_output", "call_id": response.output[1].call_id,
                      "output": MEANING})
        out += [response.model_dump(), c.responses.create(
            model=OPENAI_MODEL, input=items, tools=RESPONSE_TOOLS).model_dump()]

        with c.responses.stream(model=OPENAI_MODEL, input=PROMPT, tools=RESPONSE_TOOLS) as s:
            response = s.get_final_response()
        result = [{"type": "function_call_output", "call_id": response.output[1].call_id,
                   "output": MEANING}]
        with c.responses.stream(model=OPENAI_MODEL, input=result, tools=RESPONSE_TOOLS,
                                previous_response_id=response.id) as s:
            out += [response.model_dump(), s.get_final_response().model_dump()]
    return out


def test_stub_from_a_cassette_of_openai_calls_serves_what_the_run_received(
        tmp_path: Path) -> None:
    parent = tmp_path / "openai.jsonl"
    with StubServer(OPENAI_SCRIPT) as server, recorder.record(parent):
        recorded = openai_agent(server.url)
    received = _responses(parent)
    assert [status for status, _, _ in received] == [429, 200, 200, 429, 200,
                                                     429, 200, 200, 429, 200, 200]

    script = tmp_path / "openai.stub.json"
    made = CliRunner().invoke(cli, ["stub", "--from", str(parent), "-o", str(script)])
    assert made.exit_code == 0, made.output
    assert "11 model calls" in made.output and "left out" not in made.output
    rules = json.loads(script.read_text())["rules"]
    assert [(r["when"]["endpoint"], r["when"]["stream"], r["when"]["position"])
            for r in rules] == [
        ("/v1/responses", True, 1),  # it names the response it continues: first
        ("/v1/chat/completions", False, 0), ("/v1/chat/completions", False, 1),
        ("/v1/chat/completions", True, 0), ("/v1/responses", False, 0),
        ("/v1/responses", False, 1), ("/v1/responses", True, 0)]
    assert rules[0]["when"]["previous_response_id"] == recorded[5]["id"]  # type: ignore[index]
    assert rules[1]["error"] == {"status": 429, "type": "requests",
                                 "message": rules[1]["error"]["message"],
                                 "headers": {"retry-after": "0.01", "retry-after-ms": "10"}}
    assert "message" in rules[1]["then"][0] and "sse" in rules[3]["then"][0]

    for args in (["--script", str(script)], ["--from", str(parent)]):
        again = tmp_path / f"again-{args[0][2:]}.jsonl"
        with cli_stub(tmp_path, *args) as url, recorder.record(again):
            assert openai_agent(url) == recorded  # ids and all, as the SDK read them
        # The same 429s with their retry headers, the same bodies and streams byte for byte.
        assert _responses(again) == received


def test_an_openai_message_in_a_script_answers_either_way() -> None:
    """A recorded chat completion is sent as it is to a JSON request, and as its text,
    tool calls and usage to a streamed one (and to the other API)."""
    import openai

    completion = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
                  "model": OPENAI_MODEL, "choices": [{
                      "index": 0, "finish_reason": "tool_calls", "logprobs": None,
                      "message": {"role": "assistant", "content": "Looking.", "refusal": None,
                                  "tool_calls": [{"id": "call_7", "type": "function",
                                                  "function": {"name": "lookup",
                                                               "arguments": '{"word":"x"}'}}]}}],
                  "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
                            "prompt_tokens_details": {"cached_tokens": 4}}}
    with StubServer({"turns": [], "default": {"message": completion}}) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test",
                          max_retries=0) as c:
        user = [{"role": "user", "content": "x?"}]
        assert c.chat.completions.create(model=OPENAI_MODEL,
                                         messages=user).model_dump(exclude_none=True) == \
            openai.types.chat.ChatCompletion.model_validate(completion).model_dump(
                exclude_none=True)
        with c.chat.completions.stream(model=OPENAI_MODEL, messages=user,
                                       stream_options={"include_usage": True}) as s:
            streamed = s.get_final_completion()
        assert streamed.choices[0].message.content == "Looking."
        assert streamed.choices[0].finish_reason == "tool_calls"
        [call] = streamed.choices[0].message.tool_calls or []
        assert (call.id, call.function.name, call.function.arguments) == \
            ("call_7", "lookup", '{"word":"x"}')
        assert streamed.usage is not None and streamed.usage.prompt_tokens == 12
        response = c.responses.create(model=OPENAI_MODEL, input="x?")
        assert response.output_text == "Looking."
        assert [(o.call_id, o.name) for o in response.output
                if o.type == "function_call"] == [("call_7", "lookup")]
